"""VOGN against Adam on the digits CNN under the fair-tuning protocol (``pyro-bdl compare --tune``).

The untuned comparison ran Adam (compare's ``map``: Adam on the MAP objective, prior N(0, 1)) at
lr 1e-3 against VOGN at its chosen settings. Here every method gets the same grid (learning rate
1e-3 / 3e-3 / 1e-2 times prior scale 0.3 / 1, :mod:`pyro_bdl.app.compare.tuning`) scored by the NLL
on 10% of the training split, then trains on the whole training split and is scored once on the
test split; ``map_ts`` (the tuned MAP with a validation temperature) is the stronger baseline.
The untuned rows (compare's defaults) are run beside them for reference.

Usage::

    python -m benchmarks.tuned_vogn_adam                 # seeds 0-2, 20 epochs
    python -m benchmarks.tuned_vogn_adam --seeds 0 --smoke
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import write
from pyro_bdl.app.compare import Problem, run
from pyro_bdl.app.data import hold_out_classes, load_digits

METHODS = ["map", "map_ts", "vogn"]
KEYS = ("accuracy", "nll", "ece", "brier", "ood_auroc", "fit_seconds", "tune_seconds", "tuned")


def one_seed(seed: int, epochs: int, tune: bool) -> list[dict]:
    """compare's digits CNN problem (classes 8, 9 held out as OOD) for ``seed``; one row per
    method with the test figures (and the chosen setting when ``tune``)."""
    dataset, x_ood = hold_out_classes(load_digits(seed=seed), [8, 9])
    problem = Problem(dataset, network="cnn", epochs=epochs, seed=seed, progress=False, ood_x=x_ood)
    rows = run(problem, METHODS, tune=tune)
    return [{k: row[k] for k in ("method", *KEYS) if k in row} for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="1 epoch, no JSON written")
    args = parser.parse_args([] if argv is None else argv)
    torch.set_num_threads(1)
    epochs = 1 if args.smoke else args.epochs
    out: dict = {"tuned": {}, "untuned": {}}
    for seed in args.seeds:
        for mode in ("tuned", "untuned"):
            out[mode][seed] = one_seed(seed, epochs, tune=mode == "tuned")
            for row in out[mode][seed]:
                print(
                    f"seed {seed} {mode:8s} {row['method']:7s} acc {row['accuracy']:.4f} "
                    f"NLL {row['nll']:.4f} ECE {row['ece']:.4f}  {row.get('tuned', '')}",
                    flush=True,
                )
        if not args.smoke:
            config = {
                "network": "cnn",
                "dataset": "digits, classes 8-9 held out",
                "epochs": epochs,
                "seeds_done": args.seeds[: args.seeds.index(seed) + 1],
                "protocol": "pyro_bdl.app.compare.tuning (pyro-bdl compare --tune)",
            }
            write("vogn_vs_adam_tuned", config, out)


if __name__ == "__main__":
    main(sys.argv[1:])
