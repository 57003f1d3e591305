"""Moved to :mod:`pyro_bdl.guides.laplace.evidence`; this path goes in the next release."""

import warnings

from pyro_bdl.guides.laplace.evidence import (  # noqa: F401
    PRIOR_STRUCTURES,
    evidence,
    fit_statistics,
    optimize_marglik,
)

warnings.warn(
    "pyro_bdl.guides.laplace_marglik moved to pyro_bdl.guides.laplace.evidence; "
    "the old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
