"""Fault injection: bad inputs, interrupted writes and mismatched state.

Each refusal must leave nothing changed.
"""
