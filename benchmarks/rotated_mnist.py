"""Rotated MNIST: accuracy, NLL and ECE of every ``compare`` method as the test digits rotate.

Protocol (the split and rotations of :mod:`benchmarks.laplace_quality`, imported from it):

1. Data: the MNIST test set split 8,000 / 2,000 (``pyro_bdl.app.data.load_mnist``; ``--data-dir``
   or ``$PYRO_BDL_DATA``); the 15% validation part of :func:`benchmarks.laplace_quality.holdout`
   is left out, and the methods train on (a subsample of, ``--n-train``) the other 85%,
   unrotated. Methods that tune something carve their own validation rows from these.
2. Every method of ``compare``'s default set plus ``ensemble`` and ``multiswag`` (M = 5), each
   with ``compare``'s settings (:class:`~pyro_bdl.app.compare.Problem`: the MLP with two hidden
   layers of 100, Adam at 1e-3, batches of 64, prior N(0, 1), 32 predictive draws) and the
   same seed; 30 epochs (compare's default; ``--epochs`` changes it). The whole run takes about
   5 minutes of one CPU core (6,800 training rows, 2,000 test digits).
3. Test digits rotated by 0°, 30°, …, 180° (:data:`benchmarks.laplace_quality.ANGLES`);
   accuracy, NLL and ECE (15 bins) per angle.

Writes ``benchmarks/results/rotated_mnist.json`` and ``rotated_mnist.png`` (one panel per
metric, one line per method). ``--smoke`` runs a tiny version on scikit-learn's digits (no data
folder needed) that exercises every line.

Run: ``python -m benchmarks.rotated_mnist [--smoke] [--data-dir DIR] [--epochs E]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.laplace_quality import ANGLES, holdout, rotated
from pyro_bdl.app.compare import COMPARE_METHODS, METHODS, Problem
from pyro_bdl.app.compare.problem import seed_everything
from pyro_bdl.app.data import Dataset, load_digits, load_mnist
from pyro_bdl.diagnostics.metrics import accuracy, ece, nll

#: Every default compare method, then the ensembles (when the default set leaves them out).
ALL_METHODS = tuple(COMPARE_METHODS) + tuple(
    m for m in ("ensemble", "multiswag") if m not in COMPARE_METHODS
)
#: Keyword arguments of the fit functions that take them.
MEMBERS = ("ensemble", "multiswag")
METRICS = ("accuracy", "nll", "ece")


def prepare(data: Dataset, n_train: int | None, test_size: int | None) -> Dataset:
    """The protocol's training part (first ``n_train`` rows of it) and test digits."""
    (x, y), _ = holdout(data)
    return dataclasses.replace(
        data,
        x_train=x[:n_train],
        y_train=y[:n_train],
        x_test=data.x_test[:test_size],
        y_test=data.y_test[:test_size],
    )


def run(
    data: Dataset,
    methods=ALL_METHODS,
    *,
    epochs: int,
    num_samples: int = 32,
    num_members: int = 5,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Train every method on ``data``'s (unrotated) training rows and score each angle."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; expected some of {list(METHODS)}.")
    problem = Problem(data, epochs=epochs, num_samples=num_samples, seed=seed, progress=progress)
    tests = [rotated(data.x_test, angle) for angle in ANGLES]
    out: dict = {}
    for name in methods:
        seed_everything(seed)
        kwargs = {"num_members": num_members} if name in MEMBERS else {}
        start = time.process_time()
        predict = METHODS[name](problem, **kwargs)
        fit = time.process_time() - start
        row: dict = {m: [] for m in METRICS}
        start = time.process_time()
        for x in tests:
            probs = predict(x)
            row["accuracy"].append(accuracy(probs, data.y_test))
            row["nll"].append(nll(probs, data.y_test))
            row["ece"].append(ece(probs, data.y_test))
        row["fit_cpu_s"], row["predict_cpu_s"] = fit, time.process_time() - start
        for m in METRICS:
            row[f"mean_{m}"] = sum(row[m]) / len(row[m])
        out[name] = row
        print(
            f"{name:>15}: acc {row['accuracy'][0]:.3f} → {row['accuracy'][-1]:.3f}, mean NLL "
            f"{row['mean_nll']:.3f}, mean ECE {row['mean_ece']:.3f} (fit {fit:.0f} s CPU)",
            flush=True,
        )
    return out


def plot(results: dict, path: Path, title: str) -> Path:
    """One panel per metric against the angle, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"accuracy": "accuracy", "nll": "test NLL", "ece": "ECE (15 bins)"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, row in results.items():
        bold = name in MEMBERS
        for ax, metric in zip(axes, METRICS):
            ax.plot(ANGLES, row[metric], marker="o", ms=3, lw=2.2 if bold else 1.1, label=name)
    for ax, metric in zip(axes, METRICS):
        ax.set_xlabel("rotation (degrees)")
        ax.set_ylabel(labels[metric])
        ax.set_xticks(ANGLES)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=8, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny run on scikit-learn digits")
    parser.add_argument("--data-dir", default=None, help="MNIST folder (default $PYRO_BDL_DATA)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--n-train", type=int, default=None, help="training rows (default all)")
    parser.add_argument("--methods", default=",".join(ALL_METHODS))
    args = parser.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.smoke:
        data = prepare(load_digits(), args.n_train or 120, 60)
        settings = {"epochs": args.epochs or 1, "num_samples": 4, "num_members": 2}
    else:
        data = prepare(load_mnist(args.data_dir), args.n_train, None)
        settings = {"epochs": args.epochs or 30, "num_samples": 32, "num_members": 5}
    start = time.process_time()
    results = run(data, methods, **settings)
    config = {
        "smoke": args.smoke,
        "dataset": data.name,
        "n_train": len(data.y_train),
        "n_test": len(data.y_test),
        "angles": list(ANGLES),
        "network": "mlp (2 × 100)",
        **settings,
        "total_cpu_s": time.process_time() - start,
    }
    name = "rotated_mnist" + ("_smoke" if args.smoke else "")
    common.write(name, config, results)
    shown = "MNIST" if data.name == "mnist" else data.name
    title = (
        f"Rotated {shown}: {len(data.y_train)} training rows, {settings['epochs']} epochs "
        f"({common.machine()['date']})"
    )
    print(f"wrote {plot(results, common.RESULTS / f'{name}.png', title)}")
    return {"config": config, "results": results}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
