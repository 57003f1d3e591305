"""VOGN and IVON lines whose wrong versions the by-hand and pinned tests let through: the
temperature a schedule gives each step's update, evaluate_loss over several particles, the loss a
skipped step returns, IVON's clipped path where it clips nothing, the mean prior precision that
damps a hidden parameter, the boundary of VOGN's warning about a curvature of too few examples,
σ after an update refused at its state check, and a first curvature that is non-finite in a
hidden parameter only."""

from __future__ import annotations

import copy
import dataclasses
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.infer import IVON, VOGN
from tests.infer.test_ivon import small_classifier
from tests.scenarios import BayesianLinearRegression


def _vogn_run(temperature, taus: list[float]) -> VOGN:
    """Three VOGN steps; ``temperature`` as given to the constructor, and where it is ``None``
    the τ of each step set through the setter just before it."""
    pyro.clear_param_store()
    sc = BayesianLinearRegression(n=20)
    vogn = VOGN(
        sc.model(),
        dataset_size=sc.n,
        lr=0.1,
        temperature=1.0 if temperature is None else temperature,
        prior_precision=50.0,  # a strong prior, so that δ̃ = τδ/Ñ weighs in the step
    )
    torch.manual_seed(0)
    for tau in taus:
        if temperature is None:
            vogn.temperature = tau
        vogn.step(sc.x, sc.y)
    return vogn


def test_a_temperature_schedule_updates_each_step_with_that_steps_temperature():
    # A schedule step -> τ and the setter given the same τ before each step are one run: the
    # step's τ enters its loss, its σ and its update's δ̃ = τδ/Ñ alike, not the τ of the step
    # before (nor τ = 1 at the first step of a schedule, before any τ was taken).
    taus = [0.3, 0.6, 0.9]
    scheduled = _vogn_run(lambda step: taus[step - 1], taus)
    stepped = _vogn_run(None, taus)
    for a, b in (
        (scheduled.state.mean, stepped.state.mean),
        (scheduled.state.momentum, stepped.state.momentum),
        (scheduled.guide.scale, stepped.guide.scale),
    ):
        assert torch.equal(a, b), (a, b)
    assert scheduled.temperature == stepped.temperature == 0.9


@pytest.mark.parametrize("cls", [VOGN, IVON])
def test_evaluate_loss_averages_the_particles_and_weights_the_kl_by_tau(cls):
    sc = BayesianLinearRegression(n=20)
    pyro.clear_param_store()
    options = {"temperature": 0.4} if cls is VOGN else {}
    fit = cls(
        sc.model(), dataset_size=sc.n, lr=0.05, num_particles=3, prior_precision=2.0, **options
    )
    fit.step(sc.x, sc.y)
    torch.manual_seed(7)
    loss = fit.evaluate_loss(sc.x, sc.y)
    # By hand: N/B Σᵢ ℓᵢ(w) averaged over the 3 draws w = μ + σε (the same ε: the same
    # generator calls), plus τ KL(N(μ, σ²) ‖ N(0, 1/δ)) in closed form (τ = 1 for IVON).
    mu, sigma, delta = fit.guide.loc.clone(), fit.guide.scale.clone(), 2.0
    tau = 0.4 if cls is VOGN else 1.0
    torch.manual_seed(7)
    nll = 0.0
    for _ in range(3):
        w = mu + sigma * torch.randn(mu.shape, dtype=mu.dtype)
        nll += -float(dist.Normal(sc.x @ w, sc.noise).log_prob(sc.y).sum()) / 3
    kl = 0.5 * float((delta * (sigma**2 + mu**2) - 1 - torch.log(delta * sigma**2)).sum())
    # float64 throughout, the same terms in another order: 1e-12 relative.
    assert loss == pytest.approx(nll + tau * kl, rel=1e-12)


