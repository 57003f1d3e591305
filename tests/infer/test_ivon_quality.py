"""IVON and VOGN against MAP/Adam on real data (scikit-learn's 8×8 digits and the MNIST test-set
split, a small CNN): the variational methods should match Adam's test accuracy within one point
with a lower test NLL and ECE (the claim of Shen et al., ICML 2024, on far larger problems;
docs/design/ivon.md).

Protocol, fixed on the validation split before any seed was scored on the test split. Every
method has a grid of four settings (:data:`GRIDS`) and the same rate schedule (linear decay to
zero); each grid is run with the tuning seed and the setting with the lowest NLL on a validation
split carved from the training data (a fifth of it) is kept. That setting is trained again with
every seed of :data:`SEEDS` (network initialisation, minibatch order, posterior draws; the
minibatches are the same for every method) and scored on the test split, which chooses nothing.
Digits: 1,150 training images, 30 epochs, 10 seeds; MNIST: 6,400 training images, 5 epochs, 6
seeds (the fewest at which the signed-rank test at 5% tolerates one adverse seed; with 5 every
seed must gain), skipped without the data. Each claim is a paired one-sided test over the seeds
at the 5% level (:func:`claim_p_value`, :func:`assert_claim`). Adam's four rates bracket the one
its validation NLL prefers on both data sets, 3e-2 (digits 0.080 against 0.113 at 1e-2 and 0.097
at 1e-1; MNIST 0.692 against 0.938 and 0.982).

Measured 2026-11-28 (2-core AMD EPYC, torch 2.14.1, one thread), test accuracy % / NLL / ECE per
seed 0, 1, ...; chosen: Adam rate 3e-2, IVON rate 1.0 with ess = 10 N, VOGN rate 1e-2 with
τ = 0.03, on both data sets.

- Digits (4 min 42 s of process time). Adam: 98.6 98.9 99.2 99.2 98.9 98.9 98.6 98.3 99.4 98.9 /
  .049 .041 .045 .044 .053 .049 .059 .051 .045 .057 / .014 .021 .020 .017 .018 .019 .029 .021 .027
  .019. IVON: 98.9 99.4 98.9 98.3 98.6 99.4 98.6 98.6 98.6 98.9 / .032 .033 .029 .039 .042 .024
  .031 .038 .035 .037 / .012 .014 .014 .009 .010 .013 .016 .012 .014 .007: all three claims in 10
  of 10 seeds (p = 0.001 each). VOGN: 98.6 97.2 98.3 98.1 98.9 98.9 99.2 97.2 98.1 97.8 / .096 .115
  .101 .091 .079 .089 .085 .107 .093 .073 / .052 .050 .053 .044 .049 .055 .061 .046 .042 .037:
  within a point of Adam in 5 of 10 seeds (p = 0.62), NLL and ECE above Adam's in all 10, so its
  three claims are strict xfails. On the validation split VOGN is underconfident (mean confidence
  0.907 at accuracy 0.979, seed 0; Adam 0.959 at 0.976), and its pick sits at its grid's corner:
  the larger rate and the colder τ. A colder posterior or a longer run, chosen on validation, is
  where to look.
- MNIST (9 min 5 s). Adam: 80.70 80.45 79.55 80.40 79.15 80.60 / .682 .691 .709 .705 .738 .698
  / .158 .155 .150 .162 .165 .164. IVON: 82.35 82.60 81.90 81.15 80.70 81.10 / .611 .578 .633 .643
  .644 .624 / .128 .098 .135 .124 .121 .113. VOGN: 81.20 81.15 80.40 80.95 82.00 82.10 / .638 .625
  .650 .637 .611 .591 / .117 .117 .120 .114 .117 .100. Every claim of both in 6 of 6 seeds
  (p = 1/64 each). Every method underfits this 16/32-channel network in 5 epochs and is
  underconfident (validation, seed 0: mean confidence 0.64 at accuracy 0.80 for Adam, 0.69 at
  0.82 for IVON, 0.68 at 0.80 for VOGN), so a lower ECE here means a less underconfident
  predictor.
"""

from __future__ import annotations

import functools

import pyro
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest

import pyro_bdl as bdl
from pyro_bdl.app.compare.problem import cnn
from pyro_bdl.app.compare.vogn import BETAS, TEMPERATURE, damping
from pyro_bdl.app.data import load_digits
from pyro_bdl.diagnostics.metrics import accuracy, ece, nll
from tests.guides.test_swag import mnist_or_skip, signed_rank_p_value

#: One worker for all of this module's tests under ``--dist loadgroup`` (``make test-slow``): each
#: data set's runs are cached in the process, and split across workers each would redo them.
pytestmark = pytest.mark.xdist_group("ivon_quality")

#: Training epochs per data set (MNIST has 5.6× the rows and 12× the pixels of digits).
EPOCHS = {"digits": 30, "mnist": 5}
BATCH = 32
SAMPLES = 32  # posterior draws per prediction
CHUNK = 250  # rows per prediction call (see _evaluate)
#: The seed whose run chooses every method's setting on the validation split.
TUNING_SEED = 0
#: The seeds of the comparison (network initialisation, minibatch order, posterior draws).
SEEDS = {"digits": tuple(range(10)), "mnist": tuple(range(6))}

