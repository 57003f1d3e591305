"""Runs the chosen methods on one :class:`Problem` and gathers one row of figures per method.

For each method: accuracy, NLL, ECE, Brier on the test set; OOD AUROC (and FPR at 95% TPR in the
JSON) with the predictive entropy as the score when ``problem.ood_x`` is set; and, when an output
folder is given, the exported ArviZ data (``<method>.nc``) and the plots (reliability diagram,
entropy histograms, ArviZ's PPC / LOO-k̂ / forest plots).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pyro_bdl._caller import user_stacklevel
from pyro_bdl.app.compare import tuning
from pyro_bdl.app.compare.problem import Problem, record_posteriors, seed_everything
from pyro_bdl.app.compare.registry import METHODS
from pyro_bdl.diagnostics import metrics, ood

__all__ = [
    "COLUMNS",
    "evaluate",
    "export_method",
    "format_table",
    "run",
    "write_json",
    "write_text_atomic",
]

#: (key, header, format) of the printed table, in order.
COLUMNS = [
    ("method", "method", "{}"),
    ("accuracy", "accuracy", "{:.4f}"),
    ("nll", "test NLL", "{:.4f}"),
    ("ece", "ECE", "{:.4f}"),
    ("brier", "Brier", "{:.4f}"),
    ("ood_auroc", "OOD AUROC", "{:.4f}"),
    ("fit_seconds", "fit time (s)", "{:.1f}"),
]
#: The column added when a row was tuned (``run(..., tune=True)``).
TUNED_COLUMN = ("tuned", "tuned setting", "{}")


def evaluate(
    probs: torch.Tensor, y: torch.Tensor, probs_ood: torch.Tensor | None = None
) -> dict[str, float | None]:
    """The figures of one method on the test set (and on the OOD inputs, if given)."""
    row: dict[str, float | None] = {
        "accuracy": metrics.accuracy(probs, y),
        "nll": metrics.nll(probs, y),
        "ece": metrics.ece(probs, y),
        "brier": metrics.brier(probs, y),
        "ood_auroc": None,
        "ood_fpr95": None,
    }
    if probs_ood is not None:
        row["ood_auroc"] = ood.ood_auroc(probs, probs_ood)
        row["ood_fpr95"] = ood.fpr_at_95_tpr(probs, probs_ood)
    return row


def export_method(
    name: str,
    predict: Callable,
    seen: list,
    probs: torch.Tensor,
    probs_ood: torch.Tensor | None,
    problem: Problem,
    output: Path,
    notes: list[str] | None = None,
) -> list[Path]:
    """Write ``<name>.nc`` and the plots of one method into ``output``; returns the paths.
    Plots left out, and why, are appended to ``notes``."""
    # local: ArviZ and matplotlib load only when a run writes files
    from pyro_bdl.diagnostics import arviz_compat, export, plots

    output.mkdir(parents=True, exist_ok=True)
    x_test = problem.dataset.x_test.to(problem.device)
    y_test = problem.dataset.y_test.to(problem.device)
    model = getattr(predict, "model", None)
    guide = getattr(predict, "guide", None)
    if (model is None or guide is None) and seen:
        model, guide = seen[-1]
    if model is not None and guide is not None:
        data = export.to_inference_data(
            model, guide, x_test, y_test, num_samples=problem.num_samples
        )
    else:
        data = export.mean_predictive_data(probs, y_test)
    written = [Path(export.save_inference_data(data, output / f"{name}.nc"))]

    fig = plots.plot_reliability(
        metrics.reliability(probs, y_test), title=f"{name}: reliability diagram"
    )
    written.append(_save(fig, output / f"{name}-reliability.png"))
    entropy_ood = ood.predictive_entropy(probs_ood) if probs_ood is not None else None
    fig = plots.plot_entropy(
        ood.predictive_entropy(probs),
        entropy_ood,
        num_classes=probs.shape[1],
        title=f"{name}: predictive entropy"
        + (f" (OOD: {problem.ood_name})" if problem.ood_name else ""),
    )
    written.append(_save(fig, output / f"{name}-entropy.png"))
    if "posterior" in arviz_compat.group_names(data):
        if is_point_mass(data):
            # Every draw is the same weights (a point estimate such as map or map_ts): the
            # importance ratios of PSIS-LOO are all 1, so its k̂ plot would be blank.
            data = arviz_compat.drop_groups(data, ["log_likelihood"])
            if notes is not None:
                notes.append(POINT_MASS_NOTE)
        try:
            written += plots.save_arviz_plots(data, output, prefix=f"{name}-")
        except Exception as err:  # an optional figure must not lose the run's results
            warnings.warn(
                f"ArviZ plots for {name!r} failed: {err}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
    return written


#: Why a point method's row has no LOO-k̂ plot.
POINT_MASS_NOTE = (
    "no LOO-k̂ plot: the posterior is a point mass (every draw the same weights), so PSIS-LOO's "
    "importance ratios are all 1 and the plot would be blank"
)


def is_point_mass(data) -> bool:
    """Whether every posterior draw in ArviZ ``data`` holds the same values."""
    return all(
        float(abs(data.posterior[v] - data.posterior[v].isel(chain=0, draw=0)).max()) == 0.0
        for v in data.posterior.data_vars
    )


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def run(
    problem: Problem,
    methods: list[str],
    *,
    output: str | Path | None = None,
    keep_going: bool = False,
    on_row: Callable[[list[dict]], None] | None = None,
    tune: bool = False,
) -> list[dict]:
    """Train every method in ``methods`` on ``problem``; one row of figures per method.

    With ``output``, also write each method's ArviZ data and plots there (the paths are listed
    in the row's ``"files"``).

    :param bool keep_going: when a method raises, record it in its row (``"error"``: the
        exception's type and first line, ``"traceback"``: the whole of it) and go on with the
        next method, instead of raising; the rows of the other methods are kept either way
        when ``on_row`` saves them.
    :param on_row: called with the rows so far after each method, failed ones included (how
        ``pyro-bdl compare`` saves every finished result as soon as it exists).
    :param bool tune: choose each method's settings first by the fair-tuning protocol
        (:mod:`pyro_bdl.app.compare.tuning`: the same grid size and validation rows for every
        method, carved from the training split); the row gets ``"tuned"`` (the chosen setting),
        ``"tuning"`` (every setting's validation NLL) and ``"tune_seconds"``.
    """
    if problem.is_regression:
        raise ValueError(
            f"compare.run scores classifiers; dataset {problem.dataset.name!r} is a regression "
            "dataset (num_classes=None). Call the registry's fit functions (METHODS[name]) and "
            "score their predictive distributions instead, as benchmarks/uci.py does."
        )
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(map(repr, unknown))}; expected some of "
            f"{', '.join(map(repr, METHODS))}."
        )
    rows: list[dict] = []
    x_test = problem.dataset.x_test.to(problem.device)
    y_test = problem.dataset.y_test.to(problem.device)
    x_ood = problem.ood_x.to(problem.device) if problem.ood_x is not None else None
    for name in methods:
        row: dict[str, Any] = {"method": name}
        try:
            _run_one(name, problem, row, x_test, y_test, x_ood, output, tune)
        except Exception as err:
            if not keep_going:
                raise
            first = (str(err).strip().splitlines() or [""])[0]
            notes = "".join(f" ({note})" for note in getattr(err, "__notes__", ()))
            row["error"] = f"{type(err).__name__}: {first}".rstrip(": ") + notes
            row["traceback"] = traceback.format_exc()
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def _run_one(name, problem, row, x_test, y_test, x_ood, output, tune=False) -> None:
    """Fit, score and (with ``output``) export one method, filling ``row`` as figures arrive."""
    keywords: dict = {}
    if tune:
        start = time.perf_counter()
        problem, keywords, record = tuning.tune(name, METHODS[name], problem)
        row["tuned"] = record["setting"]
        row["tuning"] = record
        row["tune_seconds"] = time.perf_counter() - start
    seed_everything(problem.seed)
    start = time.perf_counter()
    predict = METHODS[name](problem, **keywords)
    # The rate it trained with (chosen by --tune when tuned): the problem's, unless the method
    # has its own and its predictor says so (ivon).
    row["lr"] = getattr(predict, "lr", problem.lr)
    fit_seconds = time.perf_counter() - start
    with record_posteriors() as seen:
        probs = _probs(predict, x_test)
    probs_ood = _probs(predict, x_ood) if x_ood is not None else None
    row.update(evaluate(probs, y_test, probs_ood))
    row["fit_seconds"] = fit_seconds
    row["reliability"] = metrics.reliability(probs, y_test).to_dict()
    if output is not None:
        notes: list[str] = []
        files = export_method(name, predict, seen, probs, probs_ood, problem, Path(output), notes)
        row["files"] = [str(f) for f in files]
        if notes:
            row["notes"] = notes


def _probs(predict: Callable, x: torch.Tensor) -> torch.Tensor:
    probs = predict(x)
    if not isinstance(probs, torch.Tensor):  # a classifier's predictor returns probabilities
        raise TypeError(
            f"a predictor returned {type(probs).__name__}; expected class probabilities, a tensor "
            "of shape (n, C). Make the method's predict(x) return probs (logits.softmax(-1))."
        )
    return probs


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per row; a failed row (one with ``"error"``) reads
    ``failed`` in its figures and its error is listed under the table."""
    columns = COLUMNS + ([TUNED_COLUMN] if any("tuned" in row for row in rows) else [])
    headers = [h for _, h, _ in columns]
    cells = [
        [
            (
                row[k]
                if k == "method"
                else "failed"
                if "error" in row and row.get(k) is None
                else "n/a"
                if row.get(k) is None
                else _setting(row[k])
                if k == "tuned"
                else fmt.format(row[k])
            )
            for k, _, fmt in columns
        ]
        for row in rows
    ]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    out += [f"{row['method']} failed: {row['error']}" for row in rows if "error" in row]
    return "\n".join(out)


def _setting(setting: dict) -> str:
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items()
    )


def write_json(
    rows: list[dict],
    problem: Problem,
    path: Path,
    *,
    pending: list[str] | tuple[str, ...] = (),
    interrupted: bool = False,
    tune: bool = False,
) -> None:
    """Write the config, the machine and ``rows`` to ``path`` as JSON, atomically (a reader, or
    a run killed mid-write, sees the previous file or the new one, never half of one).

    ``pending`` lists the methods still to run (a file written while the run goes on); the
    ``"status"`` key reads ``"running"``, ``"interrupted"`` (with ``interrupted=True``: the run
    was stopped, ``pending`` never ran), ``"complete"``, or ``"failed: <methods>"``.
    """
    config = {
        "dataset": problem.dataset.name,
        "network": problem.network,
        "epochs": problem.epochs,
        "batch_size": problem.batch_size,
        # Under --tune each method trains with the rate its grid chose: each result's "lr".
        "lr": "per method (see each result's lr)" if tune else problem.lr,
        "seed": problem.seed,
        "device": problem.device,
        "num_samples": problem.num_samples,
        "num_kl_samples": problem.num_kl_samples,
        "prior": repr(problem.prior),
        "n_train": problem.num_train,
        "n_test": len(problem.dataset.y_test),
        "num_classes": problem.dataset.num_classes,
        "ood": problem.ood_name or None,
        "n_ood": None if problem.ood_x is None else len(problem.ood_x),
        "ece_bins": 15,
        "ood_score": "predictive entropy",
        "tune": (
            {
                "protocol": "pyro_bdl.app.compare.tuning: validation NLL on "
                f"{tuning.VALIDATION_FRACTION:g} of the training split, the best setting then "
                "trained on the whole training split",
                "grids": tuning.GRIDS,
            }
            if tune
            else None
        ),
    }
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    failed = [row["method"] for row in rows if "error" in row]
    status = (
        "interrupted"
        if interrupted
        else "running"
        if pending
        else f"failed: {', '.join(failed)}"
        if failed
        else "complete"
    )
    payload = {
        "config": config,
        "machine": machine,
        "status": status,
        "pending": list(pending),
        "results": rows,
    }
    # Non-finite figures become null: JSON has no NaN, and strict readers refuse the token.
    write_text_atomic(path, json.dumps(_finite_or_null(payload), indent=2, allow_nan=False))


def _finite_or_null(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: a temporary file in the same folder (so the
    rename stays on one file system), flushed to disk, then ``os.replace``; the temporary file
    is removed if anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
