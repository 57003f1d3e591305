"""Temperature scaling: exact optima by construction, recovery of a known temperature, the
optimality conditions against autograd and brute force, invariances, and the errors."""

import math

import numpy as np
import pytest
import torch

import pyro_bdl.diagnostics.temperature as temperature_module
from pyro_bdl.diagnostics import fit_temperature, metrics, temperature_scale
from tests.common import assert_close


def _nll(logits: torch.Tensor, y: torch.Tensor, temperature) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits / temperature, y)


def _counted_rows(true_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits T*·log k + shift whose labels occur exactly k_c times each: at T = T* the
    model's probabilities k_c / K equal the labels' frequencies in every row, so the slope
    Σ (E_p[z] − z_y) of the NLL in 1/T is exactly zero there and T* is the unique optimum."""
    counts = [[1, 2, 3, 4], [5, 1, 1, 1], [2, 2, 1, 7], [1, 9, 1, 1]]
    shifts = [0.0, -3.0, 10.0, 2.5]  # softmax ignores a constant per row
    logits, labels = [], []
    for k, shift in zip(counts, shifts):
        row = true_t * torch.tensor(k, dtype=torch.float64).log() + shift
        for c, times in enumerate(k):
            logits += [row] * times
            labels += [c] * times
    return torch.stack(logits), torch.tensor(labels)


@pytest.mark.parametrize("true_t", [1.0, 0.25, 3.0])
def test_optimum_by_construction_is_found_exactly(true_t, monkeypatch):
    logits, y = _counted_rows(true_t)
    calls = _count_evaluations(monkeypatch)
    # T = 1 is a fixed point when it is optimal (the search starts there); the others are hit to
    # float64 rounding of the logits.
    assert_close(fit_temperature(logits, y), true_t, rtol=1e-12)
    # Newton, not bisection: a bracket of width ≤ 2 then quadratic convergence (2-7 observed);
    # bisection alone would need log2(2 / 1e-10) ≈ 35 evaluations.
    assert len(calls) <= 10


def _count_evaluations(monkeypatch) -> list:
    """Record every evaluation of the NLL's slope and curvature during the search."""
    calls: list = []
    original = temperature_module._slope_and_curvature

    def counted(*args):
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(temperature_module, "_slope_and_curvature", counted)
    return calls


@pytest.mark.parametrize("true_t", [0.3, 1.0, 4.0])
def test_recovers_the_temperature_that_generated_the_labels(true_t, monkeypatch):
    g = torch.Generator().manual_seed(int(100 * true_t))
    n = 10_000
    z = 2.0 * torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=g).squeeze(-1)
    calls = _count_evaluations(monkeypatch)
    fitted = fit_temperature(true_t * z, y)
    assert len(calls) <= 12  # bracketing in ≤ 3 doublings, then Newton (5-8 observed)
    # T̂ is the MLE of β = 1/T in the model softmax(β·ℓ), ℓ = T*·z. Its Fisher information per
    # row is E[Var_p(ℓ)] = T*² v with v = E[Var_softmax(z)(z)], so sd(β̂) = 1/(T* √(n v)) and, by
    # the delta method, sd(log T̂) = sd(β̂)/β* = 1/√(n v) (≈ 0.012 here: v ≈ 0.66). Five standard
    # deviations: a false failure has probability below 1e-6 under asymptotic normality.
    p = z.softmax(-1)
    v = float((p * (z - (p * z).sum(-1, keepdim=True)) ** 2).sum(-1).mean())
    assert abs(math.log(fitted / true_t)) < 5 / math.sqrt(n * v)


