"""Every posterior structure's algebra against the dense Gaussian it stands for, in float64: the
precision H = c·GGN + diag λ with a GGN scale c ≠ 1 (a tuned σ) and a prior that varies between
layers, its log-determinant, marginal variances, draws L z, rows J L and quadratic form."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pyro_bdl.curvature.kfac import KronLayer
from pyro_bdl.guides.laplace.posterior import (
    DiagPosterior,
    FullPosterior,
    KronBlock,
    KronPosterior,
    StructuredNormal,
)
from tests.common import assert_close

F64 = torch.float64
C = 0.37  # a GGN scale σ₀²/σ² ≠ 1, as after tune_noise


def _spd(n: int, generator: torch.Generator) -> torch.Tensor:
    m = torch.randn(n, n + 2, generator=generator, dtype=F64)
    return m @ m.T / n


def _kron_case(order: str):
    """A KronPosterior of two layers ([W, b] of 2 × 4 and 3 × 3) with sums A, N·G over N = 5
    rows and its dense precision c·(G ⊗ A) + diag λ, λ one value per layer. ``order`` of the
    layers' entries in the subnetwork: ``"spans"`` one consecutive span per layer, ``"strided"``
    increasing with gaps, ``"shuffled"`` in no order."""
    g = torch.Generator().manual_seed(1)
    shapes, rows = [(2, 4), (3, 3)], 5.0
    count = sum(o * k for o, k in shapes)
    order = {
        "spans": torch.arange(count),
        "strided": torch.cat(
            [torch.arange(0, 16, 2), torch.arange(1, 16, 2), torch.arange(16, count)]
        ),
        "shuffled": torch.randperm(count, generator=g),
    }[order]
    blocks, a_sums, g_sums, start = [], [], [], 0
    for out, k in shapes:
        layer = KronLayer(nn.Linear(k - 1, out), "linear", True)
        blocks.append(KronBlock(layer, order[start : start + out * k].reshape(out, k)))
        a_sums.append(_spd(k, g))
        g_sums.append(_spd(out, g) * rows)
        start += out * k
    lam = torch.empty(count, dtype=F64)
    lam[blocks[0].positions.reshape(-1)], lam[blocks[1].positions.reshape(-1)] = 0.8, 2.5
    post = KronPosterior.from_factors(blocks, a_sums, g_sums, rows, lam, count).with_prior(lam, C)
    dense = torch.diag(lam)
    for block, a, gs in zip(blocks, a_sums, g_sums):
        pos = block.positions.reshape(-1)
        dense[pos[:, None], pos] += C * torch.kron(gs / rows, a)
    return post, dense, lam


def _full_case():
    g = torch.Generator().manual_seed(2)
    ggn = _spd(6, g)
    lam = torch.linspace(0.5, 2.0, 6, dtype=F64)
    return FullPosterior(ggn, lam, C), C * ggn + torch.diag(lam), lam


def _diag_case():
    g = torch.Generator().manual_seed(3)
    diag = torch.rand(6, generator=g, dtype=F64) * 3
    lam = torch.linspace(0.5, 2.0, 6, dtype=F64)
    return DiagPosterior(diag, lam, C), torch.diag(C * diag + lam), lam


CASES = {
    "full": _full_case,
    "diag": _diag_case,
    "kron": lambda: _kron_case("spans"),
    "kron_strided": lambda: _kron_case("strided"),
    "kron_shuffled": lambda: _kron_case("shuffled"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_structure_is_the_dense_gaussian_of_its_precision(case):
    post, precision, lam = CASES[case]()
    s = precision.shape[0]
    cov = torch.linalg.inv(precision)
    assert_close(post.logdet(lam, C), torch.logdet(precision), rtol=1e-10)
    assert_close(post.variances(), cov.diagonal(), rtol=1e-10)
    # Draws L z with z = I give L itself (sample() acts on rows z: row i is L e_i = column i).
    factor = post.sample(torch.eye(s, dtype=F64)).T
    assert_close(factor @ factor.T, cov, rtol=1e-10, atol=1e-12)
    # Rows J L of a Jacobian J: (J L)(J L)ᵀ = J Σ Jᵀ, the linearized predictive's covariance.
    jac = torch.randn(2, 3, s, generator=torch.Generator().manual_seed(4), dtype=F64)
    jl = post.apply_scale(jac)
    assert_close(jl @ jl.transpose(-1, -2), jac @ cov @ jac.transpose(-1, -2), rtol=1e-10)
    d = torch.randn(4, s, generator=torch.Generator().manual_seed(5), dtype=F64)
    assert_close(post.quadratic(d), torch.einsum("ns,st,nt->n", d, precision, d), rtol=1e-10)
    # The density over the subnetwork is that of N(0, H⁻¹).
    index = torch.arange(s)
    density = StructuredNormal(torch.zeros(s, dtype=F64), index, post).log_prob(d)
    expected = torch.distributions.MultivariateNormal(
        torch.zeros(s, dtype=F64), precision_matrix=precision
    ).log_prob(d)
    assert_close(density, expected, rtol=1e-10)


@pytest.mark.parametrize("case", list(CASES))
def test_logdet_follows_its_arguments_not_the_held_prior(case):
    # The evidence differentiates logdet(λ, c) at trial values while the structure keeps its own.
    post, precision, lam = CASES[case]()
    base = (precision - torch.diag(lam)) / C  # the GGN alone
    lam2, c2 = 1.7 * lam, 2.9
    expected = torch.logdet(c2 * base + torch.diag(lam2))
    assert_close(post.logdet(lam2, c2), expected, rtol=1e-10)
    assert math.isfinite(float(expected))
