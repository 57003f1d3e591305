"""The multi-class links of the linearized Laplace predictive: per-class probit, Laplace bridge,
and the validation score that tunes λ with them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyro_bdl.guides.laplace.evidence import val_ll_score
from pyro_bdl.guides.laplace.posterior import laplace_bridge, linearized_predictive, probit_logits
from tests.common import assert_close
from tests.guides.test_laplace import _trained

F64 = torch.float64


def _random(b=7, c=4, s=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, c, generator=g, dtype=F64),
        torch.randn(b, c, s, generator=g, dtype=F64),
    )


def _pairwise_mean(f, jl):
    """The formula the per-class probit replaced: every logit over one factor from the mean
    variance of the pairwise logit differences."""
    centred = jl - jl.mean(1, keepdim=True)
    var = 2.0 / (f.shape[1] - 1) * centred.square().sum((1, 2))
    return (f / (1 + math.pi / 8 * var).sqrt().unsqueeze(-1)).softmax(-1)


def test_per_class_probit_is_the_brute_force_formula():
    f, jl = _random()
    p = linearized_predictive(f, jl, "categorical", link="probit")
    expected = torch.empty_like(f)
    for i in range(f.shape[0]):
        cov = jl[i] @ jl[i].T  # Σ_f = (JL)(JL)ᵀ
        scaled = [f[i, k] / math.sqrt(1 + math.pi / 8 * float(cov[k, k])) for k in range(4)]
        expected[i] = torch.tensor(scaled, dtype=F64).softmax(-1)
    assert_close(p, expected)


def test_two_classes_with_a_constant_logit_is_the_binary_probit():
    f, jl = _random(c=1)
    binary = linearized_predictive(f, jl, "bernoulli", link="probit")
    p = linearized_predictive(
        torch.cat([f, torch.zeros_like(f)], 1),
        torch.cat([jl, torch.zeros_like(jl)], 1),
        "categorical",
        link="probit",
    )
    assert_close(p[:, 0], binary)
    assert_close(
        p[:, 0], (f.squeeze(-1) / (1 + math.pi / 8 * jl.square().sum((1, 2))).sqrt()).sigmoid()
    )


def _one_random_logit(var):
    """Rows with C = 3 where only raw logit 0 is random (variance ``var``), seen as a classifier
    sees them (:func:`pyro_bdl.models.classifier` outputs log-probabilities: f = log_softmax(z),
    J_f = (I − 1pᵀ) J_z), and E[softmax] by Gauss-Hermite quadrature in that one dimension
    (exact to round-off with 80 nodes; softmax ignores the shift log_softmax adds)."""
    z = torch.tensor([[1.0, 0.5, -0.5], [-1.0, 0.0, 1.5], [0.0, -2.0, -2.0]], dtype=F64)
    jz = torch.zeros(3, 3, 2, dtype=F64)
    jz[:, 0, 0] = math.sqrt(var)
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)  # ∫ g(u) e^{-u²/2} du
    u = torch.as_tensor(nodes, dtype=F64)
    w = torch.as_tensor(weights / weights.sum(), dtype=F64)
    draws = z.unsqueeze(0).repeat(len(u), 1, 1)
    draws[:, :, 0] += math.sqrt(var) * u[:, None]
    exact = torch.einsum("k,kbc->bc", w, draws.softmax(-1))
    p = z.softmax(-1)
    jl = jz - torch.einsum("bc,bcs->bs", p, jz).unsqueeze(1)
    return z.log_softmax(-1), jl, exact


@pytest.mark.parametrize("var", [1.0, 4.0, 16.0])
def test_per_class_probit_is_closer_to_the_exact_predictive_than_the_pairwise_mean(var):
    # Unequal class variances: the pairwise mean spreads the one random logit's variance over
    # every logit, shrinking the certain ones too.
    f, jl, exact = _one_random_logit(var)
    probit = linearized_predictive(f, jl, "categorical", link="probit")
    assert (probit - exact).abs().mean() < (_pairwise_mean(f, jl) - exact).abs().mean()
    torch.manual_seed(0)
    mc = linearized_predictive(f, jl, "categorical", link="mc", num_samples=4000)
    # The quadrature is the predictive MC estimates: 4000 draws of p ∈ [0, 1] have a standard
    # error ≤ 0.5/√4000 ≈ 0.008 per entry; 0.04 is five of them.
    assert (mc - exact).abs().max() < 0.04


def test_laplace_bridge_is_finite_when_some_class_has_no_variance():
    f, jl, _ = _one_random_logit(4.0)
    jl[:, 1:] = 0.0
    p = linearized_predictive(f, jl, "categorical", link="bridge")
    assert torch.isfinite(p).all()
    assert_close(p.sum(-1), torch.ones(3, dtype=F64))


def test_laplace_bridge_is_the_brute_force_formula():
    # Condition N(f, Σ) on Σ_k f_k = 0, then α_k = (1 − 2/C + e^{μ_k} Σ_l e^{−μ_l}/C²)/Σ_kk.
    f, jl = _random(seed=1)
    p = laplace_bridge(f, jl)
    c = f.shape[1]
    for i in range(f.shape[0]):
        cov = jl[i] @ jl[i].T
        ones = torch.ones(c, dtype=F64)
        gain = cov @ ones / (ones @ cov @ ones)
        mu = f[i] - gain * f[i].sum()
        cond = cov - torch.outer(cov @ ones, gain)
        alpha = (1 - 2 / c + mu.exp() * (-mu).exp().sum() / c**2) / cond.diagonal()
        assert_close(p[i], alpha / alpha.sum())
    assert_close(p.sum(-1), torch.ones(f.shape[0], dtype=F64))


def test_laplace_bridge_needs_a_categorical_likelihood():
    f, jl = _random(c=1)
    with pytest.raises(ValueError, match="link='bridge' needs a categorical"):
        linearized_predictive(f, jl, "bernoulli", link="bridge")


def test_val_ll_score_is_the_log_likelihood_of_the_categorical_probit_predictive():
    # The score that val_ll tuning maximises is the log-likelihood of predict()'s predictive:
    # checked exactly on random inputs at several λ.
    g = torch.Generator().manual_seed(0)
    b, c, s = 9, 4, 6
    out = torch.randn(b, c, generator=g, dtype=F64)
    jac = torch.randn(b, c, s, generator=g, dtype=F64)
    y = torch.randint(0, c, (b,), generator=g)
    a = torch.randn(s, s, generator=g, dtype=F64)
    evals, evecs = torch.linalg.eigh(a @ a.T)
    ratio = 0.5
    score = val_ll_score([(out, jac, y)], "categorical", None, evals, evecs, ratio)
    for lam in (0.1, 1.0, 10.0):
        jl = (jac @ evecs) * (evals + lam * ratio).rsqrt()  # J L with L Lᵀ = Σ_S
        p = linearized_predictive(out, jl, "categorical", link="probit")
        expected = torch.distributions.Categorical(probs=p).log_prob(y).sum()
        assert float(score(torch.tensor(lam, dtype=F64))) == pytest.approx(
            float(expected), rel=1e-10
        )


def test_probit_logits_scale_each_logit_by_its_own_variance():
    f = torch.tensor([[2.0, -1.0, 0.5]], dtype=F64)
    var = torch.tensor([[0.0, 8 / math.pi, 24 / math.pi]], dtype=F64)
    assert_close(probit_logits(f, var), torch.tensor([[2.0, -1.0 / math.sqrt(2), 0.25]], dtype=F64))


def test_predict_accepts_every_link_and_returns_probabilities():
    guide, _, _, x, y = _trained("last_layer")
    guide.fit((x, y))
    x_test = torch.randn(20, x.shape[1], dtype=x.dtype)
    for link in ("probit", "bridge", "mc"):
        p = guide.predict(x_test, link=link)
        assert p.shape == (20, 3)
        assert_close(p.sum(-1), torch.ones(20, dtype=p.dtype))
    with pytest.raises(ValueError, match="link"):
        guide.predict(x_test, link="softmax")
