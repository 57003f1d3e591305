"""The one method registry and training loop: classification (``pyro-bdl compare``) and
regression (``benchmarks/uci.py``) problems go through the same fit functions."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from benchmarks import uci
from pyro_bdl.app.compare import COMPARE_METHODS, METHODS, Problem, run
from pyro_bdl.app.compare.problem import train_loop
from pyro_bdl.app.data import Dataset
from pyro_bdl.guides import AutoSubnetLaplace


def _regression(n: int = 48, seed: int = 0) -> Dataset:
    """y = sin(2x) + 0.1 ε on x in [-1.5, 1.5], standardised enough for a unit prior."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n + 16, 1, generator=g) * 3 - 1.5
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n + 16, generator=g)
    return Dataset("toy", x[:n], y[:n], x[n:], y[n:], num_classes=None)


def _net(input_shape, outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.Tanh(), nn.Linear(16, outputs))


def _problem(**fields) -> Problem:
    base = Problem(_regression(), network=_net, epochs=3, batch_size=16, progress=False, noise=0.1)
    return dataclasses.replace(base, **fields)


def test_train_loop_calls_the_hooks_once_per_epoch_and_step():
    problem = _problem(epochs=4, batch_size=10)  # 48 rows: 5 steps an epoch
    epochs, steps = [], []
    losses = train_loop(
        problem, lambda x, y: float(len(y)), "test", on_epoch=epochs.append, on_step=steps.append
    )
    assert epochs == [0, 1, 2, 3]
    assert steps == list(range(1, 4 * 5 + 1)) and problem.num_steps == 20
    assert losses == [1.0] * 4  # Σ len(batch) / N


def test_compare_default_is_every_method_but_the_full_laplace_the_ensembles_ivon_and_dropout():
    slow = {"laplace", "ensemble", "multiswag", "ivon", "mc_dropout"}
    assert set(COMPARE_METHODS) == set(METHODS) - slow


def test_lr_decay_decays_the_rate_by_its_factor_over_the_run():
    problem = _problem(lr_decay=0.1, epochs=7)
    lrd = problem.optimizer().pt_optim_args["lrd"]
    assert lrd**problem.num_steps == pytest.approx(0.1)
    assert "lrd" not in _problem().optimizer().pt_optim_args  # plain Adam by default


def test_regression_problem_needs_its_noise():
    with pytest.raises(ValueError, match="noise"):
        _problem(noise=None).bayesian_model()


def test_compare_run_refuses_a_regression_problem():
    with pytest.raises(ValueError, match="regression"):
        run(_problem(), ["map"])


@pytest.mark.parametrize("name", ["map", "meanfield", "swag", "vogn", "laplace"])
def test_regression_predictors_are_distributions_over_the_targets(name):
    # Full batch, 40 steps; σ = 0.5 keeps the per-example curvature (≈ 1/σ²) small enough for
    # compare's SGD phase of SWAG (rate 0.05 per example).
    problem = _problem(epochs=40, batch_size=48, lr=1e-2, noise=0.5)
    keywords = {"settings": {"betas": (0.9, 0.05), "damping": 1e-3}} if name == "vogn" else {}
    if name == "swag":
        keywords = {"optimizer": "adam", "swa_lr": 1e-2, "snapshots": 40}
    predict = METHODS[name](problem, **keywords)
    x_test, y_test = problem.dataset.x_test, problem.dataset.y_test
    dist = predict(x_test)
    assert isinstance(dist, torch.distributions.Distribution)
    assert dist.batch_shape == (len(y_test),)
    assert torch.isfinite(dist.log_prob(y_test)).all()
    assert predict.guide is not None  # the fitted guide travels with the predictor


def test_swag_from_a_point_estimate_collects_once_per_epoch():
    values = METHODS["map"](_problem(epochs=30)).guide.median()
    problem = _problem(epochs=6, batch_size=16, init={k: v.detach() for k, v in values.items()})
    predict = METHODS["swag"](problem, optimizer="adam", swa_lr=1e-3, snapshots=problem.epochs)
    # every = epochs · ⌈48/16⌉ // epochs = 3 steps: one snapshot at the end of each epoch.
    assert predict.guide.num_collected == 6


def test_laplace_rejects_an_unknown_prior_precision_rule():
    with pytest.raises(ValueError, match="prior_precision"):
        METHODS["laplace"](_problem(), prior_precision="evidence")


