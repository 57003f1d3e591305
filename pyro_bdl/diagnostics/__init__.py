"""Diagnostics: calibration and out-of-distribution metrics, ArviZ export, Pareto k̂, plots.

Usage::

    probs = predictor(x_test)
    bdl.diagnostics.ece(probs, y_test), bdl.diagnostics.ood_auroc(probs, predictor(x_ood))
    idata = bdl.diagnostics.to_inference_data(model, guide, x_test, y_test, num_samples=200)
    bdl.diagnostics.psis_khat(model, guide, x_train, y_train, num_samples=2000).band
"""

from pyro_bdl.diagnostics import metrics, ood, plots
from pyro_bdl.diagnostics.export import (
    load_inference_data,
    save_inference_data,
    to_inference_data,
)
from pyro_bdl.diagnostics.metrics import (
    Reliability,
    accuracy,
    brier,
    ece,
    gaussian_log_likelihood,
    nll,
    reliability,
    rmse,
)
from pyro_bdl.diagnostics.ood import (
    auroc,
    fpr_at_95_tpr,
    fpr_at_tpr,
    ood_auroc,
    ood_scores,
    predictive_entropy,
)
from pyro_bdl.diagnostics.plots import plot_entropy, plot_reliability, save_arviz_plots
from pyro_bdl.diagnostics.psis import PsisResult, khat_band, loo, pareto_khat, psis_khat
from pyro_bdl.diagnostics.temperature import fit_temperature, temperature_scale

__all__ = [
    "PsisResult",
    "Reliability",
    "accuracy",
    "auroc",
    "brier",
    "ece",
    "fit_temperature",
    "fpr_at_95_tpr",
    "fpr_at_tpr",
    "gaussian_log_likelihood",
    "khat_band",
    "load_inference_data",
    "loo",
    "metrics",
    "nll",
    "ood",
    "ood_auroc",
    "ood_scores",
    "pareto_khat",
    "plot_entropy",
    "plot_reliability",
    "plots",
    "predictive_entropy",
    "psis_khat",
    "reliability",
    "rmse",
    "save_arviz_plots",
    "save_inference_data",
    "temperature_scale",
    "to_inference_data",
]
