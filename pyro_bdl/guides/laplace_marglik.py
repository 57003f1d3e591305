"""Moved to :mod:`pyro_bdl.guides.laplace.evidence`; this path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.laplace.evidence import (  # noqa: F401
    PRIOR_STRUCTURES,
    evidence,
    fit_statistics,
    optimize_marglik,
)

warn_moved(__name__, "pyro_bdl.guides.laplace.evidence")
