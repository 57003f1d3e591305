"""Moved to :mod:`pyro_bdl.guides.laplace.posterior`; this path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.laplace.posterior import (  # noqa: F401
    DiagPosterior,
    FullPosterior,
    StructuredNormal,
)

warn_moved(__name__, "pyro_bdl.guides.laplace.posterior")
