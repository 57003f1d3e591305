"""Moved to :mod:`pyro_bdl.guides.laplace.subnetwork`; this path goes in the next release."""

import warnings

from pyro_bdl.guides.laplace.subnetwork import (  # noqa: F401
    RULES,
    SubnetworkRule,
    parse_subnetwork,
)

warnings.warn(
    "pyro_bdl.guides.subnetwork moved to pyro_bdl.guides.laplace.subnetwork; "
    "the old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
