"""The ``pyro-bdl`` command. ``pyro-bdl compare`` is the main job: train the same network as a
point estimate and with every inference method, then print and save a table of test figures
(accuracy, NLL, ECE, Brier, OOD AUROC), each method's ArviZ data (.nc) and diagnostic plots.

Out-of-distribution data: by default the digits of held-out classes (``--ood-classes``, 8 and 9):
those classes are removed from training *and* testing, so the in-distribution task is the
classification of the remaining classes and the OOD inputs are digits the network never saw. With
``--ood PATH`` (a .npy/.npz/.pt of inputs scaled like the training data) all classes are kept and
the file is the OOD set; ``--ood none`` keeps all classes and skips the OOD figures.

Errors: every option is checked, and the output folder is checked to be creatable and writable,
before any data is loaded or any file written; a bad option prints one line naming it and exits
with status 2. Each method's figures are saved (``results.json``, ``results.txt``) as soon as it
finishes; a method that fails is reported in the table and the JSON with its error while the
others go on, and the command then exits with status 1."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

# Only the light modules load before the arguments are parsed (no torch, no Pyro), so that
# `pyro-bdl --help` and a refused option answer at once; the rest loads in `compare`.
from pyro_bdl.app.compare.networks import NETWORKS
from pyro_bdl.app.compare.registry import COMPARE_METHODS, METHODS
from pyro_bdl.app.data import DATA_ENV, DATASETS, hold_out_classes, load_dataset, load_ood

if TYPE_CHECKING:
    from pyro_bdl.app.compare.problem import Problem

#: Classes held out as OOD data by default (``--ood held-out``).
DEFAULT_OOD_CLASSES = "8,9"

#: Seeds numpy accepts (``pyro.set_rng_seed`` seeds numpy too).
_MAX_SEED = 2**32 - 1


class UsageError(Exception):
    """A bad command line: printed as one ``pyro-bdl: error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage and call sys.exit
        raise UsageError(f"{message} (see {self.prog} --help)")


def _int_option(minimum: int, example: int, maximum: int | None = None):
    """An argparse ``type``: a whole number in [minimum, maximum]."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(
                f"expected a whole number {bounds}, got {text!r}; pass e.g. {example}"
            )
        return value

    return parse


def _positive_float(example: float):
    """An argparse ``type``: a finite number > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(
                f"expected a finite number > 0, got {text!r}; pass e.g. {example:g}"
            )
        return value

    return parse


def _device(text: str) -> str:
    """An argparse ``type``: ``auto`` or a device this machine has."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(
            f"expected auto, cpu, cuda, cuda:N or mps, got {text!r}; pass --device cpu"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"got {text!r}, but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); pass --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"got {text!r}, but this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}; pass --device cuda:0"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(
            f"got {text!r}, but MPS is not available on this machine; pass --device cpu"
        )
    return text


def _methods(text: str) -> list[str]:
    """An argparse ``type``: a comma-separated list of distinct registry names."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    choices = ", ".join(METHODS)
    if unknown or not methods:
        got = f"unknown method(s) {', '.join(map(repr, unknown))}" if unknown else "none"
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of: {choices}; got {got}"
        )
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise argparse.ArgumentTypeError(
            f"expected each method once (each writes <method>.nc), got {', '.join(twice)} more "
            "than once; name each method once"
        )
    return methods


def _folder(text: str) -> str:
    """An argparse ``type``: an existing folder."""
    path = Path(text).expanduser()
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(
            f"expected an existing folder, got {text!r}, which {what}; pass the folder that "
            "holds the data, or leave the option out (digits needs no files)"
        )
    return str(path)


def _ood(text: str) -> str:
    """An argparse ``type``: ``held-out``, ``none`` or an existing file."""
    if text in ("held-out", "none") or Path(text).expanduser().is_file():
        return text
    what = (
        "is empty"
        if not text.strip()
        else "is a folder"
        if Path(text).expanduser().is_dir()
        else "does not exist"
    )
    raise argparse.ArgumentTypeError(
        f"expected 'held-out', 'none' or a .npy/.npz/.pt file, got {text!r}, which {what}; "
        "pass an existing file or --ood held-out"
    )