#: Each method's grid of four settings, searched on the validation split of the tuning seed's run.
#: Adam's are four learning rates; IVON's and VOGN's two rates by two temperings (IVON: ess = N
#: or 10 N; VOGN: τ = 0.1 or 0.03, compare's setting, with compare's β₂ and damping), the usual
#: practice for both methods on small data sets. Every method's rate decays linearly to zero.
GRIDS = {
    "adam": [{"lr": lr} for lr in (3e-3, 1e-2, 3e-2, 1e-1)],
    "ivon": [
        {"lr": lr, "hess_init": 0.5, "ess_factor": k} for lr in (0.3, 1.0) for k in (1.0, 10.0)
    ],
    "vogn": [
        {"lr": lr, "temperature": tau, "betas": BETAS}
        for lr in (3e-3, 1e-2)
        for tau in (0.1, TEMPERATURE)
    ],
}


@functools.cache
def _splits(dataset: str):
    if dataset == "digits":
        data = load_digits(seed=0)
    else:
        data = mnist_or_skip()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(data.y_train), generator=g)
    n_val = len(perm) // 5
    val, train = perm[:n_val], perm[n_val:]
    return (
        (data.x_train[train], data.y_train[train]),
        (data.x_train[val], data.y_train[val]),
        (data.x_test, data.y_test),
    )


