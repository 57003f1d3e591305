"""AutoRadial: the exact KL in TraceMeanField_ELBO, one radius per site per draw, quantiles."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO

from pyro_bdl.distributions import Radial
from pyro_bdl.distributions.radial import radial_entropy_constant, radial_marginal_icdf
from pyro_bdl.guides import AutoRadial
from tests.common import assert_close
from tests.guides.test_contract import data, small_model
from tests.scenarios import BayesianLinearRegression


def test_kl_part_of_the_loss_is_exact():
    s = BayesianLinearRegression()
    model = s.model()
    guide = AutoRadial(model, init_scale=0.3)
    guide(s.x, s.y)
    with torch.no_grad():
        guide.loc.add_(0.5)
    loc, scale = guide.locs_and_scales()["weight"]
    d = loc.numel()
    # docs/design/variational.md by hand: KL = −H[q] − E_q[log N(w; 0, s²)], E[(w−μ)²] = σ²/D.
    entropy = scale.log().sum() + radial_entropy_constant(d)
    s2 = s.prior_scale**2
    cross = (-0.5 * math.log(2 * math.pi * s2) - (loc**2 + scale**2 / d) / (2 * s2)).sum()
    kl = -entropy - cross
    elbo = TraceMeanField_ELBO()
    for seed in (0, 1, 2):
        pyro.set_rng_seed(seed)
        loss = elbo.differentiable_loss(model, guide, s.x, s.y)
        pyro.set_rng_seed(seed)
        trace = poutine.trace(guide).get_trace(s.x, s.y)
        w = trace.nodes["weight"]["value"]
        loglik = dist.Normal(s.x @ w[0], s.noise).log_prob(s.y).sum()
        assert_close(loss + loglik, kl, rtol=1e-10)
    assert isinstance(trace.nodes["weight"]["fn"], Radial)


def test_one_gaussian_radius_per_site_per_draw():
    model = small_model()
    guide = AutoRadial(model, init_scale=0.5)
    x, y = data()
    guide(x, y)
    params = guide.locs_and_scales()
    n = 3000
    draws = [guide(x, y) for _ in range(n)]
    radii2 = {}
    for name, (loc, scale) in params.items():
        xi = torch.stack([d[name].detach() for d in draws]).sub(loc).div(scale)
        r2 = xi.reshape(n, -1).pow(2).sum(-1)
        # ‖ξ‖² = r² ~ χ²₁ (mean 1, sd √2) for every site: 4.5 standard errors over n draws.
        assert abs(r2.mean() - 1) < 4.5 * math.sqrt(2 / n), name
        radii2[name] = r2
    # Sites draw independent radii: the correlation of r² between two sites is 0 ± 1/√n.
    a, b = radii2["0.weight"], radii2["3.weight"]
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert abs(corr) < 4.5 / math.sqrt(n)


def test_outer_plate_draws_one_direction_per_particle():
    s = BayesianLinearRegression()
    guide = AutoRadial(s.model(), init_scale=0.2)
    guide(s.x, s.y)
    loc, scale = guide.locs_and_scales()["weight"]
    n = 4000
    with pyro.plate("particles", n):
        w = guide(s.x, s.y)["weight"].detach()
    assert w.shape == (n, 1, 3)
    r2 = ((w - loc) / scale).pow(2).sum((-1, -2))
    assert abs(r2.mean() - 1) < 4.5 * math.sqrt(2 / n)


def test_defaults_and_quantiles():
    model = small_model()
    guide = AutoRadial(model)
    x, y = data()
    guide(x, y)
    loc, scale = guide.locs_and_scales()["0.weight"]
    # The paper's initial ρ = −4.
    assert_close(scale, torch.full_like(scale, math.log1p(math.exp(-4))), rtol=1e-6)
    q = guide.quantiles([0.1, 0.9])["0.weight"]
    expected = loc + scale * radial_marginal_icdf(torch.tensor([0.1, 0.9])[:, None, None], 30)
    assert_close(q, expected, rtol=1e-6)


@pytest.mark.parametrize("prior_kind", ["scalar", "tensor", "learned"])
def test_site_kl_is_the_library_radial_kl(prior_kind):
    # The guide's Radial registers a KL that keeps the prior's terms; it must equal the library's
    # kl_divergence(Radial, Independent(Normal)) and pass gradients to a learned prior.
    from torch.distributions import kl_divergence

    from pyro_bdl.guides.radial import _SiteRadial

    torch.manual_seed(0)
    f64 = torch.float64
    loc, scale = torch.randn(3, 4, dtype=f64), torch.rand(3, 4, dtype=f64) + 0.1
    if prior_kind == "scalar":
        m, s = torch.tensor(0.3, dtype=f64).expand(3, 4), torch.tensor(2.0, dtype=f64).expand(3, 4)
    else:
        m, s = torch.randn(3, 4, dtype=f64), torch.rand(3, 4, dtype=f64) + 0.5
    if prior_kind == "learned":
        m.requires_grad_(), s.requires_grad_()
    # One Normal for both event dims: the terms kept on it depend on the site's size D (12,
    # then 4), so the second pairing must not read the first one's.
    base = dist.Normal(m, s)
    for event_dim in (2, 1):
        prior = base.to_event(event_dim)
        expected = kl_divergence(Radial(loc, scale, event_dim=event_dim), prior)
        for _ in range(2):  # the second call reads the terms kept on the prior
            got = kl_divergence(_SiteRadial(loc, scale, event_dim=event_dim), prior)
            assert_close(got, expected, rtol=1e-12)
        if prior_kind == "learned":
            for a, b in zip(
                torch.autograd.grad(got.sum(), [m, s]), torch.autograd.grad(expected.sum(), [m, s])
            ):
                assert_close(a, b, rtol=1e-12)


def test_quantiles_of_a_site_in_a_plate_use_the_size_of_one_draw():
    # Inside a plate of 4 a (4, 3) site is 4 Radial draws of D = 3 weights each (one direction
    # per plate element), so its marginals are those of 3-dimensional Radial noise, not 12.
    def model():
        with pyro.plate("rows", 4):
            pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    guide = AutoRadial(model, init_scale=0.3)
    guide()
    loc, scale = guide.locs_and_scales()["z"]
    q = guide.quantiles([0.1, 0.9])["z"]
    expected = loc + scale * radial_marginal_icdf(torch.tensor([0.1, 0.9])[:, None, None], 3)
    assert q.shape == (2, 4, 3)
    assert_close(q, expected, rtol=1e-6)


def test_site_kl_reads_a_changed_prior_afresh():
    # As for the mean-field KL: terms kept on a prior must follow an in-place optimizer step on
    # a learned prior (and a second backward pass must not run through a kept graph), and new
    # tensors given to a constant prior.
    from torch.distributions import kl_divergence

    from pyro_bdl.guides.radial import _SiteRadial

    torch.manual_seed(1)
    f64 = torch.float64
    loc, scale = torch.randn(2, 5, dtype=f64), torch.rand(2, 5, dtype=f64) + 0.1
    m = torch.zeros(2, 5, dtype=f64, requires_grad=True)
    s = torch.ones(2, 5, dtype=f64, requires_grad=True)
    learned = dist.Normal(m, s)
    fixed = dist.Normal(torch.zeros(2, 5, dtype=f64), torch.ones(2, 5, dtype=f64))

    def check(prior):
        got = kl_divergence(_SiteRadial(loc, scale, event_dim=2), prior.to_event(2))
        exact = dist.Normal(prior.loc.detach().clone(), prior.scale.detach().clone()).to_event(2)
        assert_close(got, kl_divergence(Radial(loc, scale), exact), rtol=1e-12)
        return got

    for _ in range(2):
        check(learned).backward()
        with torch.no_grad():  # an optimizer step on the learned prior
            m.sub_(0.5 * m.grad)
            s.add_(0.5)
        check(fixed)
        fixed.loc, fixed.scale = fixed.loc + 0.5, fixed.scale * 3.0
