"""Deprecated path of the SWAG state-dict hooks: moved to :mod:`pyro_bdl.guides.swag`;
the old path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.swag import convert_second_moment, sync_counter

__all__ = ["convert_second_moment", "sync_counter"]

warn_moved(__name__, "pyro_bdl.guides.swag")
