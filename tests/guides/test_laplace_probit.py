"""The multi-class links of the linearized Laplace predictive: per-class probit, Laplace bridge,
and the validation score that tunes λ with them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyro_bdl.guides.laplace.evidence import val_ll_score
from pyro_bdl.guides.laplace.predictive import laplace_bridge, linearized_predictive, probit_logits
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


def test_val_ll_score_of_two_classes_is_the_log_likelihood_of_the_binary_probit():
    # With the Jacobian of the logit difference (B, 1, S), what val_ll tuning maximises is the
    # log-likelihood of the two-class predictive that predict() returns, exactly.
    g = torch.Generator().manual_seed(1)
    b, s = 11, 5
    out = torch.randn(b, 2, generator=g, dtype=F64)
    jd = torch.randn(b, 1, s, generator=g, dtype=F64)
    y = torch.randint(0, 2, (b,), generator=g)
    a = torch.randn(s, s, generator=g, dtype=F64)
    evals, evecs = torch.linalg.eigh(a @ a.T)
    score = val_ll_score([(out, jd, y)], "categorical", None, evals, evecs, 1.0)
    for lam in (0.1, 1.0, 10.0):
        jl = (jd @ evecs) * (evals + lam).rsqrt()
        p = linearized_predictive(out, jl, "categorical", link="probit")
        expected = p[torch.arange(b), y].log().sum()
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


@pytest.mark.parametrize("classes", [3, 2])
def test_mc_predictions_draw_from_the_given_generator(classes):
    """``predict(link="mc", generator=g)`` draws from ``g``: the same seed gives the same
    probabilities whatever the global random state (two classes take the logit difference's
    own path)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, classes))
    guide, _, _, x, y = _trained("all", steps=0, net=net.double())
    guide.fit((x, y.clamp(max=classes - 1)), check_mode=False)
    draws = []
    for seed in range(2):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(1)
        draws.append(guide.predict(x[:5], link="mc", num_samples=50, generator=g))
    assert torch.equal(draws[0], draws[1])


def _two_class_rows(var):
    """Log-probability outputs of two classes with logit differences d ∈ [−4, 4], the Jacobian of
    d (every row variance ``var``) and the full one a classifier sees (J_f = (I − 1pᵀ) J_z with
    J_z = [0, J_d]), and E[σ(d)] by 80-node Gauss-Hermite quadrature (exact to round-off)."""
    d = torch.linspace(-4, 4, 41, dtype=F64)
    z = torch.stack([torch.zeros_like(d), d], 1)
    jd = torch.full((len(d), 1, 1), math.sqrt(var), dtype=F64)
    jz = torch.cat([torch.zeros_like(jd), jd], 1)
    jl = jz - torch.einsum("bc,bcs->bs", z.softmax(-1), jz).unsqueeze(1)
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    u = torch.as_tensor(nodes, dtype=F64)
    w = torch.as_tensor(weights / weights.sum(), dtype=F64)
    exact = torch.einsum("k,kb->b", w, (d + math.sqrt(var) * u[:, None]).sigmoid())
    return z.log_softmax(-1), jd, jl, exact


@pytest.mark.parametrize("var", [0.01, 0.1, 1.0, 4.0, 16.0, 100.0])
def test_two_class_probit_of_the_logit_difference_is_near_the_exact_predictive(var):
    f, jd, jl, exact = _two_class_rows(var)
    binary = linearized_predictive(f, jd, "categorical", link="probit")
    assert_close(binary[:, 1], (f[:, 1] - f[:, 0]).div((1 + math.pi / 8 * var) ** 0.5).sigmoid())
    assert_close(binary.sum(-1), torch.ones(len(f), dtype=F64))
    per_class = linearized_predictive(f, jl, "categorical", link="probit")
    # MacKay's probit is within 0.01 of E[σ(d)] at every variance here (measured: at most
    # 0.0086, at var 4); the per-class form on log-probabilities is off by up to 0.015 (var 4)
    # and the two differ by at most 0.012: the two-class form is no worse an approximation.
    assert (binary[:, 1] - exact).abs().max() < 0.01
    assert (binary - per_class).abs().max() < 0.02


def test_two_class_mc_from_the_logit_difference_is_the_full_jacobian_draws():
    f, jd, jl, _ = _two_class_rows(2.0)
    torch.manual_seed(0)
    from_difference = linearized_predictive(f, jd, "categorical", link="mc", num_samples=50)
    torch.manual_seed(0)
    full = linearized_predictive(f, jl, "categorical", link="mc", num_samples=50)
    # The same draws z: the full draws' f₁ − f₀ is the difference draw, so only round-off differs.
    assert_close(from_difference, full)


def test_bridge_refuses_the_jacobian_of_the_logit_difference():
    f, jd, _, _ = _two_class_rows(1.0)
    with pytest.raises(ValueError, match="bridge"):
        linearized_predictive(f, jd, "categorical", link="bridge")
