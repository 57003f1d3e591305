"""The ``pyro-bdl`` command. ``pyro-bdl compare`` is the main job: train the same network as a
point estimate and with every inference method, then print and save a table of test figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pyro_bdl.compare import METHODS, NETWORKS, Problem, format_table, run, write_json
from pyro_bdl.data import DATASETS, load_dataset


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
        default=",".join(METHODS),
        help=f"comma-separated subset of: {', '.join(METHODS)} (default: all)",
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
    c.add_argument("--output", default="results", help="folder for results.json and plots")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def compare(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        print(
            f"pyro-bdl: unknown method(s) {unknown}; choose from {', '.join(METHODS)}",
            file=sys.stderr,
        )
        return 2
    dataset = load_dataset(args.dataset, args.data_dir, seed=args.seed)
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
    )
    print(
        f"dataset {dataset.name}: {problem.num_train} train / {len(dataset.y_test)} test, "
        f"network {args.network}, {args.epochs} epochs, device {args.device}"
    )
    rows = run(problem, methods)
    print(format_table(rows))
    path = Path(args.output) / "results.json"
    write_json(rows, problem, path)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return compare(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"pyro-bdl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
