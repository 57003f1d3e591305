"""Deprecated path of AutoMultiSWAG: moved to :mod:`pyro_bdl.guides.ensemble`;
the old path goes in the next release."""

import warnings

from pyro_bdl.guides.ensemble import AutoMultiSWAG

__all__ = ["AutoMultiSWAG"]

warnings.warn(
    "pyro_bdl.guides.ensemble_swag moved to pyro_bdl.guides.ensemble; the old path goes in "
    "the next release. Import pyro_bdl.guides.ensemble instead.",
    DeprecationWarning,
    stacklevel=2,
)
