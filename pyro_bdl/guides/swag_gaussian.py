"""Deprecated path of the SWAG Gaussian: moved to :mod:`pyro_bdl.guides.swag`;
the old path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.swag import SWAGNormal, swag_collect_, swag_sample, swag_std, swag_variance

__all__ = ["SWAGNormal", "swag_collect_", "swag_sample", "swag_std", "swag_variance"]

warn_moved(__name__, "pyro_bdl.guides.swag")
