"""Runs the chosen methods on one :class:`Problem` and gathers one row of figures per method."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from pyro_bdl.compare.problem import Problem, seed_everything
from pyro_bdl.compare.registry import METHODS
from pyro_bdl.diagnostics import metrics

__all__ = ["COLUMNS", "format_table", "run", "write_json"]

#: (key, header, format) of the printed table, in order.
COLUMNS = [
    ("method", "method", "{}"),
    ("accuracy", "accuracy", "{:.4f}"),
    ("nll", "test NLL", "{:.4f}"),
    ("fit_seconds", "fit time (s)", "{:.1f}"),
]


def evaluate(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The figures of one method on the test set."""
    return {"accuracy": metrics.accuracy(probs, y), "nll": metrics.nll(probs, y)}


def run(problem: Problem, methods: list[str]) -> list[dict]:
    """Train every method in ``methods`` on ``problem``; one row of figures per method."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(map(repr, unknown))}; expected some of "
            f"{', '.join(map(repr, METHODS))}."
        )
    rows = []
    x_test = problem.dataset.x_test.to(problem.device)
    y_test = problem.dataset.y_test.to(problem.device)
    for name in methods:
        seed_everything(problem.seed)
        start = time.perf_counter()
        predict = METHODS[name](problem)
        fit_seconds = time.perf_counter() - start
        probs = predict(x_test)
        rows.append({"method": name, **evaluate(probs, y_test), "fit_seconds": fit_seconds})
    return rows


def format_table(rows: list[dict]) -> str:
    headers = [h for _, h, _ in COLUMNS]
    cells = [[fmt.format(row[k]) for k, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(out)


def write_json(rows: list[dict], problem: Problem, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "dataset": problem.dataset.name,
        "network": problem.network,
        "epochs": problem.epochs,
        "batch_size": problem.batch_size,
        "lr": problem.lr,
        "seed": problem.seed,
        "device": problem.device,
        "num_samples": problem.num_samples,
        "num_kl_samples": problem.num_kl_samples,
        "prior": repr(problem.prior),
        "n_train": problem.num_train,
        "n_test": len(problem.dataset.y_test),
    }
    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
    }
    payload = {"config": config, "machine": machine, "results": rows}
    path.write_text(json.dumps(payload, indent=2))
