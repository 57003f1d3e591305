"""Moved to :mod:`pyro_bdl.guides.laplace.posterior`; this path goes in the next release."""

import warnings

from pyro_bdl.guides.laplace.posterior import (  # noqa: F401
    KronBlock,
    KronPosterior,
    check_blockwise,
    kron_blocks,
)

warnings.warn(
    "pyro_bdl.guides.laplace_kron moved to pyro_bdl.guides.laplace.posterior; "
    "the old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
