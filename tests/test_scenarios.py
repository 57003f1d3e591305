"""The exact answers in scenarios.py against independent computations."""

import math

import torch

from tests.common import assert_close
from tests.scenarios import BayesianLinearRegression, NormalNormal


def _grid_posterior(log_joint, lo, hi, n):
    """Moments and log normaliser of an unnormalised 2-D density by the trapezoid rule."""
    a = torch.linspace(lo[0], hi[0], n, dtype=torch.float64)
    b = torch.linspace(lo[1], hi[1], n, dtype=torch.float64)
    wa, wb = torch.meshgrid(a, b, indexing="ij")
    w = torch.stack([wa, wb], -1).reshape(-1, 2)
    lj = log_joint(w).reshape(n, n)
    shift = lj.max()
    dens = (lj - shift).exp()

    def integrate(f):
        return torch.trapezoid(torch.trapezoid(f, b, dim=1), a, dim=0)

    z = integrate(dens)
    mean = torch.stack([integrate(dens * wa), integrate(dens * wb)]) / z
    da, db = wa - mean[0], wb - mean[1]
    cov = (
        torch.stack(
            [
                torch.stack([integrate(dens * da * da), integrate(dens * da * db)]),
                torch.stack([integrate(dens * db * da), integrate(dens * db * db)]),
            ]
        )
        / z
    )
    return mean, cov, float(z.log() + shift)


def test_linear_regression_exact_answers_match_grid_integration():
    s = BayesianLinearRegression(n=8, d=2, noise=0.7, prior_scale=1.3)

    def log_joint(w):
        prior = torch.distributions.Normal(0.0, s.prior_scale).log_prob(w).sum(-1)
        lik = torch.distributions.Normal(w @ s.x.T, s.noise).log_prob(s.y).sum(-1)
        return prior + lik

    m, sd = s.mean, s.covariance.diagonal().sqrt()
    lo, hi = (m - 9 * sd).tolist(), (m + 9 * sd).tolist()
    mean, cov, log_z = _grid_posterior(log_joint, lo, hi, 801)
    # The trapezoid rule on an 801-point grid over ±9 sd has error far below 1e-6 here.
    assert_close(mean, s.mean, rtol=1e-6, atol=1e-8)
    assert_close(cov, s.covariance, rtol=1e-5, atol=1e-9)
    assert math.isclose(log_z, s.log_evidence, rel_tol=1e-7)


def test_meanfield_optimum_is_diagonal_of_precision():
    s = BayesianLinearRegression()
    assert_close(s.meanfield_std, 1 / s.precision.diagonal().sqrt())
    assert_close(s.meanfield_mean, s.mean)
    # The mean-field variances never exceed the exact marginal variances.
    assert (s.meanfield_std**2 <= s.covariance.diagonal() + 1e-15).all()


def test_linear_regression_model_log_joint_matches_hand_computation():
    import pyro
    from pyro import poutine

    s = BayesianLinearRegression(n=10, d=3)
    model = s.model()
    w = torch.randn(1, 3, dtype=torch.float64)
    tr = poutine.trace(poutine.condition(model, {"weight": w})).get_trace(s.x, s.y)
    expected = torch.distributions.Normal(0.0, s.prior_scale).log_prob(w).sum()
    expected = expected + torch.distributions.Normal(s.x @ w[0], s.noise).log_prob(s.y).sum()
    assert_close(tr.log_prob_sum(), expected, rtol=1e-12)
    assert pyro.get_param_store().keys() == set()


def test_normal_normal_exact_answers_match_quadrature():
    s = NormalNormal(n=5)
    mu = torch.linspace(-10, 10, 200_001, dtype=torch.float64)
    prior = torch.distributions.Normal(s.prior_loc, s.prior_scale).log_prob(mu)
    lik = torch.distributions.Normal(mu[:, None], s.noise).log_prob(s.y).sum(-1)
    lj = prior + lik
    z = torch.trapezoid((lj - lj.max()).exp(), mu)
    mean = torch.trapezoid((lj - lj.max()).exp() * mu, mu) / z
    var = torch.trapezoid((lj - lj.max()).exp() * (mu - mean) ** 2, mu) / z
    assert math.isclose(float(mean), s.posterior_loc, rel_tol=1e-9)
    assert math.isclose(float(var.sqrt()), s.posterior_scale, rel_tol=1e-8)
    assert math.isclose(float(z.log() + lj.max()), s.log_evidence, rel_tol=1e-9)
