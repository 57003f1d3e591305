"""``pyro_bdl.infer.kl_transform``: transform comparison, the base KL of a shared bijection and
the pulled-back prior."""

from __future__ import annotations

import math

import pyro.distributions as dist
import pytest
import torch
from torch.distributions import (
    Independent,
    TransformedDistribution,
    biject_to,
    constraints,
    kl_divergence,
)
from torch.distributions.transforms import (
    AffineTransform,
    ComposeTransform,
    ExpTransform,
    IndependentTransform,
    SigmoidTransform,
)

from pyro_bdl.infer.kl_transform import (
    PulledBack,
    Reduced,
    reduce_transformed,
    same_transforms,
    transform_parts,
)
from tests.common import assert_close

F64 = torch.float64


def _t(x):
    return torch.tensor(x, dtype=F64)


def _same(a, b) -> bool:
    return same_transforms(transform_parts(a), transform_parts(b))


def test_transform_comparison():
    positive = biject_to(constraints.positive)  # exp followed by the identity x + 0
    assert _same(positive, ExpTransform())
    assert _same(IndependentTransform(positive, 1), ExpTransform())
    assert _same(
        ComposeTransform([ComposeTransform([ExpTransform()]), AffineTransform(0.0, 1.0)]),
        ExpTransform(),
    )
    interval = biject_to(constraints.interval(0.0, 2.0))
    assert _same(interval, ComposeTransform([SigmoidTransform(), AffineTransform(_t(0.0), 2.0)]))
    assert not _same(interval, biject_to(constraints.interval(0.0, 3.0)))
    assert not _same(ExpTransform(), SigmoidTransform())
    assert not _same(ExpTransform(), ComposeTransform([ExpTransform(), ExpTransform()]))
    # Affine maps whose parameters do not broadcast are different, not an error.
    assert not _same(AffineTransform(torch.ones(2), 2.0), AffineTransform(torch.ones(3), 2.0))
    # A learnable affine map is never dropped as the identity.
    learnable = AffineTransform(torch.zeros(1, requires_grad=True), 1.0)
    assert transform_parts(learnable) == [learnable]


def _guide_dist(loc, scale, support, event_dims=0):
    base = dist.Normal(loc, scale)
    if event_dims:
        base = base.to_event(event_dims)
    return TransformedDistribution(base, [biject_to(support)])


def _mc_kl(q, p, n=200_000):
    """(mean, standard error) of log q(z) − log p(z), summed over the site, over n draws of q."""
    z = q.sample((n,))
    d = (q.log_prob(z) - p.log_prob(z)).reshape(n, -1).sum(1)
    return float(d.mean()), float(d.std() / math.sqrt(n))


@pytest.mark.parametrize("event_dims", [0, 1])
def test_lognormal_prior_reduces_to_the_normal_base_kl(event_dims):
    loc, scale = _t([0.3, -0.5, 1.0]), _t([0.4, 0.2, 0.9])
    support = (
        constraints.independent(constraints.positive, 1) if event_dims else constraints.positive
    )
    q = _guide_dist(loc, scale, support, event_dims)
    p = dist.LogNormal(_t(0.1), _t(1.5)).expand([3])
    if event_dims:
        p = p.to_event(1)
    reduced = reduce_transformed(q, p)
    assert isinstance(reduced, Reduced) and not reduced.pulled
    assert reduced.q.event_shape == q.event_shape and reduced.p.event_shape == p.event_shape
    kl = kl_divergence(reduced.q, reduced.p)
    expected = kl_divergence(dist.Normal(loc, scale), dist.Normal(_t(0.1), _t(1.5)))
    assert_close(kl, expected.sum() if event_dims else expected, rtol=1e-12)
    # KL is invariant under the bijection: the Monte Carlo KL of the constrained pair agrees
    # within 5 standard errors (n = 2·10⁵ draws).
    mean, se = _mc_kl(q, p)
    assert abs(mean - float(expected.sum())) < 5 * se


def test_pulled_back_prior_of_a_transformed_prior_is_its_base():
    # Pulling LogNormal(m, s) back through exp gives Normal(m, s) exactly.
    u = torch.linspace(-4, 4, 17, dtype=F64)
    pulled = PulledBack(dist.LogNormal(_t(0.2), _t(0.7)), ExpTransform(), torch.Size([17]))
    assert_close(pulled.log_prob(u), dist.Normal(_t(0.2), _t(0.7)).log_prob(u), rtol=1e-12)


@pytest.mark.parametrize(
    "prior",
    [
        dist.Gamma(_t(2.0), _t(1.5)),
        dist.HalfCauchy(_t(1.0)),
        dist.Uniform(_t(-1.0), _t(3.0)),
        dist.Beta(_t(2.0), _t(0.7)),
    ],
    ids=lambda p: type(p).__name__,
)
def test_pulled_back_priors_are_normalised(prior):
    # The pull-back is a density on the real line: trapezoidal quadrature over [-60, 60] with
    # 2·10⁵ nodes (the tails beyond carry < 1e-6 for these priors) integrates to 1.
    transform = ComposeTransform(transform_parts(biject_to(prior.support)))
    pulled = PulledBack(prior, transform, torch.Size())
    u = torch.linspace(-60, 60, 200_001, dtype=F64)
    total = torch.trapezoid(pulled.log_prob(u).exp(), u)
    assert abs(float(total) - 1) < 1e-5


def test_other_priors_are_pulled_back_through_the_guides_transform():
    q = _guide_dist(_t([0.3, -0.5]), _t([0.4, 0.2]), constraints.positive)
    p = dist.Gamma(_t(2.0), _t(1.0)).expand([2])
    reduced = reduce_transformed(q, p)
    assert isinstance(reduced, Reduced) and reduced.pulled
    assert isinstance(reduced.p, PulledBack) and reduced.p.batch_shape == (2,)
    # The prior's parameters stay visible (the streaming estimator refuses learnable ones).
    assert set(reduced.p.arg_constraints) == {"concentration", "rate"}
    assert reduced.p.rate is p.rate


def test_unreducible_pairs_give_a_reason_and_plain_pairs_none():
    q = dist.Normal(_t(0.0), _t(1.0))
    assert reduce_transformed(q, dist.Normal(_t(0.0), _t(1.0))) is None
    simplex = TransformedDistribution(
        Independent(dist.Normal(torch.zeros(2, dtype=F64), 1.0), 1),
        [biject_to(constraints.simplex)],
    )
    reason = reduce_transformed(simplex, dist.Dirichlet(torch.ones(3, dtype=F64)))
    assert isinstance(reason, str) and "changes the site's shape" in reason
    positive_vector = _guide_dist(
        torch.zeros(2, dtype=F64), 1.0, constraints.independent(constraints.positive, 1), 1
    )
    mvn = dist.MultivariateNormal(torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64))
    reason = reduce_transformed(positive_vector, mvn)
    assert isinstance(reason, str) and "not element-wise" in reason and "register_kl" in reason
