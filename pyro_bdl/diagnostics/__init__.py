"""Diagnostics: calibration and out-of-distribution metrics, ArviZ export, Pareto k̂, plots.

The metrics load with the package; the ArviZ export, PSIS and the plots (which need ArviZ,
xarray and matplotlib) load on first use, so ``import pyro_bdl`` stays light. They work on
ArviZ 0.x and 1.x alike; :mod:`~pyro_bdl.diagnostics.arviz_compat` is the one module that tells
them apart.

Usage::

    probs = predictor(x_test)
    bdl.diagnostics.ece(probs, y_test), bdl.diagnostics.ood_auroc(probs, predictor(x_ood))
    idata = bdl.diagnostics.to_inference_data(model, guide, x_test, y_test, num_samples=200)
    bdl.diagnostics.psis_khat(model, guide, x_train, y_train, num_samples=2000).band
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyro_bdl.diagnostics import metrics, metrics_binary, ood
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
from pyro_bdl.diagnostics.temperature import fit_temperature, temperature_scale

if TYPE_CHECKING:
    from pyro_bdl.diagnostics import arviz_compat, export, plots, psis
    from pyro_bdl.diagnostics.export import (
        load_inference_data,
        save_inference_data,
        to_inference_data,
    )
    from pyro_bdl.diagnostics.plots import plot_entropy, plot_reliability, save_arviz_plots
    from pyro_bdl.diagnostics.psis import PsisResult, khat_band, loo, pareto_khat, psis_khat

#: Names loaded on first access: name -> the submodule that defines it (ArviZ / matplotlib).
_LAZY = {
    "arviz_compat": "",
    "export": "",
    "plots": "",
    "psis": "",
    "load_inference_data": "export",
    "save_inference_data": "export",
    "to_inference_data": "export",
    "plot_entropy": "plots",
    "plot_reliability": "plots",
    "save_arviz_plots": "plots",
    "PsisResult": "psis",
    "khat_band": "psis",
    "loo": "psis",
    "pareto_khat": "psis",
    "psis_khat": "psis",
}


def __getattr__(name: str) -> Any:
    owner = _LAZY.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{owner or name}")
    value = module if not owner else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "PsisResult",
    "Reliability",
    "accuracy",
    "arviz_compat",
    "auroc",
    "brier",
    "ece",
    "export",
    "fit_temperature",
    "fpr_at_95_tpr",
    "fpr_at_tpr",
    "gaussian_log_likelihood",
    "khat_band",
    "load_inference_data",
    "loo",
    "metrics",
    "metrics_binary",
    "nll",
    "ood",
    "ood_auroc",
    "ood_scores",
    "pareto_khat",
    "plot_entropy",
    "plot_reliability",
    "plots",
    "predictive_entropy",
    "psis",
    "psis_khat",
    "reliability",
    "rmse",
    "save_arviz_plots",
    "save_inference_data",
    "temperature_scale",
    "to_inference_data",
]
