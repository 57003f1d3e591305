"""Fault injection: bad inputs, interrupted writes, mismatched state; each refusal leaves nothing changed."""
