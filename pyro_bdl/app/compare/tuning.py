"""The fair-tuning protocol of ``pyro-bdl compare --tune``: every method gets the same budget, a
grid of its learning rate times its own key hyperparameter, scored on the same validation rows
carved from the training split; the test split is never an input.

For each method: :func:`~pyro_bdl.app.compare.problem.split_validation` holds out
``VALIDATION_FRACTION`` of the training rows (the same rows for every method, drawn with the
problem's seed); each setting of :data:`GRIDS` trains on the other rows and is scored by its
validation NLL (mean negative log predictive density: of the labels for a classifier, of the
targets for a regressor); the best setting is then trained on the whole training split and
scored on the test split as usual. A setting whose training diverges scores ``inf``.

By construction the search cannot see the test rows: :func:`select` receives a
:class:`~pyro_bdl.app.data.Dataset` built from the training and validation arrays only (the
validation rows stand in its test slot) and no OOD inputs.

Why a grid per method and not one shared setting: the methods' rates live on different scales
(SWAG's per-example SGD rate, Adam's, VOGN's natural-gradient step), and each has one setting
that decides its fit more than the others (the prior's scale, equivalently the prior precision
1/s² of MAP, Laplace and VOGN; SWAG's constant rate). Every grid has the same number of points,
so no method is tuned harder than its baseline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from itertools import product
from typing import Any

import torch

from pyro_bdl.app.compare.problem import Problem, seed_everything, split_validation
from pyro_bdl.app.data import Dataset
from pyro_bdl.diagnostics import metrics
from pyro_bdl.priors import Normal

__all__ = ["GRIDS", "VALIDATION_FRACTION", "select", "tune"]

#: Share of the training split held out to score the grid (the rows map_ts and subnet_laplace
#: hold out at the same fraction and seed).
VALIDATION_FRACTION = 0.1
#: The learning rates every Adam- or VOGN-trained method tries.
LR_GRID = (1e-3, 3e-3, 1e-2)
#: The prior scales s (prior precision 1/s²) tried as the key hyperparameter.
PRIOR_SCALES = (0.3, 1.0)
#: SWAG's constant per-example rate of the SWAG phase (its SGD phase has a fixed rate, so this
#: is the rate it tunes); three values like LR_GRID.
SWA_LR_GRID = (0.03, 0.1, 0.3)

_LR_PRIOR = {"lr": LR_GRID, "prior_scale": PRIOR_SCALES}
#: Method -> {setting: values}; a method's grid is the product (6 points each). ``lr`` and
#: ``prior_scale`` are Problem settings; any other key is a keyword of the method's fit function.
GRIDS: dict[str, dict[str, tuple]] = {
    "map": _LR_PRIOR,
    "map_ts": _LR_PRIOR,
    "meanfield": _LR_PRIOR,
    "radial": _LR_PRIOR,
    "vogn": _LR_PRIOR,
    # IVON's own rate (not Problem.lr: see app.compare.ivon) times its tempering.
    "ivon": {"ivon_lr": (0.1, 0.3, 1.0), "ess_factor": (1.0, 10.0)},
    "subnet_laplace": _LR_PRIOR,  # λ is then tuned on its own held-out rows, as untuned
    "laplace": _LR_PRIOR,
    "swag": {"swa_lr": SWA_LR_GRID, "prior_scale": PRIOR_SCALES},
    "swag_diag": {"swa_lr": SWA_LR_GRID, "prior_scale": PRIOR_SCALES},
    # The ensembles tune their members' settings (each member is a map / swag run).
    "ensemble": _LR_PRIOR,
    "multiswag": {"swa_lr": SWA_LR_GRID, "prior_scale": PRIOR_SCALES},
    # The dropout rate (then not chosen again inside the fit) times the prior's length-scale.
    "mc_dropout": {"rate": (0.01, 0.05, 0.1), "prior_scale": PRIOR_SCALES},
}


def apply(problem: Problem, setting: Mapping[str, Any]) -> tuple[Problem, dict]:
    """``(problem with the setting's Problem fields, the fit function's keywords)``."""
    fields: dict[str, Any] = {}
    keywords = dict(setting)
    if "lr" in keywords:
        fields["lr"] = keywords.pop("lr")
    if "prior_scale" in keywords:
        fields["prior"] = Normal(scale=keywords.pop("prior_scale"))
    return dataclasses.replace(problem, **fields), keywords


def validation_nll(predict: Callable, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log predictive density of ``y``: class probabilities or a distribution."""
    out = predict(x)
    if isinstance(out, torch.Tensor):
        return metrics.nll(out, y)
    return float(-out.log_prob(y).mean())


def select(name: str, fit: Callable, tuning: Problem) -> dict[str, Any]:
    """Score every setting of ``GRIDS[name]`` with ``fit`` on ``tuning`` (whose test slot holds
    the validation rows); returns ``{"setting": best, "grid": [{"setting", "val_nll"}, ...]}``.
    """
    grid = GRIDS[name]
    rows: list[dict[str, Any]] = []
    x_val = tuning.dataset.x_test.to(tuning.device)
    y_val = tuning.dataset.y_test.to(tuning.device)
    for values in product(*grid.values()):
        setting = dict(zip(grid, values))
        problem, keywords = apply(tuning, setting)
        seed_everything(problem.seed)
        row: dict[str, Any] = {"setting": setting}
        try:
            score = validation_nll(fit(problem, **keywords), x_val, y_val)
        except (FloatingPointError, ValueError, RuntimeError) as err:
            # Diverged: train_loop's FloatingPointError, or a distribution refusing NaN
            # parameters; the setting loses and the row says why.
            score = math.inf
            row["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        row["val_nll"] = score if math.isfinite(score) else math.inf
        rows.append(row)
    best = min(rows, key=lambda row: float(row["val_nll"]))
    return {"setting": best["setting"], "grid": rows}


def tune(name: str, fit: Callable, problem: Problem) -> tuple[Problem, dict, dict[str, Any]]:
    """The protocol for one method: ``(problem with the chosen Problem settings, the chosen fit
    keywords, the record {"setting", "grid", "validation_rows"})``; the caller trains on the
    whole training split with them and scores on the test split.

    Usage::

        chosen, keywords, record = tune("map", METHODS["map"], problem)
        predict = METHODS["map"](chosen, **keywords)
    """
    if name not in GRIDS:
        raise ValueError(
            f"no tuning grid for method {name!r}; expected one of {', '.join(map(repr, GRIDS))} "
            "(add its grid to pyro_bdl.app.compare.tuning.GRIDS)."
        )
    train, x_val, y_val = split_validation(problem, VALIDATION_FRACTION)
    data = train.dataset
    # Only the training and validation arrays go in: the test split cannot reach the search.
    held = Dataset(
        data.name, data.x_train, data.y_train, x_val, y_val, num_classes=data.num_classes
    )
    record = select(name, fit, dataclasses.replace(train, dataset=held, ood_x=None))
    record["validation_rows"] = len(y_val)
    chosen, keywords = apply(problem, record["setting"])
    return chosen, keywords, record