def test_gradient_vanishes_and_brute_force_agrees():
    g = torch.Generator().manual_seed(1)
    z = 3.0 * torch.randn(2000, 10, generator=g, dtype=torch.float64)
    # Misspecified on purpose: labels from noisier logits, so the optimum is not a round number.
    y = torch.multinomial((z + torch.randn(z.shape, generator=g, dtype=z.dtype)).softmax(-1), 1)
    y = y.squeeze(-1)
    fitted = fit_temperature(z, y)
    t = torch.tensor(fitted, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(_nll(z, y, t), t)
    # Stopping at a step of 1e-10 in log T leaves |dL/dT| ≤ L''(T)·T·1e-10 ~ 1e-10 here, and the
    # float64 sums of 2000 rows round at ~1e-13; 1e-8 is far below any real slope.
    assert abs(float(grad)) < 1e-8
    # Brute force: no point of a fine grid over [0.1, 10] has a lower NLL (1e-12 = rounding).
    grid = torch.logspace(-1, 1, 2001, dtype=torch.float64)
    log_p = torch.cat([(z / t.view(-1, 1, 1)).log_softmax(-1) for t in grid.split(100)])
    grid_nll = -log_p.gather(-1, y.expand(len(grid), -1).unsqueeze(-1)).mean((1, 2))
    best = float(_nll(z, y, fitted))
    assert best <= float(grid_nll.min()) + 1e-12
    assert_close(fitted, float(grid[grid_nll.argmin()]), rtol=2.5e-3)  # grid spacing 2.3e-3
    # Deterministic: the same inputs give the same float.
    assert fit_temperature(z, y) == fitted


def test_invariances():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(500, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial((1.5 * z).softmax(-1), 1, generator=g).squeeze(-1)
    fitted = fit_temperature(z, y)
    # A constant per row changes no probability; scaling the logits by a scales T by a.
    shift = torch.randn(500, 1, generator=g, dtype=torch.float64)
    assert_close(fit_temperature(z + shift, y), fitted, rtol=1e-9)
    assert_close(fit_temperature(7.0 * z, y), 7.0 * fitted, rtol=1e-9)
    assert_close(fit_temperature(z.numpy(), y.numpy()), fitted, rtol=0)
    # The argmax (so the accuracy) is the same at every temperature.
    for t in (0.05, fitted, 1.0, 20.0):
        probs = temperature_scale(z, t)
        assert torch.equal(probs.argmax(-1), z.argmax(-1))
        assert metrics.accuracy(probs, y) == metrics.accuracy(z.softmax(-1), y)


def test_temperature_scale_values():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 4, generator=g)  # posterior draws (S, n, C) are fine here
    probs = temperature_scale(logits, 2.0)
    assert probs.dtype == logits.dtype and probs.shape == logits.shape
    assert_close(probs, (logits / 2.0).softmax(-1), rtol=0, atol=0)
    assert_close(temperature_scale(logits, 1.0), logits.softmax(-1), rtol=0, atol=0)
    # A float32 sum of 4 probabilities: ≤ 4 roundings of ε/2 = 6e-8 (1.2e-7 measured).
    assert_close(probs.sum(-1), torch.ones(3, 6), rtol=1e-6)
    # Very hot: uniform (logits/T ~ 1e-9 move each probability by ~1e-9, below float32's 6e-8
    # at 0.25); very cold: one-hot on the argmax.
    assert_close(temperature_scale(logits, 1e9), torch.full_like(logits, 0.25), rtol=1e-6)
    cold = temperature_scale(logits.double(), 1e-6)
    assert torch.equal(cold, torch.nn.functional.one_hot(logits.argmax(-1), 4).double())


@pytest.mark.parametrize("prior_shape", [1.5, 2.0, 50.0])
def test_gamma_prior_mode(prior_shape):
    g = torch.Generator().manual_seed(4)
    z = 4.0 * torch.randn(60, 5, generator=g, dtype=torch.float64)
    y = torch.multinomial((0.5 * z).softmax(-1), 1, generator=g).squeeze(-1)
    fitted = fit_temperature(z, y, prior_shape=prior_shape)
    # The objective in β = 1/T: mean NLL + [aβ − (a − 1) log β]/n; its slope vanishes at 1/T̂.
    beta = torch.tensor(1.0 / fitted, dtype=torch.float64, requires_grad=True)
    a, n = prior_shape, len(y)
    objective = _nll(z * beta, y, 1.0) + (a * beta - (a - 1) * beta.log()) / n
    (grad,) = torch.autograd.grad(objective, beta)
    assert abs(float(grad)) < 1e-8  # as in the no-prior test: a step of 1e-10 in log T
    # The sum of two convex functions is minimised between their minimisers: the MLE 1/T_ml and
    # the prior's mode (a − 1)/a.
    ends = sorted([1.0 / fit_temperature(z, y), (a - 1) / a])
    assert ends[0] < 1.0 / fitted < ends[1]


def test_gamma_prior_gives_a_temperature_where_the_likelihood_has_none():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.5, 0.0, 3.0]])
    # All labels top-scoring: the likelihood alone wants T → 0; the prior stops it below 1.
    sharp = fit_temperature(logits, torch.tensor([0, 1, 2]), prior_shape=2.0)
    # Labels on the lowest logits: the likelihood alone wants T → ∞; the prior stops it above 1.
    soft = fit_temperature(logits, torch.tensor([2, 0, 1]), prior_shape=2.0)
    assert 0 < sharp < 1 < soft < math.inf


LOGITS = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.5, 0.0, 3.0]])
Y = torch.tensor([0, 2, 2])