def check_output(text: str) -> Path:
    """The ``--output`` folder, refused (:class:`UsageError`) unless it is a folder this process
    can write into, or can be created as one. Whether it can is tried (a folder created and a
    file written, then removed), since permission bits alone miss read-only and virtual file
    systems (``/proc``) and say nothing for root; nothing is left behind."""
    path = Path(text).expanduser()
    fix = "pass another folder, e.g. --output results"
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"argument --output: expected a folder, got {text!r}, which is an existing file; {fix}"
        )
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(
            f"argument --output: expected a folder that can be created, got {text!r}, but "
            f"{str(parent)!r} is a file; {fix}"
        )
    where = "it" if parent == path else f"its nearest existing parent {str(parent)!r}"
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(
            f"argument --output: expected a writable folder, got {text!r}, but {where} is not "
            f"writable (permissions or a read-only file system); {fix}"
        )
    try:
        _try_writing(path, parent)
    except OSError as err:
        raise UsageError(
            f"argument --output: expected a writable folder, got {text!r}, but {where} is not "
            f"writable ({err.strerror or err}); {fix}"
        ) from None
    return path


def _try_writing(path: Path, existing: Path) -> None:
    """Create ``path`` (below its existing ancestor ``existing``) and a file in it, then remove
    both: raises ``OSError`` where either cannot be done."""
    created = [p for p in [path, *path.parents] if p != existing and existing in p.parents]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    finally:
        for folder in created:  # deepest first
            if folder.is_dir():
                folder.rmdir()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default after its help."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pyro-bdl", description=__doc__, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compare",
        help="train MAP and every method on one dataset; print a table",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    c.add_argument(
        "--dataset",
        default="digits",
        choices=sorted(DATASETS),
        help="digits (bundled with scikit-learn) or mnist (the MNIST test set, read from "
        f"--data-dir or ${DATA_ENV})",
    )
    c.add_argument(
        "--data-dir",
        type=_folder,
        default=None,
        help=f"folder with data on disk; unset: ${DATA_ENV}",
    )
    c.add_argument(
        "--methods",
        type=_methods,
        default=",".join(COMPARE_METHODS),
        help=f"comma-separated subset of: {', '.join(METHODS)} (the default leaves out ivon, "
        "mc_dropout, the full-network laplace and the five-member ensemble and multiswag)",
    )
    c.add_argument(
        "--network", default="mlp", choices=sorted(NETWORKS), help="the network every method fits"
    )
    c.add_argument(
        "--epochs", type=_int_option(1, 30), default=30, help="passes over the training split"
    )
    c.add_argument(
        "--batch-size", type=_int_option(1, 64), default=64, help="training rows per step"
    )
    c.add_argument(
        "--lr",
        type=_positive_float(1e-3),
        default=1e-3,
        help="Adam's learning rate, shared by the methods that train with Adam or VOGN (IVON "
        "and SWAG's constant phase keep their own; --tune chooses each from a grid)",
    )
    c.add_argument(
        "--num-samples",
        type=_int_option(1, 32),
        default=32,
        help="posterior samples for the predictive",
    )
    c.add_argument(
        "--num-kl-samples",
        type=_int_option(1, 1000),
        default=1000,
        help="Monte Carlo samples of the KL term for the variational methods",
    )
    c.add_argument(
        "--seed",
        type=_int_option(0, 0, _MAX_SEED),
        default=0,
        help="seed of the data split, the initial weights and every sample",
    )
    c.add_argument(
        "--device",
        type=_device,
        default="auto",
        help="cpu, cuda, cuda:N or mps; auto: cuda when available, else cpu",
    )
    c.add_argument(
        "--threads",
        # At most the machine's CPUs: torch takes any count up to 2**31 and then stalls
        # starting that many threads; a larger one overflowed torch.set_num_threads.
        type=_int_option(1, 1, os.cpu_count() or 1),
        default=1,
        help="CPU threads for torch (torch.set_num_threads), at most this machine's CPUs. One "
        "is the default: the networks are small, and with torch's own default, runs sharing a "
        "machine were 4-11x slower",
    )
    c.add_argument(
        "--ood",
        type=_ood,
        default="held-out",
        help="out-of-distribution data: 'held-out' (the classes of --ood-classes are left out "
        "of training and testing and serve as OOD inputs), 'none', or a path to a "
        ".npy/.npz/.pt file of inputs scaled like the training data",
    )
    c.add_argument(
        "--ood-classes",
        default=DEFAULT_OOD_CLASSES,
        help="comma-separated classes held out with --ood held-out",
    )
    c.add_argument(
        "--output",
        default="results",
        help="folder for results.json, results.txt, the ArviZ data (<method>.nc) and the plots; "
        "checked to be writable before any data loads",
    )
    c.add_argument(
        "--tune",
        action="store_true",
        help="fair tuning first: each method tries the same number of settings (its learning "
        "rate x its key hyperparameter, pyro_bdl.app.compare.tuning.GRIDS) scored on 10%% of "
        "the training split; about 7x slower",
    )
    c.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def _problem(args: argparse.Namespace) -> Problem:
    """Load the data and build the problem; bad data or options raise :class:`UsageError`."""
    try:
        dataset = load_dataset(args.dataset, args.data_dir, seed=args.seed)
    except (ValueError, OSError) as err:
        raise UsageError(f"argument --dataset {args.dataset}: {err}") from None
    try:
        dataset, ood_x, ood_name = _ood_data(dataset, args.ood, args.ood_classes)
    except (ValueError, OSError) as err:
        if args.ood == "held-out":
            fix = "pass classes of the dataset, e.g. --ood-classes 8,9, or --ood none"
            raise UsageError(f"argument --ood-classes: {err} To fix: {fix}.") from None
        fix = "pass a file of inputs shaped like the training data, or --ood held-out"
        raise UsageError(f"argument --ood: {err} To fix: {fix}.") from None
    try:
        return _build_problem(args, dataset, ood_x, ood_name)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


