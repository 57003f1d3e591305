"""Deprecated path of the SWAG Gaussian: moved to :mod:`pyro_bdl.guides.swag`;
the old path goes in the next release."""

import warnings

from pyro_bdl.guides.swag import SWAGNormal, swag_collect_, swag_sample, swag_std, swag_variance

__all__ = ["SWAGNormal", "swag_collect_", "swag_sample", "swag_std", "swag_variance"]

warnings.warn(
    "pyro_bdl.guides.swag_gaussian moved to pyro_bdl.guides.swag; the old path goes in the next "
    "release. Import pyro_bdl.guides.swag instead.",
    DeprecationWarning,
    stacklevel=2,
)
