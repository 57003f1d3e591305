"""The scores that tune a Laplace guide's λ and σ, against hand-written float64 formulas: the
Gaussian validation log-likelihood in the eigenbasis and under any posterior structure (with a
GGN scale c ≠ 1, as after tune_noise), and the parts of the marginal likelihood."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_bdl.guides.laplace.evidence import (
    evidence,
    fit_statistics,
    structure_val_ll_score,
    tune_grid,
    val_ll_score,
)
from pyro_bdl.guides.laplace.posterior import DiagPosterior, FullPosterior

F64 = torch.float64
NOISE = 0.4


def _gaussian_density(f, var, y):
    """Σ_n log N(y_n; f_n, var_n) written out."""
    return float((-0.5 * (2 * math.pi * var).log() - (y - f).square() / (2 * var)).sum())


def _regression_parts(seed=0, b=8, s=5):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(b, 1, generator=g, dtype=F64)
    jac = torch.randn(b, 1, s, generator=g, dtype=F64)
    y = out.squeeze(-1) + torch.randn(b, generator=g, dtype=F64)
    a = torch.randn(s, s, generator=g, dtype=F64)
    return out, jac, y, a @ a.T / s


@pytest.mark.parametrize("lam", [0.05, 1.0, 20.0])
def test_gaussian_val_ll_score_is_the_density_of_the_linearized_predictive(lam):
    out, jac, y, ggn = _regression_parts()
    ratio = 0.3
    evals, evecs = torch.linalg.eigh(ggn)
    score = val_ll_score([(out, jac, y)], "gaussian", NOISE, evals, evecs, ratio)
    cov = torch.linalg.inv(ggn + lam * ratio * torch.eye(ggn.shape[0], dtype=F64))
    j = jac.squeeze(1)
    var = torch.einsum("bs,st,bt->b", j, cov, j) + NOISE**2
    expected = _gaussian_density(out.squeeze(-1), var, y)
    assert float(score(torch.tensor(lam, dtype=F64))) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_structure_val_ll_score_uses_the_ggn_scale_and_the_prior_ratio(structure):
    out, jac, y, ggn = _regression_parts(seed=1)
    s, c, ratio, lam = ggn.shape[0], 0.45, 0.3, 2.0
    ones = torch.ones(s, dtype=F64)
    if structure == "full":
        post = FullPosterior(ggn, ones)
        precision = c * ggn + lam * ratio * torch.eye(s, dtype=F64)
    else:
        post = DiagPosterior(ggn.diagonal(), ones)
        precision = torch.diag(c * ggn.diagonal() + lam * ratio)
    score = structure_val_ll_score(post, [(out, jac, y)], "gaussian", NOISE, c, ratio)
    j = jac.squeeze(1)
    var = torch.einsum("bs,st,bt->b", j, torch.linalg.inv(precision), j) + NOISE**2
    expected = _gaussian_density(out.squeeze(-1), var, y)
    assert float(score(torch.tensor(lam, dtype=F64))) == pytest.approx(expected, rel=1e-10)


def test_gaussian_evidence_of_several_outputs_counts_every_output():
    # Two outputs per row: the fit term -m/2 log 2πσ² - SSE/2σ² counts m = 2N outputs, and the
    # GGN at the model's σ₀ is rescaled by c = σ₀²/σ² to the σ asked for.
    g = torch.Generator().manual_seed(2)
    n, s, sigma = 6, 4, torch.tensor(0.7, dtype=F64)
    out = torch.randn(n, 2, generator=g, dtype=F64)
    y = torch.randn(n, 2, generator=g, dtype=F64)
    stats = fit_statistics(out, y, "gaussian", NOISE)
    theta = torch.randn(s, generator=g, dtype=F64)
    a = torch.randn(s, s, generator=g, dtype=F64)
    ggn = a @ a.T
    lam = torch.tensor(0.9, dtype=F64)
    value = evidence(FullPosterior(ggn, lam.expand(s)), theta, lam, stats, "gaussian", NOISE, sigma)
    sse = (out - y).square().sum()
    c = NOISE**2 / sigma**2
    expected = (
        -0.5 * 2 * n * torch.log(2 * math.pi * sigma**2)
        - sse / (2 * sigma**2)
        - 0.5 * lam * theta.square().sum()
        + 0.5 * s * lam.log()
        - 0.5 * torch.logdet(c * ggn + lam * torch.eye(s, dtype=F64))
    )
    assert float(value) == pytest.approx(float(expected), rel=1e-12)
    # At the model's σ the fit term is the Gaussian log-likelihood of the outputs itself.
    ll = torch.distributions.Normal(out, NOISE).log_prob(y).sum()
    assert float(stats[3]) == pytest.approx(float(ll), rel=1e-12)


def test_grid_search_refines_between_the_neighbours_of_the_best_grid_value():
    # The optimum 0.2 lies 0.46 in log λ from its nearest grid value 10^-0.5 of the half-decade
    # grid; the refined grid spans the two neighbouring steps (2 × ln(10)/2 = 2.30) in 20 steps
    # of 0.115, so it finds the optimum to half a step, 0.058.
    grid = torch.logspace(-2, 2, 9, dtype=F64)
    score = lambda v: -((v.log() - math.log(0.2)) ** 2)  # noqa: E731
    assert abs(math.log(tune_grid(score, grid)) - math.log(0.2)) < 0.058
    assert tune_grid(score, grid, refine=False) == pytest.approx(10**-0.5, rel=1e-12)