def test_a_finite_clip_radius_that_clips_nothing_gives_the_unclipped_update():
    # A finite radius takes the clipped path (quotient, clamp, then α) for μ and the hidden
    # parameters alike; where no entry reaches the radius it must be the plain update, debiasing
    # 1/(1 − β₁ᵗ) included. The two paths round differently (a division then a product, against
    # one addcdiv): a few float64 ulps, so 1e-13 relative.
    from pyro_bdl.infer import IVONHyperparameters, VOGNState, ivon_update

    g = torch.Generator().manual_seed(2)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    m, gm, h, theta, g_h, h_h = rand(5), rand(5), rand(5), rand(3), rand(3), rand(3) + 0.1
    g_hat, h_hat, g_hid = rand(5) - 0.5, rand(5) - 0.5, rand(3) - 0.5
    plain = IVONHyperparameters(
        lr=0.3, betas=(0.8, 0.6), weight_decay=rand(5) + 0.1, prior_mean=rand(5),
        hidden_weight_decay=0.05,
    )  # fmt: skip
    wide = dataclasses.replace(plain, clip_radius=1e6)

    def state():
        return VOGNState(m.clone(), gm.clone(), h.clone(), [theta.clone()], [g_h.clone()],
                         [h_h.clone()], step=2)  # fmt: skip

    a = ivon_update(state(), [g_hat, g_hid], h_hat, plain)
    b = ivon_update(state(), [g_hat, g_hid], h_hat, wide)
    # Step 3 debiases by 1/(1 − 0.8³) ≈ 1.95: leaving it out moves the hidden step by half.
    torch.testing.assert_close(b.mean, a.mean, rtol=1e-13, atol=0.0)
    torch.testing.assert_close(b.hidden[0], a.hidden[0], rtol=1e-13, atol=0.0)
    assert not torch.equal(a.hidden[0], theta)


def test_vogn_warns_below_two_examples_of_curvature_and_not_at_two():
    # s ← (1 − β₂)s + β₂ĥ holds about B/β₂ examples' squared gradients; the warning is for fewer
    # than two. B = 1: β₂ = 0.5 holds exactly two (no warning: an error under this suite's
    # filterwarnings), β₂ = 0.51 fewer.
    sc = BayesianLinearRegression(n=20)
    quiet = VOGN(sc.model(), dataset_size=sc.n, betas=(0.9, 0.5))
    quiet.step(sc.x[:1], sc.y[:1])
    pyro.clear_param_store()
    loud = VOGN(sc.model(), dataset_size=sc.n, betas=(0.9, 0.51))
    with pytest.warns(UserWarning, match=r"B/β₂ = 2 example\(s\)"):
        loud.step(sc.x[:1], sc.y[:1])


def test_a_skipped_step_returns_the_tempered_loss_the_step_would_have_returned():
    # A float16 overflow skips the step, which still returns its loss N/B Σℓᵢ + τ KL; the same
    # step without a scaler (the same draw, under the same autocast) takes it and returns the
    # same number. The network's logits favour class 0 by about 18: for y = 1 the per-example
    # gradients are about −1, which overflow float16 at S = 2¹⁶; for y = 0 they are about 1e-8
    # (the set-up pass stays finite).
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        net[2].bias.copy_(torch.tensor([9.0, -9.0]))
    n = 16
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), n)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    method = VOGN(model, dataset_size=n, lr=0.05, temperature=0.5, grad_scaler=scaler)
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.float16):
        method.setup(x, torch.zeros(n, dtype=torch.long))
    twin = copy.deepcopy(method)
    twin._scaling = None  # the same method without a scaler
    losses = []
    for fit in (method, twin):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.float16):
            losses.append(fit.step(x, torch.ones(n, dtype=torch.long)))
    assert method.skipped_steps == 1 and method.step_count == 0 and twin.step_count == 1
    assert math.isfinite(losses[0]) and losses[0] == losses[1]


