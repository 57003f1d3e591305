"""The Laplace marginal likelihood and its optimisation by gradient: exact for a conjugate
Bayesian linear regression, and its optimum (λ, σ) where MacKay's fixed-point conditions hold."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoSubnetLaplace
from pyro_bdl.guides.laplace.evidence import SEARCH_RANGE, PriorPrecisionBoundWarning, tune_grid
from tests.common import assert_close

F64 = torch.float64
N, D, NOISE, LAM = 30, 4, 0.3, 0.7


def _blr(structure: str):
    """A linear regressor y = [x, 1] w + ε at its exact MAP (posterior mean) under N(0, 1/LAM)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=F64)
    y = x @ torch.randn(D, generator=g, dtype=F64) + 0.5 * torch.randn(N, generator=g, dtype=F64)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 1), nn.Flatten(0)).double()
    model = bdl.models.regressor(bdl.bayesianize(net, bdl.priors.Normal(1.0)), N, NOISE)
    guide = AutoSubnetLaplace(
        model, subnetwork="all", prior_precision=LAM, hessian_structure=structure
    )
    guide(x, y)
    xa = torch.cat([x, torch.ones(N, 1, dtype=F64)], 1)  # packed order: weight, then bias
    precision = xa.T @ xa / NOISE**2 + LAM * torch.eye(D + 1, dtype=F64)
    guide.loc.data = torch.linalg.solve(precision, xa.T @ y / NOISE**2)
    return guide.fit((x, y)), xa, y


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_evidence_is_exact_for_bayesian_linear_regression(structure):
    guide, xa, y = _blr(structure)
    cov = NOISE**2 * torch.eye(N, dtype=F64) + xa @ xa.T / LAM
    exact = torch.distributions.MultivariateNormal(torch.zeros(N, dtype=F64), cov).log_prob(y)
    assert_close(guide.marginal_likelihood(), float(exact), rtol=1e-10)


def _mackay(xa, y, theta):
    """The stationary point of the evidence at fixed θ* in (λ, σ²) by MacKay's fixed-point
    iteration: λ = γ/‖θ*‖², σ² = SSE/(N − γ), γ = Σ (e_k/σ²)/(e_k/σ² + λ)."""
    e = torch.linalg.eigvalsh(xa.T @ xa)
    sse = (y - xa @ theta).square().sum()
    lam, var = torch.tensor(1.0, dtype=F64), torch.tensor(1.0, dtype=F64)
    for _ in range(5000):
        gamma = (e / var / (e / var + lam)).sum()
        lam, var = gamma / theta.square().sum(), sse / (N - gamma)
    return float(lam), float(var.sqrt())


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_gradient_marglik_recovers_the_closed_form_optimum(structure):
    guide, xa, y = _blr(structure)
    lam_ref, sigma_ref = _mackay(xa, y, guide.map_loc)
    lam = guide.tune_prior_precision(tune_noise=True)
    # Deterministic: two float64 solvers of the same stationarity conditions (5000 fixed-point
    # sweeps against L-BFGS stopping at a gradient of 1e-12 in log λ, log σ), which agree to
    # ≤ 2e-9 relative here. rtol 1e-6 leaves the solvers 500× that (their paths depend on the
    # BLAS), while a wrong evidence term moves (λ, σ) by percents.
    assert_close(lam, lam_ref, rtol=1e-6)
    assert_close(guide.noise_scale, sigma_ref, rtol=1e-6)
    # The posterior and the predictive now use σ: the variance of a training input includes σ².
    _, var = guide.predict(xa[:3, :D])
    assert torch.all(var > sigma_ref**2)
    # The grid search agrees on λ within its refinement spacing (0.115 in log λ) at fixed σ.
    fixed, _, _ = _blr(structure)
    best = fixed.tune_prior_precision()
    grid = fixed.tune_prior_precision(search="grid", grid=torch.logspace(-4, 4, 17, dtype=F64))
    assert abs(math.log(grid) - math.log(best)) < 0.12


def test_layerwise_and_diagonal_marglik_are_at_least_the_scalar_optimum():
    guide, _, _ = _blr("diag")
    guide.tune_prior_precision()
    scalar = guide.marginal_likelihood()
    guide.tune_prior_precision(prior_structure="diagonal")
    # More freedom can only raise the maximum; the diagonal prior has one λ per weight.
    assert guide.marginal_likelihood() >= scalar - 1e-9
    assert guide.prior_precision.shape == (D + 1,)


