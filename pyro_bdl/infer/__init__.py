"""Inference: the sufficient-statistic ELBO and its KL estimators, VOGN and IVON, and the fused
Pyro optimizer."""

from pyro_bdl.guides.natural_gradient import NaturalGradientGuide
from pyro_bdl.infer.elbo import KLFallbackWarning, TraceSuffStat_ELBO
from pyro_bdl.infer.fused_optim import FusedOptim
from pyro_bdl.infer.kl import KL_ESTIMATORS, find_kl_estimator, register_kl_estimator
from pyro_bdl.infer.natural_gradient import (
    IVON,
    VOGN,
    IVONHyperparameters,
    NaturalGradientState,
    VOGNHyperparameters,
    ivon_update,
)

#: The earlier names of the guide and the state that VOGN and IVON share.
VOGNGuide = NaturalGradientGuide
VOGNState = NaturalGradientState

__all__: list[str] = [
    "IVON",
    "KL_ESTIMATORS",
    "VOGN",
    "FusedOptim",
    "IVONHyperparameters",
    "KLFallbackWarning",
    "TraceSuffStat_ELBO",
    "VOGNGuide",
    "VOGNHyperparameters",
    "VOGNState",
    "find_kl_estimator",
    "ivon_update",
    "register_kl_estimator",
]
