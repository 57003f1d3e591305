"""Deprecated path of MemberMixture: moved to :mod:`pyro_bdl.guides.ensemble`;
the old path goes in the next release."""

import warnings

from pyro_bdl.guides.ensemble import MemberMixture

__all__ = ["MemberMixture"]

warnings.warn(
    "pyro_bdl.guides.ensemble_mixture moved to pyro_bdl.guides.ensemble; the old path goes in "
    "the next release. Import pyro_bdl.guides.ensemble instead.",
    DeprecationWarning,
    stacklevel=2,
)