# The smoke configuration trains the MAP for 40 steps only, short of a mode: the Laplace fit
# rightly warns that the network is not trained to a MAP estimate, and under σ(x) the validation
# rows may prefer the MAP limit, the edge of Laplace's λ grid.
@pytest.mark.filterwarnings("ignore::pyro_bdl.guides.laplace.model.NotAtModeWarning")
@pytest.mark.filterwarnings("ignore:the best prior precision:UserWarning")
@pytest.mark.parametrize("noise_model", uci.NOISE_MODELS)
def test_uci_runs_every_method_through_the_registry(noise_model):
    data = _regression(n=60)
    methods = list(uci.UCI_METHODS)
    cfg = dataclasses.replace(
        uci.DEFAULTS,
        noise_model=noise_model,
        hidden=8,
        map_steps=40,
        mf_steps=20,
        swag_epochs=3,
        vogn_steps=20,
        ensemble_members=2,
        paper_members=2,
        paper_epochs=2,
        dropout_rates=(0.01, 0.1),
        num_samples=4,
    )
    out = uci.run_methods(
        data.x_train, data.y_train, data.x_test, data.y_test, 1.0, cfg, methods, 0
    )
    assert set(out) == {*methods, "_noise", "_noise_map", "_chosen"}
    for name in methods:
        ll, rmse, seconds = out[name]
        assert torch.isfinite(torch.tensor([ll, rmse, seconds])).all(), name
    # The warm-started MAP fits sin(2x) far better than the target's spread (std ≈ 0.7).
    assert out["map"][1] < 0.5
    # MC dropout reports the rate it chose on held-out training rows, among those offered.
    assert out["_chosen"]["mc_dropout"]["rate"] in (0.01, 0.1)


# A few minibatch epochs leave the MAP short of a mode: the Laplace fit rightly warns, and the
# validation rows may prefer the MAP limit, the edge of the λ grid.
@pytest.mark.filterwarnings("ignore::pyro_bdl.guides.laplace.model.NotAtModeWarning")
@pytest.mark.filterwarnings("ignore:the best prior precision:UserWarning")
def test_uci_tunes_laplace_on_validation_rows_under_the_heteroscedastic_noise_model():
    data = _regression(n=40)
    cfg = dataclasses.replace(uci.DEFAULTS, hidden=4, map_epochs=5, num_samples=2)
    args = (data.x_train, data.y_train, data.x_test, data.y_test, 1.0, cfg, ["laplace"], 0)
    seen = []
    tune = AutoSubnetLaplace.tune_prior_precision

    def record(guide, data=None, **kw):
        seen.append(data)
        return tune(guide, data, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoSubnetLaplace, "tune_prior_precision", record)
        out = uci.run_methods(*args)
    assert math.isfinite(out["laplace"][0])
    # λ by validation LL on the held-out 20% of the training rows, never the test rows.
    ((x_val, y_val),) = seen
    _, val = uci.holdout_rows(len(data.y_train), cfg, 0)
    assert torch.equal(x_val, data.x_train[val]) and torch.equal(y_val, data.y_train[val])


def test_uci_sigma_rules_own_and_fixed():
    data = _regression(n=60)
    cfg = dataclasses.replace(
        uci.DEFAULTS, noise_model="homoscedastic", hidden=8, map_steps=40, num_samples=4
    )
    args = (data.x_train, data.y_train, data.x_test, data.y_test, 1.0)
    own = uci.run_methods(*args, dataclasses.replace(cfg, sigma="own"), ["map"], 0)
    fixed = uci.run_methods(*args, dataclasses.replace(cfg, sigma="fixed"), ["map"], 0)
    # The same validation σ either way; under "own" the MAP then learns its own from it.
    assert own["_noise"] == fixed["_noise"] == fixed["_noise_map"]
    assert own["_noise_map"] != own["_noise"]
    assert set(uci.SIGMA_RULES) == set(uci.UCI_METHODS)


