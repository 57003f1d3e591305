"""Moved to :mod:`pyro_bdl.guides.laplace.subnetwork`; this path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.laplace.subnetwork import (  # noqa: F401
    RULES,
    SubnetworkRule,
    parse_subnetwork,
)

warn_moved(__name__, "pyro_bdl.guides.laplace.subnetwork")
