"""The ``pyro-bdl`` command. ``pyro-bdl compare`` is the main job: train the same network as a
point estimate and with every inference method, then print and save a table of test figures
(accuracy, NLL, ECE, Brier, OOD AUROC), each method's ArviZ data (.nc) and diagnostic plots.

Out-of-distribution data: by default the digits of held-out classes (``--ood-classes``, 8 and 9):
those classes are removed from training *and* testing, so the in-distribution task is the
classification of the remaining classes and the OOD inputs are digits the network never saw. With
``--ood PATH`` (a .npy/.npz/.pt of inputs scaled like the training data) all classes are kept and
the file is the OOD set; ``--ood none`` keeps all classes and skips the OOD figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pyro_bdl.compare import (
    COMPARE_METHODS,
    METHODS,
    NETWORKS,
    Problem,
    format_table,
    run,
    write_json,
)
from pyro_bdl.data import DATASETS, hold_out_classes, load_dataset, load_ood

#: Classes held out as OOD data by default (``--ood held-out``).
DEFAULT_OOD_CLASSES = "8,9"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyro-bdl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="train MAP and every method on one dataset; print a table")
    c.add_argument(
        "--dataset",
        default="digits",
        choices=sorted(DATASETS),
        help="digits (bundled with scikit-learn, default) or mnist (needs --data-dir)",
    )
    c.add_argument(
        "--data-dir", default=None, help="folder with data on disk (default: $PYRO_BDL_DATA)"
    )
    c.add_argument(
        "--methods",
        default=",".join(COMPARE_METHODS),
        help=f"comma-separated subset of: {', '.join(METHODS)} (default: all but the "
        "full-network laplace)",
    )
    c.add_argument("--network", default="mlp", choices=sorted(NETWORKS))
    c.add_argument("--epochs", type=_positive_int, default=30)
    c.add_argument("--batch-size", type=_positive_int, default=64)
    c.add_argument("--lr", type=_positive_float, default=1e-3)
    c.add_argument(
        "--num-samples", type=_positive_int, default=32, help="posterior samples for the predictive"
    )
    c.add_argument(
        "--num-kl-samples",
        type=_positive_int,
        default=1000,
        help="Monte Carlo samples of the KL term for the variational methods",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.add_argument(
        "--ood",
        default="held-out",
        help="out-of-distribution data: 'held-out' (default: the classes of --ood-classes are "
        "left out of training and testing and serve as OOD inputs), 'none', or a path to a "
        ".npy/.npz/.pt file of inputs scaled like the training data",
    )
    c.add_argument(
        "--ood-classes",
        default=DEFAULT_OOD_CLASSES,
        help="comma-separated classes held out with --ood held-out (default: %(default)s)",
    )
    c.add_argument(
        "--output",
        default="results",
        help="folder for results.json, the ArviZ data (<method>.nc) and the plots",
    )
    c.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def compare(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window (the command may run headless)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        print(
            f"pyro-bdl: unknown method(s) {unknown}; choose from {', '.join(METHODS)}",
            file=sys.stderr,
        )
        return 2
    dataset = load_dataset(args.dataset, args.data_dir, seed=args.seed)
    dataset, ood_x, ood_name = _ood_data(dataset, args.ood, args.ood_classes)
    problem = Problem(
        dataset,
        network=args.network,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        num_samples=args.num_samples,
        num_kl_samples=args.num_kl_samples,
        progress=not args.no_progress,
        ood_x=ood_x,
        ood_name=ood_name,
    )
    print(
        f"dataset {dataset.name}: {problem.num_train} train / {len(dataset.y_test)} test, "
        f"{dataset.num_classes} classes, network {args.network}, {args.epochs} epochs, "
        f"device {args.device}"
    )
    if ood_x is not None:
        print(f"OOD data: {ood_name} ({len(ood_x)} inputs); score: predictive entropy")
    output = Path(args.output)
    rows = run(problem, methods, output=output)
    print(format_table(rows))
    path = output / "results.json"
    write_json(rows, problem, path)
    print(f"wrote {path}")
    for row in rows:
        files = row.get("files", [])
        nc = [f for f in files if f.endswith(".nc")]
        png = [Path(f).name for f in files if f.endswith(".png")]
        print(f"{row['method']}: ArviZ data {', '.join(nc)}; plots in {output}: {', '.join(png)}")
    return 0


def _ood_data(dataset, ood: str, classes: str):
    """``(in-distribution dataset, OOD inputs or None, description)`` for ``--ood``."""
    if ood == "none":
        return dataset, None, ""
    if ood == "held-out":
        try:
            held = [int(c) for c in classes.split(",") if c.strip()]
        except ValueError:
            raise ValueError(
                f"--ood-classes must be comma-separated integers like 8,9; got {classes!r}."
            ) from None
        inside, x_ood = hold_out_classes(dataset, held)
        return inside, x_ood, f"held-out classes {', '.join(map(str, sorted(set(held))))}"
    return dataset, load_ood(ood, dataset.input_shape), f"file {ood}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return compare(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"pyro-bdl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
