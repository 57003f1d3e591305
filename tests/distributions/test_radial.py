"""Radial distribution: exact density, entropy, moments and KL against brute force."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

from pyro_bdl.distributions import Radial
from pyro_bdl.distributions.radial import (
    radial_entropy_constant,
    radial_log_density,
    radial_marginal_icdf,
    radial_noise,
)
from tests.common import assert_close

F64 = torch.float64


def _random_params(shape, seed):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(shape, generator=g, dtype=F64)
    scale = 0.05 + torch.rand(shape, generator=g, dtype=F64)
    return loc, scale


def test_d1_equals_normal():
    loc, scale = _random_params((), 0)
    q, n = Radial(loc, scale), dist.Normal(loc, scale)
    x = torch.linspace(-3, 3, 11, dtype=F64)
    assert_close(q.log_prob(x), n.log_prob(x), rtol=1e-12, atol=1e-12)
    assert_close(q.entropy(), n.entropy(), rtol=1e-12)
    assert_close(radial_entropy_constant(1), 0.5 * math.log(2 * math.pi * math.e), rtol=1e-14)
    # A size-1 tensor site is also D = 1.
    q1 = Radial(loc.reshape(1), scale.reshape(1))
    assert_close(q1.log_prob(x[:, None]), n.log_prob(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [2, 3, 10, 1000])
def test_density_of_the_radius_is_half_normal(d):
    # Brute force in polar coordinates: integrating p over the sphere of radius ρ gives
    # A_{D−1} ρ^{D−1} p(ρu) = 2 φ(ρ) for every unit direction u.
    g = torch.Generator().manual_seed(d)
    u = torch.randn(5, d, generator=g, dtype=F64)
    u = u / u.norm(dim=-1, keepdim=True)
    rho = torch.tensor([0.1, 0.7, 1.0, 2.5, 4.0], dtype=F64)
    log_area = math.log(2) + 0.5 * d * math.log(math.pi) - math.lgamma(0.5 * d)
    lhs = radial_log_density(rho[:, None] * u, event_dim=1) + log_area + (d - 1) * rho.log()
    rhs = math.log(2) + dist.Normal(0.0, 1.0).log_prob(rho)
    assert_close(lhs, rhs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", [(10,), (20, 50)])
def test_entropy_and_second_moments_by_monte_carlo(shape):
    loc, scale = _random_params(shape, 1)
    q = Radial(loc, scale)
    n = 20_000 if len(shape) == 1 else 5_000
    w = q.rsample((n,))
    assert w.shape == (n, *shape)
    neg_lp = -q.log_prob(w)
    se = neg_lp.std() / math.sqrt(n)
    # 4 standard errors of the MC mean of −log q(w) over n draws.
    assert abs(neg_lp.mean() - q.entropy()) < 4 * se
    # Per-coordinate second moments E[(w−μ)²] = σ²/D. Each mean of n squares has standard error
    # sd/√n; with up to 1000 coordinates we allow 5 SE (false-alarm rate < 10⁻³ overall).
    z2 = ((w - loc) ** 2).reshape(n, -1)
    se2 = z2.std(0) / math.sqrt(n)
    assert ((z2.mean(0) - q.variance.reshape(-1)).abs() < 5 * se2).all()
    assert_close(q.mean, loc)


def test_noise_has_one_gaussian_radius_per_site():
    xi = radial_noise((4, 5), (3, 10_000), dtype=F64, generator=torch.Generator().manual_seed(0))
    assert xi.shape == (3, 10_000, 4, 5)
    r2 = xi.pow(2).sum((-1, -2))
    # ‖ξ‖² = r² ~ χ²₁: mean 1, sd √2; 4 standard errors over 3·10⁴ draws.
    assert abs(r2.mean() - 1) < 4 * math.sqrt(2 / r2.numel())
    # Reproducible with a generator, and a scalar site is plain N(0, 1) noise.
    again = radial_noise((4, 5), (3, 10_000), dtype=F64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(xi, again)
    assert radial_noise((), (7,)).shape == (7,)


@pytest.mark.parametrize("seed", range(4))
def test_kl_against_normal_matches_monte_carlo(seed):
    g = torch.Generator().manual_seed(100 + seed)
    shape = (int(torch.randint(1, 6, (), generator=g)), int(torch.randint(1, 8, (), generator=g)))
    loc, scale = _random_params(shape, seed)
    prior_loc = torch.randn((), generator=g, dtype=F64)
    prior_scale = 0.3 + torch.rand((), generator=g, dtype=F64)
    q = Radial(loc, scale)
    p = dist.Normal(prior_loc, prior_scale).expand(shape).to_event(2)
    n = 100_000
    w = q.rsample((n,))
    terms = q.log_prob(w) - p.log_prob(w)
    # 4 standard errors of the 10⁵-sample Monte Carlo estimate.
    assert abs(terms.mean() - kl_divergence(q, p)) < 4 * terms.std() / math.sqrt(n)


def test_kl_closed_form_matches_design_formula():
    loc, scale = _random_params((3, 4), 7)
    d = 12
    q = Radial(loc, scale)
    half, two = torch.tensor(0.5, dtype=F64), torch.tensor(2.0, dtype=F64)
    p = dist.Normal(half, two).expand([3, 4]).to_event(2)
    cross = (-0.5 * math.log(2 * math.pi * 4.0) - ((loc - 0.5) ** 2 + scale**2 / d) / 8).sum()
    assert_close(kl_divergence(q, p), -q.entropy() - cross, rtol=1e-12)
    # D = 1 against a bare Normal: the Normal–Normal KL.
    q1, n1 = Radial(loc[0, 0], scale[0, 0]), dist.Normal(half, two)
    assert_close(kl_divergence(q1, n1), kl_divergence(dist.Normal(loc[0, 0], scale[0, 0]), n1))


def test_kl_refuses_mismatched_event_dims():
    q = Radial(torch.zeros(3, 4), torch.ones(3, 4))
    with pytest.raises(NotImplementedError):
        kl_divergence(q, dist.Normal(0.0, 1.0).expand([3, 4]).to_event(1))
    with pytest.raises(NotImplementedError):
        kl_divergence(q, dist.Normal(torch.zeros(3, 4), 1.0))
    with pytest.raises(NotImplementedError):
        kl_divergence(q, dist.Laplace(0.0, 1.0).expand([3, 4]).to_event(2))


def test_shapes_expand_and_plates():
    q = Radial(torch.zeros(3, 4), torch.ones(3, 4))
    assert q.batch_shape == () and q.event_shape == (3, 4)
    qb = Radial(torch.zeros(2, 3, 4), torch.ones(3, 4), event_dim=2)
    assert qb.batch_shape == (2,) and qb.event_shape == (3, 4)
    assert qb.log_prob(qb.rsample((5,))).shape == (5, 2)
    e = q.expand((6,))
    assert e.batch_shape == (6,) and e.rsample().shape == (6, 3, 4)
    assert e.entropy().shape == (6,)
    with pyro.plate("particles", 7):
        w = pyro.sample("w", q)
    assert w.shape == (7, 3, 4)
    p = dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2).expand((6,))
    assert kl_divergence(e, p).shape == (6,)


def test_rsample_is_differentiable():
    # Reparameterised: w = μ + σ ⊙ ξ with ξ independent of (μ, σ), so ∂Σw/∂μ = 1 and
    # ∂Σw/∂σ = ξ = (w − μ)/σ, which is w itself at μ = 0, σ = 1.
    loc = torch.zeros(5, requires_grad=True)
    scale = torch.ones(5, requires_grad=True)
    w = Radial(loc, scale).rsample()
    w.sum().backward()
    assert torch.equal(loc.grad, torch.ones(5))
    assert torch.equal(scale.grad, w.detach())


def test_marginal_quantiles_match_empirical_cdf():
    q = torch.tensor([0.02, 0.25, 0.5, 0.8, 0.99], dtype=F64)
    for d in (1, 2, 10, 300):
        xi = radial_noise((d,), (40_000,), dtype=F64)[:, 0]
        t = radial_marginal_icdf(q, d)
        empirical = (xi[:, None] <= t).double().mean(0)
        # Empirical CDF at the true quantile: binomial sd √(q(1−q)/n); allow 4.5 sd.
        assert ((empirical - q).abs() < 4.5 * (q * (1 - q) / 40_000).sqrt()).all(), d
    assert_close(radial_marginal_icdf(q, 1), dist.Normal(0.0, 1.0).icdf(q), rtol=1e-12)


def test_bad_arguments():
    with pytest.raises(ValueError, match="event_dim"):
        Radial(torch.zeros(3), torch.ones(3), event_dim=2)
    with pytest.raises(TypeError, match="event_dim"):
        Radial(torch.zeros(3), torch.ones(3), event_dim=1.0)
    with pytest.raises(ValueError, match="dim"):
        radial_entropy_constant(0)
    with pytest.raises(TypeError, match="dim"):
        radial_entropy_constant(2.0)
    with pytest.raises(ValueError, match="event_dim"):
        radial_log_density(torch.zeros(3), event_dim=2)
    with pytest.raises(ValueError):
        Radial(torch.zeros(3), -torch.ones(3), validate_args=True)
