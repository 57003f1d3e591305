"""Curvature as plain functions of tensors: squared per-example gradients, subnetwork GGNs."""

__all__: list[str] = []