def _fitted_at(theta: torch.Tensor, zero_feature: int | None = None):
    """The regressor of :func:`_blr` fitted at the weights ``theta`` (weight, then bias), with
    input feature ``zero_feature`` always 0 (its weight has no curvature) if given."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=F64)
    y = x @ torch.randn(D, generator=g, dtype=F64) + 0.5 * torch.randn(N, generator=g, dtype=F64)
    if zero_feature is not None:
        x[:, zero_feature] = 0.0
    net = nn.Sequential(nn.Linear(D, 1), nn.Flatten(0)).double()
    model = bdl.models.regressor(bdl.bayesianize(net, bdl.priors.Normal(1.0)), N, NOISE)
    guide = AutoSubnetLaplace(
        model, subnetwork="all", prior_precision=LAM, hessian_structure="diag"
    )
    guide(x, y)
    guide.loc.data = theta.clone()
    return guide.fit((x, y), check_mode=False)


def test_gradient_search_warns_where_lambda_runs_off_to_infinity():
    # At θ* = 0 the evidence -½λ‖θ*‖² + ½ S log λ - ½ Σ log(e_k + λ) rises in λ without end.
    guide = _fitted_at(torch.zeros(D + 1, dtype=F64))
    with pytest.warns(
        PriorPrecisionBoundWarning,
        match=r"prior_structure='scalar'\) ran 1 of 1 prior precisions past the upper end "
        r"of its range \[1e-08, 1e\+08\] \(to .*MAP limit.*weights at 0",
    ) as caught:
        lam = guide.tune_prior_precision()
    assert lam > SEARCH_RANGE[1]
    assert caught[0].filename == __file__  # points at the caller's line


def test_gradient_search_warns_where_a_weight_without_curvature_runs_lambda_to_zero():
    # Weight 0 sees an input that is always 0: its evidence -½λθ₀² + ½ log λ - ½ log λ falls
    # with λ for θ₀ ≠ 0, so its λ runs off to 0; the other weights keep an interior optimum.
    theta = torch.tensor([1.0, 0.5, -0.3, 0.2, 0.1], dtype=F64)
    guide = _fitted_at(theta, zero_feature=0)
    with pytest.warns(
        PriorPrecisionBoundWarning,
        match=r"prior_structure='diagonal'\) ran 1 of 5 prior precisions past the lower end"
        r".*zero curvature",
    ):
        lam = guide.tune_prior_precision(prior_structure="diagonal")
    assert lam[0] < SEARCH_RANGE[0] and (lam[1:] > SEARCH_RANGE[0]).all()
    assert (lam[1:] < SEARCH_RANGE[1]).all()


def test_grid_and_gradient_searches_warn_alike_at_a_bound():
    # One warning class for both searches: a user filters "λ at a bound" once.
    grid = torch.logspace(-2, 2, 5, dtype=F64)
    with pytest.warns(PriorPrecisionBoundWarning, match="edge of the grid.*MAP limit"):
        tune_grid(lambda v: v, grid)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_a_tuned_noise_rescales_the_posterior_and_the_predictive(structure):
    # After tune_noise the posterior is N(θ*, (XᵀX/σ² + λI)⁻¹) at the tuned σ and λ (the GGN was
    # computed at the model's σ₀ and is rescaled by σ₀²/σ²), and predict adds σ²: exact for a
    # linear model in float64, diagonal structure on the diagonal of that precision.
    guide, xa, _ = _blr(structure)
    lam = guide.tune_prior_precision(tune_noise=True)
    sigma = guide.noise_scale
    assert abs(sigma / NOISE - 1) > 0.2  # c = σ₀²/σ² ≈ 0.64 differs from 1 and from σ₀/σ
    gram = xa.T @ xa / sigma**2
    if structure == "diag":
        gram = torch.diag(gram.diagonal())
    cov = torch.linalg.inv(gram + lam * torch.eye(D + 1, dtype=F64))
    assert_close(guide.posterior.variances(), cov.diagonal(), rtol=1e-10)
    mean, var = guide.predict(xa[:5, :D])
    assert_close(mean, xa[:5] @ guide.map_loc, rtol=1e-10)
    assert_close(var, torch.einsum("bs,st,bt->b", xa[:5], cov, xa[:5]) + sigma**2, rtol=1e-10)
