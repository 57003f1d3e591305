"""Curvature as plain functions of tensors: squared per-example gradients, subnetwork GGNs."""

from pyro_bdl.curvature.per_example import (
    PerExampleGradients,
    substitute,
    vmap_squared_gradients,
)

__all__: list[str] = []
__all__ += ["PerExampleGradients", "substitute", "vmap_squared_gradients"]

from pyro_bdl.curvature.subnet import (  # noqa: E402
    ParamSlot,
    diagonal_ggn,
    subnet_ggn,
    subnet_jacobian,
)

__all__ += ["ParamSlot", "diagonal_ggn", "subnet_ggn", "subnet_jacobian"]