class _TwoPrecisions(priors.Prior):
    """N(0, 1) on the first layer's 6 weights, N(0, 1/9) on the last layer's 4: the mean
    precision over the weights is (6·1 + 4·9)/10 = 4.2."""

    def element(self, module, name, param):
        scale = 1.0 if module.in_features == 3 else 1.0 / 3.0
        return dist.Normal(torch.zeros((), dtype=param.dtype), scale)


def test_a_hidden_parameter_is_damped_by_the_mean_prior_precision_over_the_weights():
    # A hidden (point-estimate) parameter has no prior of its own: IVON damps its step by the
    # mean weight decay δ̄ = mean(precision)/λ. Its first step, debiased, is
    # θ ← θ − α ĝ/(h₀ + δ̄) (the momentum (1 − β₁)ĝ over 1 − β₁).
    n, lr, h0 = 16, 0.1, 0.2
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(3, 2, bias=False), nn.BatchNorm1d(2), nn.Tanh(), nn.Linear(2, 2, bias=False)
    ).double()
    net = bayesianize(net, _TwoPrecisions())
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    pyro.clear_param_store()
    ivon = IVON(models.classifier(net, n), dataset_size=n, lr=lr, hess_init=h0)
    ivon.setup(x, y)
    before = [h.clone() for h in ivon.state.hidden]
    assert len(before) == 2  # BatchNorm's weight and bias
    ivon.step(x, y)
    decay = (6 * 1.0 + 4 * 9.0) / 10 / n
    for old, new, g_hat in zip(before, ivon.state.hidden, ivon.estimates[2:]):
        # float64, a handful of operations: 1e-12 relative.
        torch.testing.assert_close(new, old - lr * g_hat / (h0 + decay), rtol=1e-12, atol=1e-15)
        assert not torch.equal(new, old)


@pytest.mark.parametrize("cls", [VOGN, IVON])
def test_an_update_refused_after_its_new_sigma_puts_sigma_back(cls):
    # lr = 1e308 passes the hyperparameter checks, but the update overflows the mean: the
    # step is refused by the check of the candidate state, after σ was computed from the
    # candidate's (finite) curvature. σ and the KL's sums go back to the state's, bit for bit.
    model, x, y = small_classifier()
    fit = cls(model, dataset_size=len(x), lr=0.05)
    fit.step(x, y)
    scale, sums = fit.guide.scale.clone(), fit._var_sums
    fit.optimizer.param_groups[0]["lr"] = 1e308
    with pytest.raises(FloatingPointError, match="step 2: the update would make"):
        fit.step(x, y)
    assert fit.step_count == 1
    assert torch.equal(fit.guide.scale, scale) and fit._var_sums == sums
    fit.optimizer.param_groups[0]["lr"] = 0.05
    assert math.isfinite(fit.step(x, y)) and fit.step_count == 2


def test_vogn_skips_a_first_step_whose_hidden_curvature_alone_is_not_finite():
    # Under loss scaling the first curvature, averaged by reduce_fn across ranks, is checked
    # whole before any σ is drawn: a rank whose set-up overflowed only in a hidden parameter's
    # curvature (here a reduce_fn that poisons it) skips the first step on every rank, as an
    # overflow, rather than training on (and refusing the step at its state check).
    calls = []

    def reduce_fn(tensors):
        calls.append(len(tensors))
        if len(calls) == 1:  # the first reduction: [s of μ, s of each hidden parameter]
            tensors[1].fill_(math.inf)

    model, x, y = small_classifier()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    vogn = VOGN(model, dataset_size=len(x), lr=0.05, reduce_fn=reduce_fn, grad_scaler=scaler)
    loss = vogn.step(x, y)
    assert calls[0] == 3  # μ's curvature and BatchNorm's weight and bias
    assert math.isnan(loss) and vogn.skipped_steps == 1 and vogn.needs_setup
    assert scaler.get_scale() == 2.0**7
    assert math.isfinite(vogn.step(x, y)) and vogn.step_count == 1
