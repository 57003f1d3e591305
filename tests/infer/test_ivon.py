"""IVON (docs/design/ivon.md): the Hessian estimator's expectation, the update by hand, the
positivity of h + δ, state, reduce_fn, refusals and the guide."""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.infer import IVON, VOGN, IVONHyperparameters, VOGNState, ivon_update
from tests.common import assert_close
from tests.infer.test_vogn import PerWeightNormal
from tests.scenarios import BayesianLinearRegression


def batch_grad(sc: BayesianLinearRegression, w: torch.Tensor) -> torch.Tensor:
    """ĝ = (1/B) Σᵢ ∇_w ℓᵢ(w) = (1/B) Σᵢ xᵢ (xᵢᵀw − yᵢ)/σ², by hand."""
    return (sc.x * ((sc.x @ w - sc.y) / sc.noise**2)[:, None]).mean(0)


def small_classifier(n: int = 16, batchnorm: bool = True):
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(5))
    net = bayesianize(nn.Sequential(*layers).double(), priors.Normal(scale=1.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    return models.classifier(net, n), x, y


def test_the_hessian_estimate_is_unbiased_on_a_quadratic():
    # Linear regression: the batch-mean loss is the quadratic ½θᵀAθ − bᵀθ + c with
    # A = XᵀX/(Bσ²), so ĝ = Aθ − b and ĥᵢ = ĝᵢ εᵢ/σᵢ has expectation Aᵢᵢ exactly (Price/Bonnet).
    sc = BayesianLinearRegression(n=20, d=3)
    ivon = IVON(sc.model(), dataset_size=sc.n, hess_init=0.05, num_particles=1000)
    ivon.setup(sc.x, sc.y)
    torch.manual_seed(0)
    ivon._estimate_gradients((sc.x, sc.y), {}, step=1)
    _, (h_hat,) = ivon._split()
    a = sc.x.T @ sc.x / (sc.n * sc.noise**2)
    m, s = ivon.guide.loc, ivon.guide.scale
    # Var ĥᵢ = [((Am − b)ᵢ)² + Σ_{j≠i} Aᵢⱼ² σⱼ² + 2 Aᵢᵢ² σᵢ²]/σᵢ² per draw (ε Gaussian: the odd
    # moments vanish, Var εᵢεⱼ = 1, Var εᵢ² = 2); the mean of M = 1000 draws has standard error
    # √(Var/M), and 5 of them bound a false failure by 6e-7 per weight.
    r = batch_grad(sc, m)
    off = (a.square() * s.square()[None, :]).sum(1) - a.diagonal().square() * s.square()
    var = (r.square() + off + 2 * a.diagonal().square() * s.square()) / s.square()
    err = (h_hat - a.diagonal()).abs()
    assert bool((err < 5 * (var / 1000).sqrt()).all()), (h_hat, a.diagonal(), var)
    # The bound is tight enough to see a wrong estimator: here σ = 1/√2, so ĝε/σ² instead of
    # ĝε/σ would be off by 41%, and the bound is below 30% of Aᵢᵢ.
    assert bool((5 * (var / 1000).sqrt() < 0.3 * a.diagonal()).all())


@pytest.mark.parametrize(("prior", "draws"), [("explicit", 1), ("lifted", 1), ("lifted", 2)])
def test_two_steps_follow_the_design_by_hand(prior, draws):
    sc = BayesianLinearRegression(n=20, d=3)
    lr, (b1, b2), h0, ess = 0.2, (0.8, 0.7), 0.3, 30.0
    if prior == "explicit":
        model, options = sc.model(), {"prior_precision": 2.0}
        precision, mu0 = torch.tensor(2.0, dtype=sc.dtype), torch.zeros(3, dtype=sc.dtype)
    else:
        net = bayesianize(nn.Linear(3, 1, bias=False).to(sc.dtype), PerWeightNormal())
        model, options = sc.model(net), {}
        precision = torch.tensor(PerWeightNormal.precision, dtype=sc.dtype)
        mu0 = torch.tensor(PerWeightNormal.mean, dtype=sc.dtype)
    m = model.net._bdl_init_weight.reshape(-1).clone()
    ivon = IVON(
        model,
        dataset_size=sc.n,
        lr=lr,
        betas=(b1, b2),
        hess_init=h0,
        ess=ess,
        num_particles=draws,
        **options,
    )
    torch.manual_seed(5)
    losses = [ivon.step(sc.x, sc.y), ivon.step(sc.x, sc.y)]

    delta = precision / ess  # the weight decay: prior precision = ess · δ
    h = torch.full_like(m, h0)
    g = torch.zeros_like(m)
    torch.manual_seed(5)
    for t in (1, 2):
        sigma = (1 / (ess * (h + delta))).sqrt()
        g_hat, h_hat, nll = torch.zeros_like(m), torch.zeros_like(m), 0.0
        for _ in range(draws):  # ĝ, ĥ and the NLL averaged over the draws
            theta = m + sigma * torch.randn(m.shape, dtype=m.dtype)
            g_k = batch_grad(sc, theta)
            g_hat += g_k / draws
            h_hat += g_k * (theta - m) / sigma**2 / draws
            nll += -float(dist.Normal(sc.x @ theta, sc.noise).log_prob(sc.y).sum()) / draws
        kl = 0.5 * (precision * (sigma**2 + (m - mu0) ** 2) - 1 - torch.log(precision * sigma**2))
        assert losses[t - 1] == pytest.approx(nll + float(kl.sum()), rel=1e-10)
        g = b1 * g + (1 - b1) * g_hat
        h = b2 * h + (1 - b2) * h_hat + 0.5 * (1 - b2) ** 2 * (h - h_hat) ** 2 / (h + delta)
        m = m - lr * (g / (1 - b1**t) + delta * (m - mu0)) / (h + delta)
    assert_close(ivon.guide.loc, m, rtol=1e-12)
    assert_close(ivon.state.curvature, h, rtol=1e-12)
    assert_close(ivon.guide.scale, (1 / (ess * (h + delta))).sqrt(), rtol=1e-12)
    assert ivon.step_count == 2
    loc = ivon.guide.loc.clone()
    ivon.evaluate_loss(sc.x, sc.y)
    assert torch.equal(ivon.guide.loc, loc) and ivon.step_count == 2


def test_the_pure_update_with_a_per_weight_prior_and_a_hidden_parameter():
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    m, gm, h, theta, g_h, h_h = rand(3), rand(3), rand(3), rand(2), rand(2), rand(2) + 0.1
    g_hat, h_hat, g_hid = rand(3), rand(3) - 0.5, rand(2)
    delta, mu0 = rand(3) + 0.1, rand(3)
    hyper = IVONHyperparameters(
        lr=0.3, betas=(0.8, 0.6), weight_decay=delta, prior_mean=mu0, hidden_weight_decay=0.05
    )
    state = VOGNState(
        m.clone(), gm.clone(), h.clone(), [theta.clone()], [g_h.clone()], [h_h.clone()], step=2
    )
    new = ivon_update(state, [g_hat, g_hid], h_hat, hyper)
    assert new.step == 3 and new.mean is state.mean  # in place, as its docstring says
    gm = 0.8 * gm + 0.2 * g_hat
    h = 0.6 * h + 0.4 * h_hat + 0.5 * 0.4**2 * (h - h_hat) ** 2 / (h + delta)
    assert_close(new.curvature, h, rtol=1e-14)
    assert_close(new.mean, m - 0.3 * (gm / (1 - 0.8**3) + delta * (m - mu0)) / (h + delta))
    g_h = 0.8 * g_h + 0.2 * g_hid  # no prior term, and h stays h₀ (no noise, no ĥ)
    assert_close(new.hidden[0], theta - 0.3 * g_h / (1 - 0.8**3) / (h_h + 0.05), rtol=1e-14)
    assert_close(new.hidden_curvature[0], h_h, rtol=0.0)
    with pytest.raises(ValueError, match="ĝ for the mean and each of the 1 hidden"):
        ivon_update(new, [g_hat], h_hat, hyper)


def test_the_clipped_update_bounds_each_step_and_changes_nothing_else():
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    m, gm, h, theta, g_h, h_h = rand(6), rand(6), rand(6), rand(2), rand(2), rand(2) + 0.1
    g_hat, h_hat, g_hid = 10 * rand(6) - 5, rand(6) - 0.5, 10 * rand(2) - 5
    delta, mu0, r = rand(6) + 0.1, rand(6), 0.05
    plain = IVONHyperparameters(
        lr=0.3, betas=(0.8, 0.6), weight_decay=delta, prior_mean=mu0, hidden_weight_decay=0.05
    )
    clipped = dataclasses.replace(plain, clip_radius=r)

    def state():
        return VOGNState(m.clone(), gm.clone(), h.clone(), [theta.clone()], [g_h.clone()],
                         [h_h.clone()], step=2)  # fmt: skip

    a = ivon_update(state(), [g_hat, g_hid], h_hat, plain)
    b = ivon_update(state(), [g_hat, g_hid], h_hat, clipped)
    # The momentum and curvature do not see the clipping; the step is the unclipped one with
    # each entry clamped to [−r, r], then scaled by α (so every weight moves by ≤ α·r).
    for x, y in ((a.momentum, b.momentum), (a.curvature, b.curvature)):
        assert torch.equal(x, y)
    for new, old, clipped_new, hid in ((a.mean, m, b.mean, False), (a.hidden[0], theta,
                                       b.hidden[0], True)):  # fmt: skip
        step = (old - new) / 0.3
        assert bool((step.abs() > r).any()), "the case must clip some entries"
        assert_close(clipped_new, old - 0.3 * step.clamp(-r, r), rtol=1e-13, atol=1e-15)
        assert bool(((clipped_new - old).abs() <= 0.3 * r * (1 + 1e-12)).all()), hid
    with pytest.raises(ValueError, match="clip_radius must be > 0"):
        dataclasses.replace(plain, clip_radius=0.0)
    with pytest.raises(ValueError, match="clip_radius must be > 0"):
        dataclasses.replace(plain, clip_radius=float("nan"))


def test_an_infinite_clip_radius_is_the_unclipped_run_bit_for_bit():
    runs = []
    for keywords in ({}, {"clip_radius": float("inf")}, {"clip_radius": 1e-3}):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model, x, y = small_classifier()
        ivon = IVON(model, dataset_size=len(x), lr=0.1, **keywords)
        for _ in range(3):
            ivon.step(x, y)
        runs.append(ivon.guide.loc.detach().clone())
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("beta2", [0.0, 0.5, 0.99999])
def test_h_plus_delta_stays_positive_under_adversarial_estimates(beta2):
    # With a = h + δ and x = (h − ĥ)/a the new h + δ is a(½(1 − (1−β₂)x)² + ½) ≥ a/2: the least
    # value a/2 is reached at ĥ = h − a/(1−β₂), whatever the size of the other ĥ.
    delta, c = 0.01, 1.0 - beta2
    hyper = IVONHyperparameters(lr=0.1, betas=(0.9, beta2), weight_decay=delta)
    h = torch.tensor([0.1, 1e-3, 5.0], dtype=torch.float64)
    state = VOGNState(torch.zeros(3, dtype=h.dtype), torch.zeros_like(h), h.clone())
    a = h + delta
    worst = h - a / c
    ivon_update(state, [torch.zeros_like(h)], worst, hyper)
    assert_close(state.curvature + delta, a / 2, rtol=1e-12)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        sign = torch.randint(0, 2, (3,), generator=gen).to(h) * 2 - 1
        huge = sign * 10.0 ** torch.randint(-3, 12, (3,), generator=gen).to(h)
        before = state.curvature + delta
        ivon_update(state, [torch.zeros_like(h)], huge, hyper)
        after = state.curvature + delta
        # a/2 up to the rounding of the sum (relative 1e-16 per operation, a few operations).
        assert bool((after >= before / 2 * (1 - 1e-12)).all())
        assert bool(torch.isfinite(after).all())


def test_reduce_fn_gets_every_estimate_in_one_call_per_step():
    model, x, y = small_classifier()
    calls = []

    def reduce_fn(tensors):
        calls.append([tuple(t.shape) for t in tensors])
        tensors[1].fill_(-1e9)  # an adversarial ĥ reaches the update: σ must stay finite

    ivon = IVON(model, dataset_size=len(x), reduce_fn=reduce_fn)
    for _ in range(3):
        ivon.step(x, y)
    d = ivon.layout.size
    hidden = [tuple(h.param.shape) for h in ivon._hidden]
    assert hidden == [(5,), (5,)]  # BatchNorm's affine parameters
    assert calls == [[(d,), (d,), *hidden]] * 3
    assert bool(torch.isfinite(ivon.guide.scale).all()) and bool((ivon.guide.scale > 0).all())


def test_state_dict_round_trip_continues_the_run_bit_for_bit():
    model, x, y = small_classifier()
    ivon = IVON(model, dataset_size=len(x), lr=0.05, num_particles=2)
    for _ in range(3):
        ivon.step(x, y)
    buffer = io.BytesIO()
    torch.save(
        {"ivon": ivon.state_dict(), "net": model.net.state_dict()}, buffer
    )  # what a checkpoint holds
    net_state = copy.deepcopy(model.net.state_dict())
    torch.manual_seed(9)
    expected = [ivon.step(x, y) for _ in range(2)]
    loc = ivon.guide.loc.clone()

    pyro.clear_param_store()
    model2, _, _ = small_classifier()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model2.net.load_state_dict(net_state)
    resumed = IVON(model2, dataset_size=len(x), lr=0.05, num_particles=2)
    resumed.load_state_dict(saved["ivon"])  # before the first step: applied at set-up
    assert resumed.needs_setup
    torch.manual_seed(9)
    assert [resumed.step(x, y) for _ in range(2)] == expected
    assert torch.equal(resumed.guide.loc, loc) and resumed.step_count == 5


def test_state_dicts_of_other_methods_and_models_are_refused():
    model, x, y = small_classifier()
    ivon = IVON(model, dataset_size=len(x))
    with pytest.raises(RuntimeError, match="no state before its first step"):
        ivon.state_dict()
    ivon.step(x, y)
    vogn = VOGN(small_classifier()[0], dataset_size=len(x))
    vogn.step(x, y)
    with pytest.raises(ValueError, match="not a IVON state_dict"):
        ivon.load_state_dict(vogn.state_dict())
    with pytest.raises(ValueError, match="not a VOGN state_dict"):
        vogn.load_state_dict(ivon.state_dict())
    other, _, _ = small_classifier(batchnorm=False)
    state = IVON(other, dataset_size=len(x))
    state.step(x, y)
    before = ivon.state_dict()
    with pytest.raises(ValueError, match="different model"):
        ivon.load_state_dict(state.state_dict())
    damaged = dict(before, curvature=before["curvature"][:-1])
    with pytest.raises(ValueError, match="IVON state_dict is damaged: 'curvature'"):
        ivon.load_state_dict(damaged)
    assert torch.equal(ivon.state_dict()["mean"], before["mean"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": 0.0}, ValueError, "lr"),
        ({"lr": -0.1}, ValueError, "lr"),
        ({"betas": (1.0, 0.5)}, ValueError, "beta1"),
        ({"betas": (0.9, -0.1)}, ValueError, "beta2"),
        ({"betas": (0.9,)}, ValueError, "betas must be a pair"),
        ({"ess": 0.0}, ValueError, "ess"),
        ({"ess": -5.0}, ValueError, "ess"),
        ({"hess_init": 0.0}, ValueError, "hess_init"),
        ({"hess_init": float("nan")}, ValueError, "hess_init"),
        ({"prior_precision": -1.0}, ValueError, "prior_precision"),
        ({"num_particles": 0}, ValueError, "num_particles"),
        ({"reduce_fn": 3}, TypeError, "reduce_fn must be callable"),
        ({"dataset_size": 0}, ValueError, "dataset_size"),
        ({"clip_radius": 0.0}, ValueError, "clip_radius"),
        ({"clip_radius": -1e-3}, ValueError, "clip_radius"),
        ({"clip_radius": float("nan")}, ValueError, "clip_radius"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    model, x, _ = small_classifier()
    with pytest.raises(error, match=match):
        IVON(model, **{"dataset_size": len(x), **kwargs})


def test_a_wrong_dataset_size_is_refused_before_anything_changes():
    model, x, y = small_classifier()
    running = model.net[1].running_mean.clone()
    ivon = IVON(model, dataset_size=len(x) + 1)
    with pytest.raises(ValueError, match="dataset_size is 17 but the model's data plate"):
        ivon.step(x, y)
    assert ivon.needs_setup and ivon.state is None
    assert torch.equal(model.net[1].running_mean, running)


def test_refused_steps_change_nothing_and_the_run_continues():
    model, x, y = small_classifier()
    ivon = IVON(model, dataset_size=len(x), lr=0.05)
    ivon.step(x, y)
    reference = copy.deepcopy(ivon.state_dict())
    running = model.net[1].running_mean.clone()
    bad = x.clone()
    bad[3, 1] = float("nan")
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="IVON step 2"):
        ivon.step(bad, y)
    ivon.optimizer.param_groups[0]["lr"] = float("inf")  # a scheduler gone wrong
    with pytest.raises(ValueError, match=r"IVON step 2: ivon.optimizer.param_groups\[0\]\['lr'\]"):
        ivon.step(x, y)
    ivon.optimizer.param_groups[0]["lr"] = 0.05
    after = ivon.state_dict()
    for key in ("mean", "momentum", "curvature"):
        assert torch.equal(after[key], reference[key])
    assert after["step"] == 1 and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.net[1].running_mean, running)
    assert math.isfinite(ivon.step(x, y)) and ivon.step_count == 2


def test_the_guide_serves_predictive():
    model, x, y = small_classifier(batchnorm=False)
    ivon = IVON(model, dataset_size=len(x))
    for _ in range(5):
        ivon.step(x, y)
    site = ivon.layout.names[0]
    draws = Predictive(model, guide=ivon.guide, num_samples=7, return_sites=[site])(x)
    shape = ivon.layout[site].shape
    assert draws[site].shape[0] == 7 and draws[site].shape[-len(shape) :] == shape
    assert not torch.equal(draws[site][0], draws[site][1])  # sampled from q, not its mean
    # σ² = 1/(ess (h + δ)): the guide's scale is IVON's, read in place.
    delta = 1.0 / len(x)  # the lifted N(0, 1) prior: precision 1 = ess · δ
    expected = (1 / (len(x) * (ivon.state.curvature + delta))).sqrt()
    assert_close(ivon.guide.scale, expected, rtol=1e-12)


def test_a_scheduler_drives_the_learning_rate():
    model, x, y = small_classifier(batchnorm=False)
    ivon = IVON(model, dataset_size=len(x), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(ivon.optimizer, lambda step: 0.0 if step else 1.0)
    ivon.step(x, y)
    sched.step()  # the rate is 0 from now on: m stays, g and h still move
    assert ivon.lr == 0.0
    loc, h = ivon.guide.loc.clone(), ivon.state.curvature.clone()
    ivon.step(x, y)
    assert torch.equal(ivon.guide.loc, loc) and not torch.equal(ivon.state.curvature, h)
    # A run whose schedule ended at 0 is saved and resumed like any other (the step accepts
    # lr = 0, so its state_dict must too).
    state = ivon.state_dict()
    model2, _, _ = small_classifier(batchnorm=False)
    resumed = IVON(model2, dataset_size=len(x), lr=0.1)
    resumed.setup(x, y)
    resumed.load_state_dict(state)
    assert resumed.lr == 0.0 and torch.equal(resumed.guide.loc, ivon.guide.loc)


def test_ivon_messages_name_ivon_not_vogn():
    model, x, y = small_classifier()
    ivon = IVON(model, dataset_size=16)
    with pytest.raises(RuntimeError, match=r"set up by IVON: call ivon\.step") as info:
        Predictive(model, guide=ivon.guide, num_samples=2)(x)

    def with_latent(x, y):
        pyro.sample("z", dist.Normal(0.0, 1.0))
        return model(x, y)

    with pytest.raises(ValueError, match="IVON infers only network weights") as refused:
        IVON(with_latent, dataset_size=16).step(x, y)
    for message in (str(info.value), str(refused.value)):
        assert "VOGN" not in message


def _autocast_run(cls, bf16: bool, steps: int = 3):
    """μ after each of ``steps`` steps (μ₀ first), the losses, and the method, on a float32
    classifier, under bf16 autocast or not; the same seed, so the same weight noise."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), 32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, generator=g)
    y = (x[:, 0] > 0).long()
    method = cls(model, dataset_size=32, lr=0.05 if cls is VOGN else 0.1)
    method.setup(x, y)
    means, losses = [method.state.mean.clone()], []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            losses.append(method.step(x, y))
        means.append(method.state.mean.clone())
    return means, losses, method


@pytest.mark.parametrize("cls", [VOGN, IVON])
def test_training_under_bf16_autocast_keeps_float32_state_and_follows_float32(cls):
    means32, losses32, _ = _autocast_run(cls, bf16=False)
    means16, losses16, method = _autocast_run(cls, bf16=True)
    state = method.state
    tensors = [state.mean, state.momentum, state.curvature, *method.estimates]
    tensors += [method.guide.loc, method.guide.scale]
    assert all(t.dtype == torch.float32 for t in tensors), [t.dtype for t in tensors]
    # bf16 keeps 8 significant bits: unit roundoff u = 2⁻⁸. Each of the two layers rounds its
    # input and its output (≈ 3u relative on its output and on the gradient back through it),
    # so ĝ and ĥ carry ≈ 6u of relative error, and a step α·m/(s + δ̃) (IVON alike) ≈ 12u. Summed
    # over the steps, |μ_bf16 − μ_f32| ≤ 12u · Σₜ‖Δμₜ‖, with a factor 2 for the errors the
    # earlier steps feed into the later ones' gradients (measured: a twentieth of the bound).
    u = 2.0**-8
    path = sum(float((b - a).norm()) for a, b in itertools.pairwise(means32))
    assert float((means16[-1] - means32[-1]).norm()) <= 2 * 12 * u * path
    # The loss N/B Σℓᵢ + KL: each ℓᵢ within ≈ 6u relative, the KL exact (float32 state).
    for lo, hi in zip(losses16, losses32):
        assert abs(lo - hi) <= 6 * u * abs(hi) * 2


@pytest.mark.parametrize("case", ["fast", "overflowing-product", "zero-scale"])
def test_the_fused_scale_and_kl_sums_equal_the_plain_passes(case):
    from pyro_bdl.infer.natural_gradient.driver import NaturalGradientVI
    from pyro_bdl.infer.natural_gradient.ivon import BLOCK

    model, x, y = small_classifier()
    model.net.float()
    ivon = IVON(model, dataset_size=len(x), lr=0.1)
    ivon.step(x.float(), y)
    # Several blocks and a tail that is not a multiple of 16.
    n = 2 * BLOCK + 37
    h = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 10
    if case == "overflowing-product":
        h[3:20] = 1e30  # λ(h + δ) > 2⁶⁴: a product of 16 overflows float64
    if case == "zero-scale":
        h[7] = float("inf")  # σ = 0: Σ log σ² is -inf and the step must be refused
    fused_scale, plain_scale = torch.empty(n), torch.empty(n)
    fused = ivon._scale_and_sums(h, 1.0, fused_scale, torch.empty(n))
    plain = NaturalGradientVI._scale_and_sums(ivon, h, 1.0, plain_scale, torch.empty(n))
    assert torch.equal(fused_scale, plain_scale)  # σ itself: the same operations
    if case == "zero-scale":
        assert fused[1] == plain[1] == -math.inf
        return
    # The plain passes sum 2.6e5 float32 terms in float32: pairwise summation errs by about
    # log2(n)·2⁻²⁴ ≈ 1e-6 relative; the fused sums are taken in float64. 1e-5 is 10 times that.
    assert fused == pytest.approx(plain, rel=1e-5)
    # Σ log σ² = −Σ log λ(h + δ) in float64 (products of 16 values, their logs, or the exact sum
    # of logs where a product overflows), the tail of fewer than 16 weights included, against
    # the float64 sum over every weight: ≈ 1e-15 relative per term, 1e-12 leaves room. Logs
    # summed in float32 (≈ 1e-6) or a tail left out (5 terms of 2.6e5) are far outside it.
    x64 = (h + ivon.prior.tilde(1.0, ivon.effective_size)).mul(ivon.effective_size).double()
    assert fused[1] == pytest.approx(-float(torch.log(x64).sum()), rel=1e-12)


def test_one_block_off_the_cpu_computes_what_the_blocks_compute(monkeypatch):
    from pyro_bdl.infer.natural_gradient import ivon as module

    n = 2 * module.BLOCK + 37
    assert module.blocks(n, torch.device("cuda")) == [slice(0, n)]
    assert len(module.blocks(n, torch.device("cpu"))) == 3 == len(module.blocks(n))

    def run():
        g = torch.Generator().manual_seed(0)
        state = VOGNState(*(torch.rand(n, generator=g) for _ in range(3)))
        g_hat, h_hat = torch.randn(n, generator=g), torch.randn(n, generator=g)
        hyper = IVONHyperparameters(lr=0.1, betas=(0.9, 0.95), weight_decay=1e-3)
        new = ivon_update(state, [g_hat], h_hat, hyper)
        model, x, _ = small_classifier()
        ivon = IVON(model, dataset_size=len(x), lr=0.1)
        ivon.step(x, _)
        sums = ivon._scale_and_sums(new.curvature.abs(), 1.0, torch.empty(n), torch.empty(n))
        return new, sums

    blocked = run()
    monkeypatch.setattr(module, "BLOCK", 4 * n)  # the CPU takes one block too
    whole = run()
    # Element-wise passes: the same operations per element, so equal bit for bit.
    for a, b in zip((blocked[0].mean, blocked[0].momentum, blocked[0].curvature),
                    (whole[0].mean, whole[0].momentum, whole[0].curvature)):  # fmt: skip
        assert torch.equal(a, b)
    # Σσ² is a float32 dot per block (pairwise, ≈ log2(n)·2⁻²⁴ ≈ 1e-6 relative, grouped
    # otherwise in one block) and Σ log x float64 products: 1e-5 is ten times the first.
    assert whole[1] == pytest.approx(blocked[1], rel=1e-5)
