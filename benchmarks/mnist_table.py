"""The MNIST table: accuracy, NLL, ECE, OOD AUROC and seconds per epoch of ten methods, 3 seeds.

The shape of Table 1 of Osawa et al. (2019) (VOGN) at the size of the data this project ships:

1. **Data.** The MNIST *test* set (10,000 digits; ``--data-dir`` or ``$PYRO_BDL_DATA``), split
   per seed into 6,000 training / 1,000 validation / 3,000 test digits (a seeded permutation:
   60% / 10% / 30%). The seed also sets the initial weights and the minibatch order.
2. **Shift.** The out-of-distribution set is the seed's 3,000 test digits rotated by 90°
   (``torch.rot90``: an exact permutation of the pixels, no interpolation). It is a fair shift
   because nothing but the shape changes: every OOD image has exactly the pixel values, ink
   amount, stroke width and brightness histogram of an in-distribution test digit, so a method
   can only tell the sets apart by recognising that the shape is not an upright digit. OOD AUROC
   separates the test digits (negatives) from their rotations (positives) by predictive entropy
   (:func:`pyro_bdl.diagnostics.ood_auroc`); near-symmetric digits (0, 1 read as a dash, 8) keep
   it below 1 for every method alike.
3. **Network.** The MLP 784-400-400-10 of the VOGN paper's MNIST experiments on a GPU, and
   784-100-100-10 on CPU (``--hidden`` sets it; see the end of this docstring for why),
   lifted by ``bayesianize`` with the prior N(0, 1) (``Problem``'s default); Adam-trained methods
   use batches of 128 and ``--epochs`` epochs (default 10), every method the same number.
4. **Methods** (the registry's fit functions, :mod:`pyro_bdl.app.compare`): ``map``, ``map_ts``
   (the MAP with one temperature fitted by validation NLL), ``mc_dropout``, ``meanfield``,
   ``vogn``, ``ivon``, ``swag``, ``multiswag`` and ``ensemble`` (M = 5 members each), and
   ``laplace`` (the last-layer GGN Laplace at the MAP, dense over the last layer's 4,010
   weights at 400 hidden units, with the probit predictive; the full-network Laplace's D × D
   posterior over 478,000 weights would take 1.8 TB in float64).
5. **Tuning.** Every method gets the same budget: :data:`CANDIDATES` (3) trainings, one per
   setting of its key hyperparameter (the learning rate; IVON's own rate; SWAG's constant rate;
   MC dropout's rate, at Adam's 1e-3), all trained on the training split and scored by
   **validation NLL**; the best is kept. ``map_ts`` and ``laplace`` reuse the MAP's
   three trainings (same seed, same networks) and tune their post-hoc setting (temperature; prior
   precision λ on :data:`LAPLACE_GRID`) on the same validation rows. The test split and the OOD
   set never reach a choice: :func:`choose` trains and scores on training and validation rows
   only, and gets the test figures of each new best from a callback whose result it only
   stores (``tests/test_mnist_table_benchmark.py`` fills the test rows with NaN and checks that
   every choice stays the same).
6. **Figures.** Per (method, seed): test accuracy, NLL, ECE (15 bins), OOD AUROC, seconds per
   epoch of the chosen setting's training (wall clock, CUDA-synchronised; an ensemble's epoch
   trains all M members) and the whole cell's seconds. Then mean ± standard error over seeds, and
   ``wins``: per metric the best method and whether the runner-up is within one SE of it.

The JSON (``--out``, default ``benchmarks/results/mnist_table.json``) is rewritten atomically
after every finished (method, seed), so a run cut short keeps what finished.

Run::

    PYRO_BDL_DATA=../shared/data python -m benchmarks.mnist_table --device cuda --jobs 8
    PYRO_BDL_DATA=../shared/data python -m benchmarks.mnist_table --jobs 2  # CPU, hidden 100
    python -m benchmarks.mnist_table --quick      # seconds, scikit-learn digits, no data folder

On CPU the 784-400-400-10 network's last-layer Laplace (a dense 4,010² covariance in float64,
one linearized prediction per λ) takes about 4.5 minutes per seed of one core, against 16 s for
the MAP's three trainings, hence 100 hidden units there by default: the whole table took 5.3 min
with ``--jobs 2`` on a shared 2-core machine (2026-11-27).

References:
    Osawa, Swaroop, Jain, Eschenhagen, Turner, Yokota & Khan, "Practical Deep Learning with
    Bayesian Principles", NeurIPS 2019 (Table 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from pyro.infer import Predictive

from benchmarks import common
from pyro_bdl.app.compare import METHODS as REGISTRY
from pyro_bdl.app.compare import Problem
from pyro_bdl.app.compare.networks import mlp
from pyro_bdl.app.compare.problem import seed_everything
from pyro_bdl.app.compare.temperature import validation_temperature
from pyro_bdl.app.compare.tuning import apply, validation_nll
from pyro_bdl.app.data import Dataset, load_digits, load_mnist
from pyro_bdl.diagnostics.metrics import accuracy, ece, nll
from pyro_bdl.diagnostics.ood import ood_auroc
from pyro_bdl.guides.laplace.model import NotAtModeWarning

#: The table's rows, in the VOGN paper's order (point estimates, then the Bayesian methods).
METHODS = (
    "map",
    "map_ts",
    "mc_dropout",
    "meanfield",
    "vogn",
    "ivon",
    "swag",
    "multiswag",
    "ensemble",
    "laplace",
)
#: The methods computed from the MAP's trainings (one job trains the MAP for all three).
MAP_FAMILY = ("map", "map_ts", "laplace")
#: Figures per (method, seed), and whether larger is better.
METRICS = {"accuracy": True, "nll": False, "ece": False, "ood_auroc": True, "epoch_s": False}
#: The number of settings (trainings) each method may try: its tuning budget.
CANDIDATES = 3
_ADAM_LR = ({"lr": 1e-3}, {"lr": 3e-3}, {"lr": 1e-2})
#: Method -> its candidate settings (``lr`` and ``prior_scale`` set the Problem, anything else is
#: a keyword of the registry's fit function; :func:`pyro_bdl.app.compare.tuning.apply`).
GRIDS: dict[str, tuple[dict[str, Any], ...]] = {
    "map": _ADAM_LR,
    "meanfield": _ADAM_LR,
    "ensemble": _ADAM_LR,
    # VOGN's natural-gradient step: on this MLP 3e-3 and 1e-2 already overshoot (validation NLL
    # 1.6 and 2.3 against 0.38 at 1e-3, seed 0), so its three rates centre on 1e-3.
    "vogn": ({"lr": 3e-4}, {"lr": 1e-3}, {"lr": 3e-3}),
    # IVON's own rate (not Adam's); 1.0 was the best of 0.1, 0.3, 1.0 on seed 0, so the grid
    # centres on it.
    "ivon": ({"ivon_lr": 0.3}, {"ivon_lr": 1.0}, {"ivon_lr": 3.0}),
    "swag": ({"swa_lr": 0.03}, {"swa_lr": 0.1}, {"swa_lr": 0.3}),
    "multiswag": ({"swa_lr": 0.03}, {"swa_lr": 0.1}, {"swa_lr": 0.3}),
    # Adam at 1e-3 for each rate; the rate decides an MC-dropout fit more than the step size.
    "mc_dropout": ({"rate": 0.05}, {"rate": 0.1}, {"rate": 0.2}),
}
#: Laplace's prior precisions λ, tried on the validation rows after each MAP training (five
#: values, no refinement: each costs one linearized prediction of the validation rows, which on
#: CPU is most of the method's post-hoc time).
LAPLACE_GRID = torch.logspace(-1, 3, 5, dtype=torch.float64)
#: Members of ``ensemble`` and ``multiswag`` (the deep-ensembles paper's M).
MEMBERS = 5
OOD_ROTATION = 90


@dataclass
class Splits:
    """One seed's training, validation and test digits, and the OOD set (test digits rotated)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def x_ood(self) -> torch.Tensor:
        return torch.rot90(self.x_test, OOD_ROTATION // 90, dims=(-2, -1))

    def to(self, device: str) -> Splits:
        return Splits(*(t.to(device) for t in dataclasses.astuple(self)))


def split(x: torch.Tensor, y: torch.Tensor, seed: int, fractions=(0.6, 0.1)) -> Splits:
    """The seed's permutation of the rows cut into training / validation / test (the rest)."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train, n_val = (round(f * len(y)) for f in fractions)
    parts = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    return Splits(*(t for idx in parts for t in (x[idx], y[idx])))


def load(data_dir: str | None, quick: bool) -> tuple[str, torch.Tensor, torch.Tensor]:
    """All rows of the dataset as ``(name, x, y)``: the 10,000 MNIST digits, or (``quick``)
    scikit-learn's 1,797 digits."""
    data = load_digits() if quick else load_mnist(data_dir, test_size=0)
    return data.name, torch.cat([data.x_train, data.x_test]), torch.cat([data.y_train, data.y_test])


@dataclass(frozen=True)
class Settings:
    """What every method shares (and the size of the run)."""

    epochs: int = 10
    hidden: int = 400
    batch_size: int = 128
    num_samples: int = 32
    members: int = MEMBERS
    device: str = "cpu"


def problem_for(splits: Splits, settings: Settings, seed: int) -> Problem:
    """The registry's Problem on the training rows; its test slot holds the *validation* rows
    (nothing a method is given can reach the test split)."""
    data = Dataset("mnist", splits.x_train, splits.y_train, splits.x_val, splits.y_val, 10)
    return Problem(
        data,
        network=partial(mlp, hidden=settings.hidden),
        epochs=settings.epochs,
        batch_size=settings.batch_size,
        seed=seed,
        device=settings.device,
        num_samples=settings.num_samples,
        progress=False,
    )


def _timed(device: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    common.synchronize(device)
    start = time.perf_counter()
    out = fn()
    common.synchronize(device)
    return out, time.perf_counter() - start


def _fit(name: str, problem: Problem, setting: dict, settings: Settings):
    chosen, keywords = apply(problem, setting)
    if name in ("ensemble", "multiswag"):
        keywords["num_members"] = settings.members
    seed_everything(chosen.seed)
    return REGISTRY[name](chosen, **keywords)


#: Maps a predictor to its test figures (:func:`scores` on the seed's splits).
Evaluate = Callable[[Callable], dict]


def _logits(predict, x: torch.Tensor) -> torch.Tensor:
    """The MAP network's logits (one draw of its point mass)."""
    with torch.no_grad():
        draws = Predictive(
            predict.model, guide=predict.guide, num_samples=1, return_sites=["_RETURN"]
        )
        return draws(x)["_RETURN"][0]


def _map_family(
    problem: Problem, settings: Settings, wanted: Iterable[str], evaluate: Evaluate
) -> dict[str, dict]:
    """The MAP's candidates, and from each the temperature-scaled MAP and the last-layer
    Laplace, every post-hoc choice made on the validation rows (``problem``'s test slot)."""
    x_val, y_val = problem.dataset.x_test, problem.dataset.y_test
    wanted = list(wanted)
    out: dict[str, dict] = {m: {"grid": [], "val_nll": math.inf} for m in wanted}
    for setting in GRIDS["map"]:
        predict, train_s = _timed(settings.device, partial(_fit, "map", problem, setting, settings))
        options: dict[str, tuple[Callable, float, dict]] = {"map": (predict, 0.0, {})}
        if "map_ts" in wanted:
            (tempered, temperature), post_s = _timed(
                settings.device, partial(_tempered, predict, x_val, y_val)
            )
            options["map_ts"] = (tempered, post_s, {"temperature": temperature})
        if "laplace" in wanted:
            values = {k: v.detach() for k, v in predict.guide.median().items()}
            at_map = dataclasses.replace(apply(problem, setting)[0], init=values)
            (laplace, extra), post_s = _timed(
                settings.device, partial(_laplace, at_map, x_val, y_val)
            )
            options["laplace"] = (laplace, post_s, extra)
        for name in wanted:
            fn, post_s, extra = options[name]
            _keep(out[name], {**setting, **extra}, fn, x_val, y_val, train_s, post_s, evaluate)
    return out


def _keep(record, setting, predict, x_val, y_val, train_s, post_s, evaluate) -> None:
    """Score a candidate on the validation rows; when it is the best so far, record it and its
    test figures (computed now: a later candidate's training may reuse the parameter store
    names its predictor reads, and the figures take no part in the choice)."""
    # The metrics run on the host, whatever the device of the predictions.
    score = validation_nll(lambda x: predict(x).detach().cpu(), x_val, y_val.cpu())
    score = score if math.isfinite(score) else math.inf
    record["grid"].append({"setting": setting, "val_nll": score})
    if "setting" not in record or score < record["val_nll"]:
        record.update(
            setting=setting,
            val_nll=score,
            train_s=train_s,
            post_s=post_s,
            figures=evaluate(predict),
        )


def _tempered(predict, x_val, y_val) -> tuple[Callable, float]:
    temperature = validation_temperature(_logits(predict, x_val).cpu(), y_val.cpu())
    return (lambda x: (_logits(predict, x) / temperature).softmax(-1)), temperature


def _laplace(problem: Problem, x_val, y_val) -> tuple[Callable, dict]:
    """The last-layer Laplace at ``problem.init`` (the MAP) with λ chosen on the validation rows;
    returns it and ``{"prior_precision", "not_at_mode", "at_grid_edge"}``. A minibatch MAP
    after a few epochs is near, not at, the mode, and λ may sit at an edge of
    :data:`LAPLACE_GRID`; the guide warns of both, and the row records them instead."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predict: Any = REGISTRY["laplace"](problem, subnetwork="last_layer")
        precision = predict.guide.tune_prior_precision(
            (x_val, y_val), method="val_ll", grid=LAPLACE_GRID, refine=False
        )
    messages = [str(w.message) for w in caught]
    return predict, {
        "prior_precision": float(precision),
        "not_at_mode": any(issubclass(w.category, NotAtModeWarning) for w in caught),
        "at_grid_edge": any("edge of the grid" in m for m in messages),
    }


def choose(
    group: tuple[str, ...], problem: Problem, settings: Settings, evaluate: Evaluate
) -> dict[str, dict]:
    """Train every candidate of the method (or of the MAP family's ``group``) on ``problem``'s
    training rows and keep the one with the lowest validation NLL; ``problem``'s test slot holds
    the validation rows. ``evaluate`` maps a predictor to its test figures: it is called on
    each new best, and its result never enters a choice. Returns ``{method: {"setting",
    "val_nll", "grid", "train_s", "post_s", "figures"}}``."""
    if group[0] in MAP_FAMILY:
        return _map_family(problem, settings, group, evaluate)
    (name,) = group
    x_val, y_val = problem.dataset.x_test, problem.dataset.y_test
    record: dict[str, Any] = {"grid": [], "val_nll": math.inf}
    for setting in GRIDS[name]:
        try:
            predict, train_s = _timed(
                settings.device, partial(_fit, name, problem, setting, settings)
            )
        except (FloatingPointError, ValueError, RuntimeError) as err:  # diverged: it loses
            error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            record["grid"].append({"setting": setting, "val_nll": math.inf, "error": error})
            continue
        _keep(record, setting, predict, x_val, y_val, train_s, 0.0, evaluate)
        del predict  # an ensemble's members: free them before the next candidate
    if "setting" not in record:
        raise RuntimeError(f"{name}: every candidate setting diverged: {record['grid']}")
    return {name: record}


def scores(predict: Callable, splits: Splits) -> dict[str, float]:
    """Test accuracy, NLL, ECE and OOD AUROC (predictive entropy); NaN where the test inputs or
    the predictions are not finite (a test fills the test rows with NaN; the models refuse
    non-finite inputs)."""
    if not torch.isfinite(splits.x_test).all():
        return dict.fromkeys(("accuracy", "nll", "ece", "ood_auroc"), math.nan)
    # No torch.no_grad() here: the linearized Laplace differentiates the network to predict.
    probs, probs_ood = predict(splits.x_test).detach(), predict(splits.x_ood).detach()
    probs, probs_ood = probs.float(), probs_ood.float()
    if not (torch.isfinite(probs).all() and torch.isfinite(probs_ood).all()):
        return dict.fromkeys(("accuracy", "nll", "ece", "ood_auroc"), math.nan)
    probs, probs_ood, y = probs.cpu(), probs_ood.cpu(), splits.y_test.cpu()
    return {
        "accuracy": accuracy(probs, y),
        "nll": nll(probs, y),
        "ece": ece(probs, y),
        "ood_auroc": ood_auroc(probs, probs_ood),
    }


def run_job(
    group: tuple[str, ...], seed: int, splits: Splits, settings: Settings
) -> dict[str, dict]:
    """One job: the methods of ``group`` (one method, or part of the MAP family) at ``seed``."""
    torch.set_num_threads(1)
    splits = splits.to(settings.device)
    problem = problem_for(splits, settings, seed)
    (chosen, cell_s) = _timed(
        settings.device,
        lambda: choose(group, problem, settings, lambda p: scores(p, splits)),
    )
    return {
        name: {
            **record["figures"],
            "epoch_s": record["train_s"] / settings.epochs,
            "post_hoc_s": record["post_s"],
            "setting": record["setting"],
            "val_nll": record["val_nll"],
            "grid": record["grid"],
            "cell_s": cell_s,
        }
        for name, record in chosen.items()
    }


def jobs_for(methods: Iterable[str], seeds: Iterable[int]) -> list[tuple[tuple[str, ...], int]]:
    """(group, seed) pairs: the MAP family's requested members share one job per seed."""
    methods = list(methods)
    family = tuple(m for m in MAP_FAMILY if m in methods)
    groups = ([family] if family else []) + [(m,) for m in methods if m not in MAP_FAMILY]
    return [(group, seed) for seed in seeds for group in groups]


def summary(results: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Mean and standard error over seeds of each metric, per method."""
    out: dict[str, dict] = {}
    for name, per_seed in results.items():
        out[name] = {"seeds": len(per_seed)}
        for metric in METRICS:
            values = [row[metric] for row in per_seed.values() if math.isfinite(row[metric])]
            mean, se = common.mean_se(values) if values else (math.nan, math.nan)
            out[name][metric] = {"mean": mean, "se": se}
    return out


def wins(table: dict[str, dict]) -> dict[str, dict]:
    """Per metric: the best method by its mean, the runner-up, and whether the runner-up's mean
    is within one standard error (the larger of the two SEs) of the best."""
    out = {}
    for metric, larger in METRICS.items():
        ranked = sorted(
            (name for name in table if math.isfinite(table[name][metric]["mean"])),
            key=lambda n: table[n][metric]["mean"],
            reverse=larger,
        )
        if not ranked:
            continue
        best = table[ranked[0]][metric]
        entry: dict[str, Any] = {"best": ranked[0], "mean": best["mean"], "se": best["se"]}
        if len(ranked) > 1:
            second = table[ranked[1]][metric]
            se = max(best["se"], second["se"])
            entry["runner_up"] = ranked[1]
            entry["runner_up_mean"] = second["mean"]
            entry["within_1se"] = (
                bool(abs(best["mean"] - second["mean"]) <= se) if math.isfinite(se) else None
            )
        out[metric] = entry
    return out


def statement(table: dict[str, dict], won: dict[str, dict]) -> str:
    """One plain sentence per metric: who wins, and whether it is a clear win."""
    lines = []
    for metric, entry in won.items():
        line = f"{metric}: {entry['best']} ({entry['mean']:.4g} ± {entry['se']:.2g})"
        if "runner_up" in entry:
            tie = entry["within_1se"]
            verdict = (
                "within 1 SE of"
                if tie
                else "ahead of"
                if tie is False
                else "(one seed, no SE) then"
            )
            line += f", {verdict} {entry['runner_up']} ({entry['runner_up_mean']:.4g})"
        lines.append(line)
    return "; ".join(lines)


def run(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    methods=METHODS,
    seeds=(0, 1, 2),
    settings: Settings = Settings(),
    jobs: int = 1,
    out: Path | None = None,
    config: dict | None = None,
    split_fn: Callable[[torch.Tensor, torch.Tensor, int], Splits] = split,
) -> dict:
    """The whole table; with ``out``, the JSON is rewritten after every finished job."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; expected some of {list(METHODS)}.")
    results: dict[str, dict[str, dict]] = {m: {} for m in methods}
    payload: dict[str, Any] = {
        "machine": common.machine(),
        "config": config or {},
        "results": results,
    }
    splits = {seed: split_fn(x, y, seed) for seed in seeds}
    total = time.perf_counter()

    def finish(rows: dict[str, dict], seed: int) -> None:
        for name, row in rows.items():
            results[name][str(seed)] = row
            print(
                f"{name:>10} seed {seed}: acc {row['accuracy']:.4f} NLL {row['nll']:.4f} "
                f"ECE {row['ece']:.4f} AUROC {row['ood_auroc']:.4f} "
                f"{row['epoch_s']:.2f} s/epoch ({row['setting']})",
                flush=True,
            )
        table = summary({m: r for m, r in results.items() if r})
        payload.update(table=table, wins=wins(table), total_s=time.perf_counter() - total)
        payload["statement"] = statement(table, payload["wins"])
        if out is not None:
            common.dump_json(out, payload)

    work = jobs_for(methods, seeds)
    if jobs <= 1:
        for group, seed in work:
            finish(run_job(group, seed, splits[seed], settings), seed)
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {
                pool.submit(run_job, group, seed, splits[seed], settings): seed
                for group, seed in work
            }
            for future in as_completed(futures):
                finish(future.result(), futures[future])
    if out is not None:
        print(f"wrote {out}")
    print(payload.get("statement", ""))
    return payload


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="MNIST folder (default $PYRO_BDL_DATA)")
    parser.add_argument("--quick", action="store_true", help="tiny run on scikit-learn digits")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument(
        "--hidden", type=int, default=None, help="hidden width (default 400 on cuda, 100 on cpu)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="worker processes over (method, seed)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.quick:
        settings = Settings(
            epochs=args.epochs or 1,
            hidden=args.hidden or 16,
            num_samples=4,
            members=2,
            device=args.device,
        )
    else:
        width = args.hidden or (400 if args.device.startswith("cuda") else 100)
        settings = Settings(epochs=args.epochs or 10, hidden=width, device=args.device)
    name, x, y = load(args.data_dir, args.quick)
    default = common.RESULTS / ("mnist_table_quick.json" if args.quick else "mnist_table.json")
    out = Path(args.out) if args.out else default
    config = {
        "dataset": name,
        "rows": len(y),
        "split": "60% train / 10% validation / 30% test, seeded permutation per seed",
        "ood": f"test digits rotated by {OOD_ROTATION} degrees",
        "network": f"MLP {math.prod(x.shape[1:])}-{settings.hidden}-{settings.hidden}-10",
        "candidates_per_method": CANDIDATES,
        "grids": GRIDS,
        "laplace": "last-layer GGN, probit predictive, lambda on the grid by validation NLL",
        "laplace_grid": LAPLACE_GRID.tolist(),
        "seeds": seeds,
        "jobs": args.jobs,
        **dataclasses.asdict(settings),
    }
    return run(
        x,
        y,
        methods=methods,
        seeds=seeds,
        settings=settings,
        jobs=args.jobs,
        out=out,
        config=config,
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
