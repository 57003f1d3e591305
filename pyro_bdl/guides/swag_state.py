"""Deprecated path of the SWAG state-dict hooks: moved to :mod:`pyro_bdl.guides.swag`;
the old path goes in the next release."""

import warnings

from pyro_bdl.guides.swag import convert_second_moment, sync_counter

__all__ = ["convert_second_moment", "sync_counter"]

warnings.warn(
    "pyro_bdl.guides.swag_state moved to pyro_bdl.guides.swag; the old path goes in the next "
    "release. Import pyro_bdl.guides.swag instead.",
    DeprecationWarning,
    stacklevel=2,
)
