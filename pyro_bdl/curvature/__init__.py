"""Curvature as plain functions of tensors: squared per-example gradients, the Jacobian over a
subnetwork of the weights, the GGN over it and its diagonal, and their memory budgets."""

from pyro_bdl.curvature.per_example import (
    NoPerExampleForm,
    PerExampleGradients,
    substitute,
    vmap_squared_gradients,
)

__all__: list[str] = []
__all__ += ["NoPerExampleForm", "PerExampleGradients", "substitute", "vmap_squared_gradients"]

from pyro_bdl.curvature.ggn import diagonal_ggn, output_hessian_factor, subnet_ggn  # noqa: E402
from pyro_bdl.curvature.jacobian import ParamSlot, subnet_jacobian  # noqa: E402
from pyro_bdl.curvature.memory import TensorMemoryTracker  # noqa: E402

__all__ += [
    "ParamSlot",
    "TensorMemoryTracker",
    "diagonal_ggn",
    "output_hessian_factor",
    "subnet_ggn",
    "subnet_jacobian",
]
