"""Deprecated path of MemberMixture: moved to :mod:`pyro_bdl.guides.ensemble`;
the old path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.ensemble import MemberMixture

__all__ = ["MemberMixture"]

warn_moved(__name__, "pyro_bdl.guides.ensemble")
