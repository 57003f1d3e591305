"""The linearized Laplace guide family (docs/design/laplace.md).

A Laplace fit reads as :mod:`~pyro_bdl.guides.laplace.guide` (the guides :class:`AutoLaplace`
and :class:`AutoSubnetLaplace`) and :mod:`~pyro_bdl.guides.laplace.model` (the passes over the
network); the mathematics is in :mod:`~pyro_bdl.guides.laplace.posterior` (the structures and
their factorisation), :mod:`~pyro_bdl.guides.laplace.predictive` (the linearized predictive) and
:mod:`~pyro_bdl.guides.laplace.evidence` (the marginal likelihood and the search over λ and σ,
which warns with :class:`PriorPrecisionBoundWarning` when λ ends at a bound);
:mod:`~pyro_bdl.guides.laplace.subnetwork` chooses the subnetwork;
:mod:`~pyro_bdl.guides.laplace.padding` regroups right-padded text batches by length for a fit
(``fit(trim_padding=True)``).
"""

from pyro_bdl.guides.laplace.evidence import PriorPrecisionBoundWarning
from pyro_bdl.guides.laplace.guide import (
    HESSIAN_STRUCTURES,
    PRIOR_SCALINGS,
    AutoLaplace,
    AutoSubnetLaplace,
    NotFittedError,
)
from pyro_bdl.guides.laplace.posterior import SubnetNormal

__all__ = [
    "HESSIAN_STRUCTURES",
    "PRIOR_SCALINGS",
    "AutoLaplace",
    "AutoSubnetLaplace",
    "NotFittedError",
    "PriorPrecisionBoundWarning",
    "SubnetNormal",
]
