"""Inference: the sufficient-statistic ELBO and its KL estimators, VOGN."""

from pyro_bdl.infer.elbo import TraceSuffStat_ELBO
from pyro_bdl.infer.kl import KL_ESTIMATORS, find_kl_estimator, register_kl_estimator

__all__: list[str] = [
    "KL_ESTIMATORS",
    "TraceSuffStat_ELBO",
    "find_kl_estimator",
    "register_kl_estimator",
]