@pytest.mark.parametrize(
    "logits, y, error, match",
    [
        (LOGITS[0], Y[:1], ValueError, r"shape \(n, C\); got \(3,\).*unsqueeze"),
        (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), ValueError, "non-empty"),
        (torch.zeros(3, 1), Y * 0, ValueError, "at least 2 classes"),
        (LOGITS.long(), Y, TypeError, "floating point.*double"),
        (LOGITS.clone().fill_(float("nan")), Y, ValueError, "logits contains 9 non-finite"),
        (LOGITS, Y[:2], ValueError, r"shape \(3,\) to match logits \(3, 3\); got \(2,\)"),
        (LOGITS, Y.unsqueeze(-1), ValueError, r"got \(3, 1\).*reshape"),
        (LOGITS, Y.double(), TypeError, "integers.*y.long"),
        (LOGITS, Y + 1, ValueError, r"\[0, 3\).*max 3"),
        (LOGITS, Y - 1, ValueError, r"\[0, 3\).*min -1"),
        (LOGITS, "abc", TypeError, "y must be a torch.Tensor"),
        # Every label is its row's top class: the NLL falls all the way to T = 0.
        (LOGITS, torch.tensor([0, 1, 2]), ValueError, "T → 0.*larger validation split"),
        # Labels on the lowest logits: uniform (T = ∞) is best.
        (LOGITS, torch.tensor([2, 0, 1]), ValueError, "uniform probabilities are best"),
        # Labels that score exactly their rows' mean on average: a slope of exactly 0 at T = ∞
        # is no optimum either (the slope is positive at every finite T).
        (torch.tensor([[2.0, 0.0]] * 2), torch.tensor([0, 1]), ValueError, "uniform.*are best"),
    ],
)
def test_fit_temperature_errors(logits, y, error, match):
    with pytest.raises(error, match=match):
        fit_temperature(logits, y)


def test_option_and_convergence_errors():
    with pytest.raises(ValueError, match="tol must be finite and > 0"):
        fit_temperature(LOGITS, Y, tol=0.0)
    for bad in (1.0, 0.5, -2.0, float("nan")):
        with pytest.raises(ValueError, match="prior_shape must be"):
            fit_temperature(LOGITS, Y, prior_shape=bad)
    with pytest.raises(TypeError, match="max_iter must be an int"):
        fit_temperature(LOGITS, Y, max_iter=2.5)
    logits, y = _counted_rows(3.0)
    with pytest.raises(RuntimeError, match="max_iter=1"):
        fit_temperature(logits, y, max_iter=1, tol=1e-300)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_temperature_scale_refuses_bad_temperatures(temperature):
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0.*fit_temperature"):
        temperature_scale(LOGITS, temperature)


def test_temperature_scale_refuses_bad_logits():
    with pytest.raises(ValueError, match="non-empty"):
        temperature_scale(torch.zeros(0), 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        temperature_scale(torch.tensor([1.0, float("inf")]), 1.0)
    with pytest.raises(TypeError, match="floating point"):
        temperature_scale(np.arange(3), 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_temperature_scale_of_large_logits_in_a_narrow_dtype_is_finite(dtype):
    # 300 / 0.01 = 30000 and 3e4 / 1e-36 overflow float16 and float32: softmax(inf) was NaN.
    logits = torch.tensor([[300.0, 0.0, -100.0], [3e4, 2e4, 1e4]]).to(dtype)
    for temperature in (0.01, 1e-36):
        probs = temperature_scale(logits, temperature)
        assert probs.dtype == dtype
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 3).to(dtype))


def test_probabilities_passed_as_logits_are_refused():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(40, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=g).squeeze(-1)
    for probs in (z.softmax(-1), z.softmax(-1).float(), z.softmax(-1).bfloat16()):
        with pytest.raises(ValueError, match=r"look like probabilities.*probs\.log\(\)"):
            fit_temperature(probs, y)
        with pytest.raises(ValueError, match=r"look like probabilities.*probs\.log\(\)"):
            temperature_scale(probs, 2.0)
    # The fix it proposes gives the temperature of the logits: log p differs by a row constant.
    assert_close(fit_temperature(z.softmax(-1).log(), y), fit_temperature(z, y), rtol=1e-9)


def test_newton_uses_the_gamma_priors_curvature(monkeypatch):
    # On n = 6 rows the prior's curvature (a − 1)/(β² n) is a large part of h'(u) = β L''(β):
    # with it Newton converges quadratically (5 evaluations observed); with a wrong one (say
    # (a − 1)/(β n)) its steps fail the halving test and bisection takes over (21 observed).
    logits = torch.tensor(
        [
            [2.0, 0.0, -1.0],
            [0.0, 1.0, 0.0],
            [0.5, 0.0, 3.0],
            [1.0, 2.0, 0.0],
            [0.0, 0.0, 1.0],
            [3.0, -1.0, 0.0],
        ],
        dtype=torch.float64,
    )
    y = torch.tensor([0, 1, 2, 0, 2, 1])
    calls = _count_evaluations(monkeypatch)
    fit_temperature(logits, y, prior_shape=2.0)
    assert len(calls) <= 10
