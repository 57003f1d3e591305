"""Moved to :mod:`pyro_bdl.infer.natural_gradient.ivon`; this path goes in the next release."""

import warnings

from pyro_bdl.infer.natural_gradient.ivon import IVON

warnings.warn(
    "pyro_bdl.infer.ivon moved to pyro_bdl.infer.natural_gradient.ivon; the old path goes in the "
    "next release. Import IVON from pyro_bdl.infer.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["IVON"]