def test_uci_problem_keeps_the_benchmark_row_order():
    # benchmarks/uci.py's noise fit amplifies float rounding, so its figures are defined by the
    # row order: a full batch in stored order, minibatches by one generator per split.
    from benchmarks.uci import UCIProblem

    x = torch.arange(10.0).reshape(10, 1)
    y = torch.arange(10.0)
    data = Dataset("uci", x, y, x[:0], y[:0], num_classes=None)
    full = UCIProblem(data, batch_size=10, seed=3, progress=False, noise=1.0)
    (_, yb), *rest = list(full.batches(epoch=4))
    assert not rest and torch.equal(yb, y)
    mini = UCIProblem(data, batch_size=4, seed=3, progress=False, noise=1.0)
    g = torch.Generator().manual_seed(3)
    orders = [torch.randperm(10, generator=g) for _ in range(3)]
    for epoch in range(3):
        got = torch.cat([b[1] for b in mini.batches(epoch)])
        assert torch.equal(got, y[orders[epoch]])


def test_every_entry_resolves_to_its_fit_function():
    for name in METHODS:
        fit = METHODS[name]
        assert callable(fit) and fit.__name__.startswith("fit_"), name


def test_ivon_entry_learns_a_linear_boundary_and_reports_its_rate():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 2, generator=g)
    y = (x[:, 0] > 0).long()
    data = Dataset("halves", x[:200], y[:200], x[200:], y[200:], num_classes=2)
    problem = Problem(data, network=_net, epochs=30, batch_size=50, progress=False)
    predict = METHODS["ivon"](problem, ivon_lr=0.3)
    probs = predict(data.x_test)
    assert probs.shape == (100, 2) and torch.allclose(probs.sum(-1), torch.ones(100))
    # Chance is 0.5 with a binomial sd of 0.05 over 100 test points; a learned boundary sits
    # 6 sd above it at 0.8 (the Bayes classifier, x₀ > 0, scores 1).
    assert (probs.argmax(-1) == data.y_test).float().mean() >= 0.8
    assert predict.lr == 0.3 and predict.guide is not None


def test_multiswag_recovers_from_a_diverging_rate_by_retrying_lower():
    from pyro_bdl.app.compare.recovery import DivergedWarning

    # σ = 0.5 scales the per-example rate by σ² = 0.25: 50 → 12.5, which overflows the loss of
    # this 16-unit network within a few steps (as multiswag's default did on an unseen UCI
    # dataset); 1.25 still does, 0.125 trains.
    problem = _problem(epochs=8, batch_size=16, noise=0.5)
    with pytest.warns(DivergedWarning, match="diverged at rate"):
        predict = METHODS["multiswag"](problem, num_members=2, sgd_lr=50.0)
    assert predict.rates == [0.125, 0.125]
    assert len(predict.notes) == 4 and "retried from scratch at 0.125" in predict.notes[-1]
    x_test, y_test = problem.dataset.x_test, problem.dataset.y_test
    assert torch.isfinite(predict(x_test).log_prob(y_test)).all()


def test_a_sigma_driven_out_of_range_mid_training_is_a_divergence_but_not_at_the_first_step():
    from pyro_bdl.app.compare.recovery import diverged
    from pyro_bdl.models.noise import check_likelihood_range

    # A heteroscedastic network's σ(x) = exp(s/2) overflows while its weights are still
    # moderate, so the parameter-size check alone misses it; the likelihood's refusal of
    # σ = inf after a step is the divergence. At the first step nothing has been trained yet:
    # the refusal is about the data or the start, and retrying lower would not help.
    problem = _problem(epochs=2, batch_size=48)  # one step an epoch

    def blows_up_at(step_number: int):
        count = [0]

        def step(x, y):
            count[0] += 1
            if count[0] == step_number:
                check_likelihood_range(y, y, torch.tensor(float("inf")), 1.0, where="σ(x)")
            return 0.0

        with pytest.raises(ValueError) as info:
            train_loop(problem, step, "toy")
        return info.value

    later = blows_up_at(2)
    assert diverged(later) and "so training diverged" in later.__notes__[-1]
    assert not diverged(blows_up_at(1))


def test_retry_lower_gives_up_with_a_note_and_passes_other_errors_through():
    from pyro_bdl.app.compare.recovery import ATTEMPTS, DivergedWarning, retry_lower

    def always(rate):
        raise FloatingPointError(f"loss inf at rate {rate}")

    with pytest.warns(DivergedWarning), pytest.raises(FloatingPointError) as info:
        retry_lower(always, 1.0, "toy")
    assert f"({ATTEMPTS} tries" in info.value.__notes__[-1]

    def broken(rate):
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        retry_lower(broken, 1.0, "toy")


