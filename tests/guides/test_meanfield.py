"""AutoMeanField: the mean-field optimum on Bayesian linear regression, the exact KL, and the
guide's own behaviours (initialisation, errors, constrained and local latents, fast path)."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.optim import ClippedAdam

from pyro_bdl.guides import AutoMeanField
from tests.common import assert_close
from tests.guides.blr import batched_model
from tests.guides.test_contract import data, small_model, svi_fit
from tests.scenarios import BayesianLinearRegression

F64 = torch.float64


def test_converges_to_the_meanfield_optimum():
    s = BayesianLinearRegression()
    model = batched_model(s)
    guide = AutoMeanField(model, init_scale=0.1)
    steps, lr0, lr_end = 500, 0.05, 5e-4
    optim = ClippedAdam({"lr": lr0, "lrd": (lr_end / lr0) ** (1 / steps), "clip_norm": 1e6})
    # 64 vectorized particles; the KL part is exact (TraceMeanField_ELBO).
    elbo = TraceMeanField_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, guide, optim, elbo)
    for _ in range(steps):
        svi.step(s.x, s.y)
    loc, scale = guide.locs_and_scales()["weight"]
    # Tolerance 1e-2 (the bar). For this linear model the stochastic part of the
    # μ-gradient is Λ_lik σ ε̄ with ε̄ the mean of 64 particles' noise, i.e. a parameter-space
    # jitter of σ/√64 ≈ 0.07/8 ≈ 9e-3 per step; at the end of the schedule the iterate averages it
    # over its ≥ 50-step correlation window, an error sd ≈ 9e-3/√50 ≈ 1.3e-3, so 1e-2 is ≈ 7 sd
    # (seeds 0–3 measured ≤ 9e-4 for both mean and std).
    assert_close(loc[0], s.meanfield_mean, atol=1e-2, rtol=0)
    assert_close(scale[0], s.meanfield_std, atol=1e-2, rtol=0)


def _closed_form_kl(loc, scale, prior_scale):
    """docs/design/variational.md with m = 0: Σ log(s/σ) + (σ² + μ²)/(2s²) − ½."""
    s2 = prior_scale**2
    return (math.log(prior_scale) - scale.log() + (scale**2 + loc**2) / (2 * s2) - 0.5).sum()


def test_kl_part_of_the_loss_is_exact():
    s = BayesianLinearRegression()
    model = s.model()
    guide = AutoMeanField(model, init_scale=0.3)
    guide(s.x, s.y)
    with torch.no_grad():
        guide.loc.add_(0.5)
    elbo = TraceMeanField_ELBO()
    loc, scale = guide.locs_and_scales()["weight"]
    kl = _closed_form_kl(loc, scale, s.prior_scale)
    for seed in (0, 1, 2):
        pyro.set_rng_seed(seed)
        loss = elbo.differentiable_loss(model, guide, s.x, s.y)
        pyro.set_rng_seed(seed)  # the same draw of the weights as inside the ELBO
        trace = poutine.trace(guide).get_trace(s.x, s.y)
        w = trace.nodes["weight"]["value"]
        loglik = dist.Normal(s.x @ w[0], s.noise).log_prob(s.y).sum()
        # loss = −(log-likelihood of the draw) + KL, with KL free of Monte Carlo noise.
        assert_close(loss + loglik, kl, rtol=1e-10)
    # The Normal sits on the weight site itself: no auxiliary site, no Delta.
    site = trace.nodes["weight"]
    assert isinstance(site["fn"].base_dist, dist.Normal)
    assert [n for n, m in trace.nodes.items() if m["type"] == "sample"] == ["weight"]


def test_initialisation_from_the_network():
    model = small_model()
    guide = AutoMeanField(model, init_scale=0.03)
    x, y = data()
    guide(x, y)
    for name, (loc, scale) in guide.locs_and_scales().items():
        spec = model.net._bdl_sites[name]
        assert torch.equal(loc, spec.init_value)
        # 0.03 stored as ρ = softplus⁻¹(0.03) and read back as softplus(ρ) in float32: each step
        # rounds once, ~2 ulps (float32 ε = 1.2e-7) in all; rtol 1e-6 is ~8 ulps.
        assert_close(scale, torch.full_like(scale, 0.03), rtol=1e-6)
    assert guide.site_names == list(model.net._bdl_sites)
    # The default initial scale is 0.01 (the docstring's figures say why).
    pyro.clear_param_store()  # else the new guide takes up the scales kept there
    default = AutoMeanField(model)
    default(x, y)
    assert_close(default.scale, torch.full_like(default.scale, 0.01), rtol=1e-6)
    assert guide.num_latents() == sum(loc.numel() for loc, _ in guide.locs_and_scales().values())


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_init_scale_value(bad):
    with pytest.raises(ValueError, match="init_scale"):
        AutoMeanField(small_model(), init_scale=bad)
    assert len(pyro.get_param_store()) == 0


@pytest.mark.parametrize("bad", [True, "0.1", None])
def test_bad_init_scale_type(bad):
    with pytest.raises(TypeError, match="init_scale"):
        AutoMeanField(small_model(), init_scale=bad)


def test_errors_name_the_fix():
    guide = AutoMeanField(small_model())
    with pytest.raises(RuntimeError, match="call the guide once"):
        guide.get_posterior("0.weight")
    with pytest.raises(TypeError, match="init_loc_fn"):
        AutoMeanField(small_model(), init_loc_fn=3)
    x, y = data()
    guide(x, y)
    with pytest.raises(ValueError, match="unknown site 'nope'"):
        guide.get_posterior("nope")
    with pytest.raises(ValueError, match="quantiles"):
        guide.quantiles([0.0, 0.5])

    def empty(x, y):
        pyro.sample("y", dist.Normal(0.0, 1.0), obs=y[0].float())

    with pytest.raises(ValueError, match="no latent sites"):
        AutoMeanField(empty)(x, y)


def test_get_posterior_is_the_site_distribution():
    guide = AutoMeanField(small_model(), init_scale=0.2)
    x, y = data()
    guide(x, y)
    post = guide.get_posterior("0.weight")
    loc, scale = guide.locs_and_scales()["0.weight"]
    assert post.event_shape == loc.shape
    assert_close(post.mean, loc)
    # float32: the posterior squares the same scale tensor; a rounding or two (ε = 1.2e-7).
    assert_close(post.variance, scale**2, rtol=1e-6)


def test_hidden_parameters_are_trained_as_point_estimates():
    model = small_model()  # LayerNorm at "1" stays deterministic
    guide = AutoMeanField(model)
    x, y = data()
    before = model.net[1].weight.detach().clone()
    svi_fit(model, guide, steps=3, lr=0.1)(x, y)
    assert "1.weight" in pyro.get_param_store().keys()
    assert "1.weight" not in guide.site_names
    assert not torch.equal(model.net[1].weight.detach(), before)


def test_samples_have_the_posterior_moments_on_both_paths():
    s = BayesianLinearRegression()
    guide = AutoMeanField(s.model(), init_scale=0.3)
    guide(s.x, s.y)
    loc, scale = guide.locs_and_scales()["weight"]
    n = 4000
    fast = torch.stack([guide(s.x, s.y)["weight"].detach() for _ in range(n)])
    with pyro.plate("particles", n):  # an outer plate: per-site sampling
        batched = guide(s.x, s.y)["weight"].detach()
    assert batched.shape == (n, 1, 3)
    for w in (fast.reshape(n, 3), batched.reshape(n, 3)):
        # 4.5 standard errors of the sample mean (sd σ/√n) and variance (sd σ²√(2/n)).
        assert ((w.mean(0) - loc[0]).abs() < 4.5 * scale[0] / math.sqrt(n)).all()
        assert ((w.var(0) - scale[0] ** 2).abs() < 4.5 * scale[0] ** 2 * math.sqrt(2 / n)).all()


def test_constrained_site_and_local_latents_in_a_subsampled_plate():
    def model(y):
        sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=F64), 1.0))
        with pyro.plate("items", 10, subsample_size=4) as idx:
            z = pyro.sample("z", dist.Normal(torch.zeros(4, dtype=F64), 1.0))
            pyro.sample("y", dist.Normal(z, sigma), obs=y[idx])

    y = torch.arange(10, dtype=F64)
    guide = AutoMeanField(model, init_loc_fn=pyro.infer.autoguide.init_to_median)
    guide(y)
    assert guide.locs_and_scales()["z"][0].shape == (10,)  # kept at the full plate size
    with torch.no_grad():
        guide.loc.copy_(torch.arange(11, dtype=F64))  # sigma's loc is 0, z's locs are 1..10
    trace = poutine.trace(guide).get_trace(y)
    idx = trace.nodes["items"]["value"]
    assert_close(trace.nodes["z"]["fn"].loc, 1.0 + idx.to(F64))
    assert trace.nodes["sigma"]["value"] > 0
    median = guide.median(y)
    assert_close(median["sigma"], torch.tensor(1.0, dtype=F64))  # exp(0)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    assert math.isfinite(svi.step(y))


def test_trains_with_trace_elbo_too():
    model = small_model()
    guide = AutoMeanField(model)
    x, y = data()
    guide(x, y)
    before = guide.loc.detach().clone(), guide.rho.detach().clone()
    svi_fit(model, guide, steps=2, elbo=pyro.infer.Trace_ELBO())(x, y)
    assert torch.isfinite(guide.loc).all() and torch.isfinite(guide.rho).all()
    # Trace_ELBO's gradients reached both parameters (Adam moves every coordinate by ~lr).
    assert not torch.equal(guide.loc, before[0]) and not torch.equal(guide.rho, before[1])


def test_set_loc_scale_checks_before_changing_anything():
    guide = AutoMeanField(small_model())
    x, y = data()
    guide(x, y)
    guide.set_loc_scale("0.weight", loc=1.5, scale=torch.full((6, 5), 0.25))
    loc, scale = guide.locs_and_scales()["0.weight"]
    assert_close(loc, torch.full((6, 5), 1.5))
    # float32 softplus⁻¹ then softplus of 0.25: ~2 ulps of round-off, rtol 1e-6 ≈ 8 ulps.
    assert_close(scale, torch.full((6, 5), 0.25), rtol=1e-6)
    before = guide.loc.detach().clone()
    with pytest.raises(ValueError, match="broadcast"):
        guide.set_loc_scale("0.weight", loc=0.0, scale=torch.ones(7))
    with pytest.raises(ValueError, match="scale"):
        guide.set_loc_scale("0.weight", loc=0.0, scale=-1.0)
    assert torch.equal(guide.loc.detach(), before)


@pytest.mark.parametrize("prior_kind", ["scalar", "tensor", "learned"])
def test_site_kl_is_torchs_normal_kl(prior_kind):
    # The guide registers its own Normal-Normal KL (fewer kernels, prior terms kept on constant
    # priors); it must equal torch's closed form, and gradients must reach a learned prior.
    from torch.distributions import kl_divergence

    from pyro_bdl.guides.meanfield import _SiteNormal

    torch.manual_seed(0)
    loc, scale = torch.randn(3, 4, dtype=F64), torch.rand(3, 4, dtype=F64) + 0.1
    if prior_kind == "scalar":
        m, s = torch.tensor(0.3, dtype=F64).expand(3, 4), torch.tensor(2.0, dtype=F64).expand(3, 4)
    else:
        m, s = torch.randn(3, 4, dtype=F64), torch.rand(3, 4, dtype=F64) + 0.5
    if prior_kind == "learned":
        m.requires_grad_(), s.requires_grad_()
    prior = dist.Normal(m, s).to_event(2)
    expected = kl_divergence(dist.Normal(loc, scale).to_event(2), prior)
    for _ in range(2):  # the second call reads the terms kept on the prior
        got = kl_divergence(_SiteNormal(loc, scale).to_event(2), prior)
        assert_close(got, expected, rtol=1e-12)
    if prior_kind == "learned":
        g_got = torch.autograd.grad(got, [m, s])
        g_exp = torch.autograd.grad(expected, [m, s])
        for a, b in zip(g_got, g_exp):
            assert_close(a, b, rtol=1e-12)


def test_loc_and_rho_are_rows_of_one_parameter():
    # One parameter (one optimizer, one param-store entry); guide.loc / guide.rho are the
    # tensors the last call used, so gradients can be taken with respect to them.
    pyro.clear_param_store()
    model = small_model()
    guide = AutoMeanField(model)
    x, y = data()
    guide(x, y)
    assert [n for n, _ in guide.named_parameters()] == ["loc_rho"]
    assert [k for k in pyro.get_param_store().keys() if "loc" in k] == ["AutoMeanField.loc_rho"]
    loss = TraceMeanField_ELBO().differentiable_loss(model, guide, x, y)
    g_loc, g_rho = torch.autograd.grad(loss, [guide.loc, guide.rho], retain_graph=True)
    (g_packed,) = torch.autograd.grad(loss, [guide.loc_rho])
    assert torch.equal(g_packed, torch.stack([g_loc, g_rho]))
    with torch.no_grad():
        guide.loc.zero_()
    assert not guide.loc_rho[0].any()
    # After an in-place update of loc_rho (as an optimizer does) guide.loc still enters graphs.
    (guide.loc.sum() + guide.rho.sum()).backward()
    assert torch.equal(guide.loc_rho.grad, torch.ones_like(guide.loc_rho))


def test_site_kl_follows_a_prior_that_changes():
    # The prior's terms are kept on it only while its parameters are the same constant tensors:
    # a learned prior updated in place by its optimizer, or a prior given new tensors, must be
    # read afresh (stale terms would give the KL of the old prior, and a second backward pass
    # through a kept graph would fail).
    from torch.distributions import kl_divergence

    from pyro_bdl.guides.meanfield import _SiteNormal

    torch.manual_seed(0)
    loc, scale = torch.randn(3, 4, dtype=F64), torch.rand(3, 4, dtype=F64) + 0.1
    m = torch.randn(3, 4, dtype=F64, requires_grad=True)
    s = (torch.rand(3, 4, dtype=F64) + 0.5).requires_grad_()
    base = dist.Normal(m, s)
    for _ in range(2):
        got = kl_divergence(_SiteNormal(loc, scale).to_event(2), base.to_event(2))
        expected = kl_divergence(dist.Normal(loc, scale).to_event(2), dist.Normal(m, s).to_event(2))
        assert_close(got, expected, rtol=1e-12)
        got.backward()
        with torch.no_grad():  # an optimizer step on the learned prior
            m.sub_(0.1 * m.grad)
            s.add_(0.5)
    constant = dist.Normal(torch.zeros(3, 4, dtype=F64), torch.ones(3, 4, dtype=F64))
    kl_divergence(_SiteNormal(loc, scale).to_event(2), constant.to_event(2))
    constant.loc, constant.scale = (
        torch.full((3, 4), 0.5, dtype=F64),
        torch.full((3, 4), 3.0, dtype=F64),
    )
    got = kl_divergence(_SiteNormal(loc, scale).to_event(2), constant.to_event(2))
    expected = kl_divergence(
        dist.Normal(loc, scale).to_event(2), dist.Normal(constant.loc, constant.scale).to_event(2)
    )
    assert_close(got, expected, rtol=1e-12)


def test_a_draw_made_beforehand_serves_only_one_plain_rsample():
    # The carried draw answers the first rsample() of one value; a call asking for a sample
    # shape gets that many fresh draws, and later calls draw afresh too.
    from pyro_bdl.guides.meanfield import _SiteNormal

    loc, scale = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    value = torch.full((3,), 7.0, dtype=F64)
    site = _SiteNormal(loc, scale, value)
    many = site.rsample((5,))
    assert many.shape == (5, 3) and not (many == 7.0).any()
    site = _SiteNormal(loc, scale, value)
    assert site.rsample() is value
    assert not torch.equal(site.rsample(), value)