def _build_problem(args: argparse.Namespace, dataset, ood_x, ood_name: str) -> Problem:
    from pyro_bdl.app.compare.problem import Problem

    return Problem(
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


def compare(args: argparse.Namespace) -> int:
    """Run ``pyro-bdl compare``: 0 when every method finished, 1 when any failed (its row says
    why; the others are saved), 130 when interrupted (Ctrl-C; the finished ones are saved),
    :class:`UsageError` before anything is written."""
    output = check_output(args.output)
    import matplotlib
    import torch

    from pyro_bdl.app.compare.evaluate import format_table, run, write_json, write_text_atomic

    matplotlib.use("Agg")  # files only, never a window (the command may run headless)
    torch.set_num_threads(args.threads)
    methods = args.methods
    problem = _problem(args)
    dataset = problem.dataset
    print(
        f"dataset {dataset.name}: {problem.num_train} train / {len(dataset.y_test)} test, "
        f"{dataset.num_classes} classes, network {args.network}, {args.epochs} epochs, "
        f"device {args.device}, {args.threads} thread(s)"
        + (", fair tuning on a validation split (--tune)" if args.tune else "")
    )
    if problem.ood_x is not None:
        print(
            f"OOD data: {problem.ood_name} ({len(problem.ood_x)} inputs); score: predictive entropy"
        )
    path = output / "results.json"
    table = output / "results.txt"

    done: list[dict] = []

    def save(rows: list[dict], interrupted: bool = False) -> None:
        done[:] = rows
        pending = methods[len(rows) :]
        write_json(rows, problem, path, pending=pending, interrupted=interrupted, tune=args.tune)
        verb = "never ran (interrupted)" if interrupted else "still to run"
        note = f"\n({verb}: {', '.join(pending)})" if pending else ""
        write_text_atomic(table, format_table(rows) + note + "\n")

    try:
        save([])  # creates the folder and records the settings before any training
    except OSError as err:
        raise UsageError(f"argument --output: cannot write {str(path)!r}: {err}") from None
    try:
        rows = run(problem, methods, output=output, keep_going=True, on_row=save, tune=args.tune)
    except KeyboardInterrupt:
        save(done, interrupted=True)
        print(
            f"pyro-bdl: interrupted; the {len(done)} finished method(s) are saved in {path}.",
            file=sys.stderr,
        )
        return 130  # the shell's status for a run stopped by SIGINT
    print(format_table(rows))
    print(f"wrote {path} and {table}")
    for row in rows:
        files = row.get("files", [])
        nc = [f for f in files if f.endswith(".nc")]
        png = [Path(f).name for f in files if f.endswith(".png")]
        if files:
            print(
                f"{row['method']}: ArviZ data {', '.join(nc)}; plots in {output}: {', '.join(png)}"
            )
    failed = [row for row in rows if "error" in row]
    if failed:
        print(
            f"pyro-bdl: error: {len(failed)} of {len(rows)} method(s) failed ("
            + "; ".join(f"{row['method']}: {row['error']}" for row in failed)
            + f"). Every finished result is in {path}, each failure with its traceback.",
            file=sys.stderr,
        )
        return 1
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
                f"expected comma-separated integers like 8,9; got {classes!r}."
            ) from None
        inside, x_ood = hold_out_classes(dataset, held)
        return inside, x_ood, f"held-out classes {', '.join(map(str, sorted(set(held))))}"
    return dataset, load_ood(ood, dataset.input_shape), f"file {ood}"


def main(argv: list[str] | None = None) -> int:
    """The ``pyro-bdl`` command; returns the exit status (2: bad command line, nothing written;
    1: some method failed, the others' results saved; 0: done)."""
    try:
        args = build_parser().parse_args(argv)
        return compare(args)
    except UsageError as err:
        print(f"pyro-bdl: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
