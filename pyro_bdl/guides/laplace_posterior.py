"""Moved to :mod:`pyro_bdl.guides.laplace.posterior` (the structures) and
:mod:`pyro_bdl.guides.laplace.predictive` (the linearized predictive); this path goes in the next
release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.laplace.evidence import (  # noqa: F401
    tune_grid,
    val_ll_score,
)
from pyro_bdl.guides.laplace.posterior import (  # noqa: F401
    MATERIAL_JITTER,
    RoundOffWarning,
    SubnetNormal,
    accumulation_dtype,
    cholesky_jitter,
    posterior_factor,
)
from pyro_bdl.guides.laplace.predictive import (  # noqa: F401
    LINKS,
    laplace_bridge,
    linearized_predictive,
    predictive,
    predictive_log_likelihood,
    probit_logits,
)

warn_moved(__name__, "pyro_bdl.guides.laplace.posterior and pyro_bdl.guides.laplace.predictive")
