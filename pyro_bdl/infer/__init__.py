"""Inference: the sufficient-statistic ELBO and its KL estimators, VOGN and IVON."""

from pyro_bdl.infer.elbo import KLFallbackWarning, TraceSuffStat_ELBO
from pyro_bdl.infer.ivon import IVON
from pyro_bdl.infer.ivon_update import IVONHyperparameters, ivon_update
from pyro_bdl.infer.kl import KL_ESTIMATORS, find_kl_estimator, register_kl_estimator
from pyro_bdl.infer.vogn import VOGN, VOGNGuide
from pyro_bdl.infer.vogn_update import VOGNHyperparameters, VOGNState

__all__: list[str] = [
    "IVON",
    "KL_ESTIMATORS",
    "VOGN",
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
