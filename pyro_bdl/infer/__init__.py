"""Inference: the sufficient-statistic ELBO and its KL estimators, VOGN."""

from pyro_bdl.infer.elbo import KLFallbackWarning, TraceSuffStat_ELBO
from pyro_bdl.infer.kl import KL_ESTIMATORS, find_kl_estimator, register_kl_estimator
from pyro_bdl.infer.vogn import VOGN, VOGNGuide
from pyro_bdl.infer.vogn_update import VOGNHyperparameters, VOGNState

__all__: list[str] = [
    "KL_ESTIMATORS",
    "VOGN",
    "KLFallbackWarning",
    "TraceSuffStat_ELBO",
    "VOGNGuide",
    "VOGNHyperparameters",
    "VOGNState",
    "find_kl_estimator",
    "register_kl_estimator",
]