def _minibatches(n: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The run's minibatches: a fresh permutation of the n rows each epoch, the same for every
    method trained with ``seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        out += [perm[i : i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
    return out


def _train(optimizer, lr: float, batches, step) -> None:
    """Run ``step(idx)`` over ``batches`` with the rate decaying linearly from ``lr`` to zero."""
    for count, idx in enumerate(batches):
        optimizer.param_groups[0]["lr"] = lr * (1 - count / len(batches))
        step(idx)


def _net(shape: tuple[int, ...], seed: int):
    torch.manual_seed(seed)
    return cnn(shape, 10)


def _evaluate(predict, split) -> dict[str, float]:
    """Accuracy (%), NLL and ECE of ``predict`` on ``split``, predicted ``CHUNK`` rows at a time:
    a whole MNIST split at once allocates ~100 MB of activations per draw, and their page faults
    cost more than the arithmetic (16.6 s of system time besides 6 s of user time for 32 draws
    on 2,000 images, against 7 s in all in chunks of 250)."""
    x, y = split
    probs = torch.cat([predict(rows) for rows in x.split(CHUNK)])
    return {"acc": 100 * accuracy(probs, y), "nll": nll(probs, y), "ece": ece(probs, y)}


def fit_adam(train, settings: dict, epochs: int, seed: int):
    """MAP: Adam on the mean cross-entropy plus the N(0, 1) prior's ½‖w‖²/N."""
    x, y = train
    net = _net(tuple(x.shape[1:]), seed)
    opt = torch.optim.Adam(net.parameters(), lr=settings["lr"])

    def step(idx):
        opt.zero_grad(set_to_none=True)
        decay = sum(p.square().sum() for p in net.parameters()) / (2 * len(y))
        (F.cross_entropy(net(x[idx]), y[idx]) + decay).backward()
        opt.step()

    _train(opt, settings["lr"], _minibatches(len(y), epochs, seed), step)
    net.eval()

    def predict(xs):
        with torch.no_grad():
            return net(xs).softmax(-1)

    return predict


def fit_bayes(train, method: str, settings: dict, epochs: int, seed: int):
    """IVON or VOGN through their public API; predictions average posterior draws."""
    x, y = train
    pyro.clear_param_store()
    net = bdl.bayesianize(_net(tuple(x.shape[1:]), seed), bdl.priors.Normal(scale=1.0))
    model = bdl.models.classifier(net, len(y))
    options = dict(settings)
    batches = _minibatches(len(y), epochs, seed)
    if method == "ivon":
        options["ess"] = options.pop("ess_factor") * len(y)
        fit: bdl.infer.IVON | bdl.infer.VOGN = bdl.infer.IVON(model, dataset_size=len(y), **options)
    else:  # compare's damping for a run of this many steps
        options["damping"] = damping(len(batches))
        fit = bdl.infer.VOGN(model, dataset_size=len(y), **options)
    _train(fit.optimizer, settings["lr"], batches, lambda idx: fit.step(x[idx], y[idx]))
    net.eval()

    def predict(xs):
        torch.manual_seed(seed)
        # One draw after another: on one CPU thread the vectorised pass over the draws of this
        # CNN takes 4× as long (8 draws on 400 images: 1.4 s against 0.34 s); the same
        # distribution either way.
        logits = bdl.predictive.sample_outputs(
            model, fit.guide, xs, num_samples=SAMPLES, parallel=False
        )
        return logits.softmax(-1).mean(0)

    return predict


def fit(dataset: str, method: str, settings: dict, seed: int):
    train = _splits(dataset)[0]
    if method == "adam":
        return fit_adam(train, settings, EPOCHS[dataset], seed)
    return fit_bayes(train, method, settings, EPOCHS[dataset], seed)


def tune(dataset: str) -> dict[str, list[tuple[dict, dict, object]]]:
    """Every method's grid on the tuning seed: (setting, validation metrics, predictor) each."""
    val = _splits(dataset)[1]
    out = {}
    for method, grid in GRIDS.items():
        out[method] = []
        for settings in grid:
            predict = fit(dataset, method, settings, TUNING_SEED)
            out[method].append((settings, _evaluate(predict, val), predict))
    return out


@functools.cache
def run(dataset: str) -> dict:
    """Each method's setting with the lowest validation NLL on the tuning seed, and that
    setting's test metrics in every seed of ``SEEDS[dataset]`` (the tuning seed's run reused),
    with every setting's validation metrics."""
    torch.set_num_threads(1)
    test = _splits(dataset)[2]
    chosen, per_seed, validation = {}, {}, {}
    for method, rows in tune(dataset).items():
        validation[method] = [(settings, metrics) for settings, metrics, _ in rows]
        settings, _, tuned = min(rows, key=lambda row: row[1]["nll"])
        chosen[method], per_seed[method] = settings, []
        for seed in SEEDS[dataset]:
            predict = tuned if seed == TUNING_SEED else fit(dataset, method, settings, seed)
            per_seed[method].append(_evaluate(predict, test))
    result = {"chosen": chosen, "test": per_seed, "validation": validation}
    print(dataset, result)
    return result


#: Each claim as a per-seed gain of the method over Adam, positive when the claim holds.
GAINS = {
    "accuracy": lambda ours, adam: ours["acc"] - (adam["acc"] - 1.0),
    "nll": lambda ours, adam: adam["nll"] - ours["nll"],
    "ece": lambda ours, adam: adam["ece"] - ours["ece"],
}


def claim_p_value(dataset: str, method: str, claim: str) -> tuple[float, list[float]]:
    """One-sided p-value of "no gain" against "gain" over the seeds, and the gains.

    NLL and ECE are continuous, so their gains have no ties: Wilcoxon's exact signed-rank test.
    Accuracy moves in steps of one test point (1/360 on digits, 1/2000 on MNIST), so its gains
    tie and can be exactly zero (one point behind Adam, which the claim allows): an exact sign
    test on the number of seeds with gain ≥ 0 (10⁻⁹ absorbs the round-off of 100 × a fraction).
    """
    r = run(dataset)["test"]
    gains = [GAINS[claim](ours, adam) for ours, adam in zip(r[method], r["adam"])]
    if claim == "accuracy":
        wins = sum(gain > -1e-9 for gain in gains)
        return binomtest(wins, len(gains), 0.5, alternative="greater").pvalue, gains
    return signed_rank_p_value(gains), gains


def assert_claim(dataset: str, method: str, claim: str) -> None:
    """The claim at the one-sided 5% level, exact under "no gain" (gains symmetric about 0).
    With 10 seeds (digits) the signed-rank test passes iff W⁻ ≤ 10 (P = 43/1024 = 0.042;
    W⁻ ≤ 11 has 0.053) and the sign test iff 9 or 10 seeds gain (P = 11/1024 = 0.011; 8 have
    0.055); with 6 seeds (MNIST) iff W⁻ ≤ 2 (P = 3/64 = 0.047; W⁻ ≤ 3 has 0.078) and iff all 6
    gain (P = 1/64; 5 have 7/64 = 0.11). Each of the 12 claims is tested on its own, so a method
    no better than Adam passes a given one by chance with probability ≤ 5%."""
    p, gains = claim_p_value(dataset, method, claim)
    assert p <= 0.05, (p, gains, run(dataset))


@pytest.mark.slow
@pytest.mark.parametrize(
    "dataset, method, claim",
    [
        (dataset, method, claim)
        for dataset, methods in (("digits", ("ivon",)), ("mnist", ("ivon", "vogn")))
        for method in methods
        for claim in GAINS
    ],
)
def test_the_claim_holds_over_seeds(dataset, method, claim):
    assert_claim(dataset, method, claim)


def _vogn_digits_miss(claim: str, measured: str):
    reason = (
        f"known miss on digits, 2026-11-28: {measured} (module docstring). Strict: a pass means "
        "the claim holds and this marker must go."
    )
    return pytest.param(claim, marks=pytest.mark.xfail(strict=True, reason=reason))


@pytest.mark.slow
@pytest.mark.parametrize(
    "claim",
    [
        _vogn_digits_miss(
            "accuracy",
            "VOGN's accuracy is within one point of Adam's in 5 of 10 seeds (means 98.2% vs "
            "98.9%; sign test p = 0.62)",
        ),
        _vogn_digits_miss("nll", "VOGN's NLL is above Adam's in all 10 seeds (mean .093 vs .049)"),
        _vogn_digits_miss("ece", "VOGN's ECE is above Adam's in all 10 seeds (mean .049 vs .020)"),
    ],
)
def test_vogn_on_digits(claim):
    assert_claim("digits", "vogn", claim)


if __name__ == "__main__":
    import sys
    import time

    t0 = time.process_time()
    run(sys.argv[1])
    print(time.process_time() - t0)