HETEROSCEDASTIC = ["map", "meanfield", "radial", "swag", "vogn", "ivon", "ensemble", "multiswag"]


@pytest.mark.parametrize("name", [*HETEROSCEDASTIC, "mc_dropout"])
def test_heteroscedastic_methods_predict_an_input_dependent_spread(name):
    # y = x + ε with ε's sd 0.05 for x < 0 and 0.5 for x > 0: a mean-and-variance network
    # learns the two levels (a homoscedastic σ could not: its spread is the same everywhere).
    g = torch.Generator().manual_seed(0)
    x = torch.rand(240, 1, generator=g) * 2 - 1
    y = x[:, 0] + torch.where(x[:, 0] < 0, 0.05, 0.5) * torch.randn(240, generator=g)
    data = Dataset("steps", x[:200], y[:200], x[200:], y[200:], num_classes=None)
    problem = Problem(
        data,
        network=_net,
        epochs=300,
        batch_size=200,
        lr=1e-2,
        progress=False,
        sigma="heteroscedastic",
        num_samples=8,
    )
    keywords: dict = {
        "vogn": {"settings": {"betas": (0.9, 0.05), "damping": 1e-3}},
        "swag": {"optimizer": "adam", "swa_lr": 1e-2, "snapshots": 20},
        # σ(x) ≈ 0.05 on the left: per-example curvature ≈ 400, so a per-example SGD rate of
        # 0.05 overflows (the retry would rescue it, with a warning); 0.005 trains.
        "multiswag": {"num_members": 2, "sgd_lr": 0.005, "swa_lr": 0.01},
        "ensemble": {"num_members": 2},
        "mc_dropout": {"rate": 0.01},
    }.get(name, {})
    if name == "vogn":
        problem = dataclasses.replace(problem, lr=0.1, lr_decay=0.01)
    if name == "swag":  # from a MAP, as the UCI benchmark runs it (no SGD phase)
        values = METHODS["map"](problem).guide.median()
        problem = dataclasses.replace(problem, init={k: v.detach() for k, v in values.items()})
    if name == "multiswag":
        problem = dataclasses.replace(problem, epochs=60, batch_size=50)
    dist = METHODS[name](problem, **keywords)(torch.tensor([[-0.5], [0.5]]))
    assert dist.batch_shape == (2,)
    sd = dist.variance.sqrt()
    # The noise is 10× larger on the right; the weights' uncertainty adds the same to both
    # sides (IVON's tempered posterior: about 0.2), so ask for 1.5× — a homoscedastic σ gives 1×.
    assert sd[1] > 1.5 * sd[0], sd


def test_laplace_fits_a_heteroscedastic_problem():
    # The Gaussian's Fisher in (μ, s) and the mixture predictive: a distribution per test row.
    problem = _problem(epochs=200, batch_size=48, lr=1e-2, sigma="heteroscedastic")
    dist = METHODS["laplace"](problem, prior_precision=1.0)(problem.dataset.x_test)
    assert dist.batch_shape == problem.dataset.y_test.shape
    assert torch.isfinite(dist.log_prob(problem.dataset.y_test)).all()


def test_the_adversarial_ensemble_trains_on_perturbed_inputs_too():
    # The deep-ensembles recipe: mean-and-variance members, fast-gradient-sign inputs at ε = 1%
    # of each input's range. Full batch, 200 steps: both fit; the adversarial term changes the
    # weights, so the two predictives differ.
    problem = _problem(epochs=200, batch_size=48, lr=1e-2, sigma="heteroscedastic")
    x_test, y_test = problem.dataset.x_test, problem.dataset.y_test
    plain = METHODS["ensemble"](problem, num_members=2)(x_test)
    adversarial = METHODS["ensemble"](problem, num_members=2, adversarial=0.01)(x_test)
    for dist in (plain, adversarial):
        # Fitted: sin(2x) leaves a residual of 0.1, far under the target's spread (≈ 0.7).
        assert float((dist.mean - y_test).square().mean().sqrt()) < 0.3
    assert not torch.allclose(plain.mean, adversarial.mean)
    with pytest.raises(ValueError, match="adversarial"):
        METHODS["ensemble"](problem, num_members=1, adversarial=-0.01)
