"""Moved to :mod:`pyro_bdl.guides.laplace.posterior`; this path goes in the next release."""

import warnings

from pyro_bdl.guides.laplace.evidence import (  # noqa: F401
    tune_grid,
    val_ll_score,
)
from pyro_bdl.guides.laplace.posterior import (  # noqa: F401
    LINKS,
    MATERIAL_JITTER,
    RoundOffWarning,
    SubnetNormal,
    accumulation_dtype,
    cholesky_jitter,
    laplace_bridge,
    linearized_predictive,
    posterior_factor,
    predictive,
    predictive_log_likelihood,
    probit_logits,
)

warnings.warn(
    "pyro_bdl.guides.laplace_posterior moved to pyro_bdl.guides.laplace.posterior; "
    "the old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
