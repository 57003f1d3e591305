"""Deprecated path of AutoMultiSWAG: moved to :mod:`pyro_bdl.guides.ensemble`;
the old path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.ensemble import AutoMultiSWAG

__all__ = ["AutoMultiSWAG"]

warn_moved(__name__, "pyro_bdl.guides.ensemble")
