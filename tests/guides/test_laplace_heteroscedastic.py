"""Linearized Laplace under a heteroscedastic Gaussian (σ(x) from the network): the output Fisher
against the expected Hessian, the GGN against Σ Jᵀ F J by autograd for every structure, the
residual, the mixture predictive against closed forms and quadrature, a MAP on generated data,
the refusals and the state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pyro import poutine
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.curvature.ggn import output_hessian_factor
from pyro_bdl.guides import AutoSubnetLaplace
from pyro_bdl.guides.laplace.model import Observation, residual
from pyro_bdl.guides.laplace.predictive import linearized_predictive
from pyro_bdl.models import mean_log_variance
from tests.common import assert_close

F64 = torch.float64
EPS = 1e-6


def softplus_split(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """σ² = softplus(s) + 1e-6 of the second output (the UCI benchmark's)."""
    return out[..., 0], torch.log(nn.functional.softplus(out[..., 1]) + EPS)


SPLITS = {"softplus": softplus_split, "exp": mean_log_variance}


def _variance(s: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ², dσ²/ds) of the raw output s, written out independently of the splits."""
    if kind == "exp":
        return s.exp(), s.exp()
    return nn.functional.softplus(s) + EPS, torch.sigmoid(s)


def _nll(f: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    var, _ = _variance(f[..., 1], kind)
    return (0.5 * var.log() + (y - f[..., 0]).square() / (2 * var)).sum()


def _fisher(f: torch.Tensor, kind: str) -> torch.Tensor:
    """diag(1/σ², ½ (σ²′/σ²)²) per example (B, 2, 2)."""
    var, slope = _variance(f[:, 1], kind)
    return torch.diag_embed(torch.stack([1 / var, 0.5 * (slope / var).square()], -1))


def _problem(kind: str = "softplus", hidden: int = 5, n: int = 30, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=F64)
    y = torch.randn(n, generator=g, dtype=F64)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 2)).double()
    lifted = bdl.bayesianize(net, bdl.priors.Normal(1.0))
    return bdl.models.heteroscedastic_regressor(lifted, n, split=SPLITS[kind]), x, y


def _fitted(model, x, y, **kw):
    kw = {"subnetwork": "all", "prior_precision": 1.0, **kw}
    guide = AutoSubnetLaplace(model, **kw)
    guide(x, y)
    # Away from a mode on purpose: the curvature is checked at any weights.
    return guide.fit((x, y), check_mode=False)


def _outputs_at(model, guide, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The network outputs (B, 2) with the packed weights ``flat``, by plain autograd."""
    values = {s.name: s.constrain(b) for s, b in zip(guide.layout, guide.layout.split(flat))}
    with poutine.block():
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(x)
    return trace.nodes["_RETURN"]["value"]


def _jacobian(model, guide, x: torch.Tensor) -> torch.Tensor:
    """J (B, 2, D) of the outputs in the packed weights at the MAP."""
    loc = guide.map_loc.detach()
    return torch.autograd.functional.jacobian(lambda w: _outputs_at(model, guide, w, x), loc)


@pytest.mark.parametrize("kind", list(SPLITS))
def test_the_output_factor_is_the_expected_hessian_of_the_nll(kind):
    # The Hessian in f is quadratic in y, so Gauss–Hermite with 3 nodes takes its expectation
    # under y ~ N(μ, σ²) exactly; the comparison is to float64 round-off.
    g = torch.Generator().manual_seed(1)
    f = torch.randn(4, 2, generator=g, dtype=F64)
    nodes, weights = np.polynomial.hermite.hermgauss(3)
    factor = output_hessian_factor(f, "heteroscedastic", split=SPLITS[kind])
    for n in range(4):
        var, _ = _variance(f[n, 1], kind)
        expected = torch.zeros(2, 2, dtype=F64)
        for t, w in zip(nodes, weights):
            y = f[n, 0] + math.sqrt(2 * float(var)) * t
            hess = torch.autograd.functional.hessian(lambda v, y=y: _nll(v, y, kind), f[n])
            expected += w / math.sqrt(math.pi) * hess
        assert_close(factor[n] @ factor[n].T, expected, rtol=1e-12, atol=1e-12)
        assert_close(factor[n] @ factor[n].T, _fisher(f[n : n + 1], kind)[0], rtol=1e-12)
        # The exact Hessian at an observed y ≠ μ is indefinite: why the Fisher is used.
        hess = torch.autograd.functional.hessian(lambda v, y=f[n, 0] + 0.3: _nll(v, y, kind), f[n])
        assert float(torch.linalg.eigvalsh(hess)[0]) < 0


@pytest.mark.parametrize("kind", list(SPLITS))
def test_the_residual_is_the_gradient_of_the_nll(kind):
    g = torch.Generator().manual_seed(2)
    f, y = torch.randn(5, 2, generator=g, dtype=F64), torch.randn(5, generator=g, dtype=F64)
    obs = Observation("y", "heteroscedastic", None, 2, False, SPLITS[kind])
    var, slope = _variance(f[:, 1], kind)
    r = y - f[:, 0]
    expected = torch.stack([-r / var, 0.5 * slope / var * (1 - r.square() / var)], -1)
    assert_close(residual(f, y, obs), expected, rtol=1e-12)


@pytest.mark.parametrize("kind", list(SPLITS))
def test_the_ggn_is_the_sum_of_j_f_j_for_every_structure(kind):
    model, x, y = _problem(kind)
    full = _fitted(model, x, y)
    jac = _jacobian(model, full, x)
    fisher = _fisher(_outputs_at(model, full, full.map_loc, x).detach(), kind)
    exact = torch.einsum("bcs,bcd,bdt->st", jac, fisher, jac)
    assert_close(full.ggn, exact, rtol=1e-10, atol=1e-12)
    diag = _fitted(model, x, y, hessian_structure="diag")
    assert_close(diag.posterior.diag, exact.diagonal(), rtol=1e-10, atol=1e-12)
    # The last layer's GGN comes from its inputs alone (linear_layer_ggn), not from J.
    last = _fitted(model, x, y, subnetwork="last_layer")
    index = last.subnet_index
    assert_close(last.ggn, exact[index][:, index], rtol=1e-10, atol=1e-12)
    # KFAC approximates each layer's block (not exactly: the Fisher varies by example): it
    # fits, and its evidence and predictive are finite.
    kron = _fitted(model, x, y, hessian_structure="kron")
    assert math.isfinite(kron.marginal_likelihood())
    assert torch.isfinite(kron.predictive_distribution(x).log_prob(y)).all()


def test_the_fit_gradient_is_the_gradient_of_the_training_nll():
    # The mode check's gradient comes from the residuals folded into the fit's passes.
    model, x, y = _problem()
    guide = _fitted(model, x, y)
    flat = guide.map_loc.detach().clone().requires_grad_(True)
    f = _outputs_at(model, guide, flat, x)
    (expected,) = torch.autograd.grad(_nll(f, y, "softplus"), flat)
    obs = Observation("y", "heteroscedastic", None, 2, False, softplus_split)
    jac = _jacobian(model, guide, x)
    assert_close(torch.einsum("bc,bcs->s", residual(f.detach(), y, obs), jac), expected)


def test_the_evidence_has_the_heteroscedastic_fit_term():
    model, x, y = _problem()
    guide = _fitted(model, x, y, prior_precision=0.7)
    f = _outputs_at(model, guide, guide.map_loc, x).detach()
    mean, log_var = softplus_split(f)
    ll = torch.distributions.Normal(mean, (0.5 * log_var).exp()).log_prob(y).sum()
    theta = guide.map_loc.double()
    d = theta.numel()
    _, logdet = torch.linalg.slogdet(guide.ggn + 0.7 * torch.eye(d, dtype=F64))
    expected = ll - 0.35 * theta.square().sum() + 0.5 * d * math.log(0.7) - 0.5 * logdet
    assert_close(guide.marginal_likelihood(), float(expected), rtol=1e-10)
    # The evidence's optimum over λ is found as for any likelihood.
    before = guide.marginal_likelihood()
    guide.tune_prior_precision()
    assert guide.marginal_likelihood() >= before


def _linear(seed: int = 0):
    """A linear mean-and-log-variance model (σ² = exp s): its linearization is exact."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 3, generator=g, dtype=F64)
    y = torch.randn(20, generator=g, dtype=F64)
    torch.manual_seed(seed)
    lifted = bdl.bayesianize(nn.Linear(3, 2).double(), bdl.priors.Normal(1.0))
    model = bdl.models.heteroscedastic_regressor(lifted, 20)
    return model, x, y


def test_the_predictive_mean_and_variance_are_the_closed_form_for_a_linear_model():
    model, x, y = _linear()
    guide = _fitted(model, x, y, prior_precision=2.0)
    x_new = torch.randn(6, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    jac = _jacobian(model, guide, x_new)
    cov = jac @ guide.covariance @ jac.transpose(1, 2)
    m = _outputs_at(model, guide, guide.map_loc, x_new).detach()
    draws = 4000
    mean, var = guide.predict(x_new, num_samples=draws, generator=torch.Generator().manual_seed(0))
    # The draws are matched to mean 0 and covariance I, so the mean (linear in the outputs)
    # and its variance are exact.
    assert_close(mean, m[:, 0], rtol=1e-10, atol=1e-12)
    # E[exp s] = exp(m_s + v_s/2); its Monte Carlo estimate from M draws has standard error
    # exp(m_s + v_s/2) √(e^{v_s} − 1) / √M (matching the moments can only lower it): 5 of them.
    v_s = cov[:, 1, 1]
    expected = cov[:, 0, 0] + (m[:, 1] + v_s / 2).exp()
    se = (m[:, 1] + v_s / 2).exp() * (v_s.exp() - 1).sqrt() / math.sqrt(draws)
    assert torch.all((var - expected).abs() <= 5 * se), (var - expected) / se


def _quadrature_density(m: torch.Tensor, cov: torch.Tensor, y: float) -> float:
    """p(y) = E[N(y; μ, e^s)] for (μ, s) ~ N(m, cov): μ given s in closed form, then s by
    Gauss–Hermite with 200 nodes (the integrand is smooth in s)."""
    nodes, weights = np.polynomial.hermite.hermgauss(200)
    m, cov = m.tolist(), cov.tolist()
    total = 0.0
    for t, w in zip(nodes, weights):
        s = m[1] + math.sqrt(2 * cov[1][1]) * t
        mu = m[0] + cov[0][1] / cov[1][1] * (s - m[1])
        var = cov[0][0] - cov[0][1] ** 2 / cov[1][1] + math.exp(s)
        total += (
            w
            / math.sqrt(math.pi)
            * math.exp(-0.5 * (y - mu) ** 2 / var)
            / math.sqrt(2 * math.pi * var)
        )
    return total


def test_the_predictive_density_is_the_quadrature_within_its_monte_carlo_error():
    model, x, y = _linear(1)
    # A small prior precision: a wide posterior, so that the mixture differs from the plug-in.
    guide = _fitted(model, x, y, prior_precision=0.05)
    x_new = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    y_new = torch.tensor([-2.0, 0.0, 0.5, 3.0], dtype=F64)
    jac = _jacobian(model, guide, x_new)
    cov = jac @ guide.covariance @ jac.transpose(1, 2)
    m = _outputs_at(model, guide, guide.map_loc, x_new).detach()
    draws = 2000
    mixture = guide.predictive_distribution(
        x_new, num_samples=draws, generator=torch.Generator().manual_seed(0)
    )
    estimate = mixture.log_prob(y_new)
    # The density is the mean of M component densities: its relative standard error is their
    # standard deviation over √M · p, read from the draws themselves; log p̂ − log p is that
    # relative error to first order. 5 standard errors, plus the 1/(2M) relative bias of a log.
    components = mixture.component_distribution.log_prob(y_new[:, None]).exp()
    rel_se = components.std(-1) / (math.sqrt(draws) * components.mean(-1))
    for n in range(4):
        exact = math.log(_quadrature_density(m[n], cov[n], float(y_new[n])))
        assert abs(float(estimate[n]) - exact) <= 5 * float(rel_se[n]) + 1 / draws, n
    plug_in = torch.distributions.Normal(m[:, 0], (0.5 * m[:, 1]).exp()).log_prob(y_new)
    assert not torch.allclose(estimate, plug_in, atol=1e-2)  # the posterior width matters here


def _generated(n: int, seed: int):
    """y = sin(2x) + (0.05 + 0.3|x|) ε on x ∈ [−2, 2]: noise that grows tenfold with |x|."""
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.rand(n, 1, generator=g, dtype=F64) - 2
    y = torch.sin(2 * x[:, 0]) + (0.05 + 0.3 * x[:, 0].abs()) * torch.randn(n, generator=g)
    return x, y.double()


def test_at_a_map_the_laplace_predictive_is_no_worse_than_the_map_and_tends_to_it():
    x, y = _generated(200, 0)
    x_val, y_val = _generated(200, 1)
    x_test, y_test = _generated(500, 2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    # The MAP under the N(0, 1) prior, by L-BFGS on the plain network (which the lifted one
    # starts from): the negative log joint, Gaussian NLL plus ½‖θ‖².
    optim = torch.optim.LBFGS(net.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def loss():
        optim.zero_grad()
        value = _nll(net(x), y, "softplus") + 0.5 * sum(p.square().sum() for p in net.parameters())
        value.backward()
        return value

    optim.step(loss)
    lifted = bdl.bayesianize(net, bdl.priors.Normal(1.0))
    model = bdl.models.heteroscedastic_regressor(lifted, len(y), split=softplus_split)
    guide = AutoSubnetLaplace(model, subnetwork="all")
    guide(x, y)
    guide.fit((x, y))  # the mode check passes: the residuals agree with the trained MAP
    f = _outputs_at(model, guide, guide.map_loc, x_test).detach()
    mean, log_var = softplus_split(f)
    plug_in = float(torch.distributions.Normal(mean, (0.5 * log_var).exp()).log_prob(y_test).mean())

    def test_ll() -> float:
        g = torch.Generator().manual_seed(0)
        return float(guide.predictive_distribution(x_test, generator=g).log_prob(y_test).mean())

    grid = torch.logspace(-2, 10, 25, dtype=F64)
    guide.tune_prior_precision((x_val, y_val), method="val_ll", grid=grid)
    tuned = test_ll()
    # λ chosen on other rows: the test LL is at least the MAP's, less 0.02 nats a point (the
    # mixture's Monte Carlo error, 1000 draws, is under 0.005 a point on average).
    assert tuned >= plug_in - 0.02, (tuned, plug_in)
    guide.tune_prior_precision(grid=torch.tensor([1e10], dtype=F64))
    # λ = 10¹⁰: the covariance shrinks to ~10⁻¹⁰ of the outputs' scale and every draw is the
    # MAP's; what is left is the MAP's plug-in density.
    assert abs(test_ll() - plug_in) < 1e-4


def test_refusals_name_the_argument_and_change_nothing():
    model, x, y = _problem()
    guide = _fitted(model, x, y)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(ValueError, match=r"tune_noise.*heteroscedastic.*σ\(x\)"):
        guide.tune_prior_precision(tune_noise=True)
    with pytest.raises(ValueError, match="num_samples must exceed the 2 outputs"):
        guide.predict(x, num_samples=2)
    after = guide.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    with pytest.raises(ValueError, match="heteroscedastic_mixture"):
        linearized_predictive(x[:, :2], torch.zeros(30, 2, 4, dtype=F64), "heteroscedastic")
    with pytest.raises(ValueError, match="noise='learned'"):
        net = bdl.bayesianize(nn.Linear(3, 1).double(), bdl.priors.Normal(1.0))
        AutoSubnetLaplace(bdl.models.regressor(net, 30, noise="learned"), subnetwork="all")


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_the_state_round_trips(structure):
    model, x, y = _problem()
    guide = _fitted(model, x, y, hessian_structure=structure)
    guide.tune_prior_precision()
    other = AutoSubnetLaplace(model, subnetwork="all", hessian_structure=structure)
    other(x, y)
    other.load_state_dict(guide.state_dict())
    for fitted in (guide, other):
        assert fitted.predictive_distribution(x).batch_shape == (30,)
    mine = guide.predict(x, generator=torch.Generator().manual_seed(5))
    theirs = other.predict(x, generator=torch.Generator().manual_seed(5))
    for a, b in zip(mine, theirs):
        assert_close(a, b, rtol=1e-12)
    assert_close(other.marginal_likelihood(), guide.marginal_likelihood(), rtol=1e-12)


def test_the_standard_draws_have_exactly_mean_zero_and_covariance_identity():
    # Matched moments: mean 0 and zᵀz / M = I to round-off, which makes the mixture's mean and
    # the mean's share of its variance exact (a divisor M - 1 would inflate that share by
    # M/(M - 1), 1e-2 for M = 100).
    from pyro_bdl.guides.laplace.predictive import standard_draws

    z = standard_draws(100, 3, torch.Generator().manual_seed(0))
    assert z.shape == (100, 3) and z.dtype == F64
    assert_close(z.mean(0), torch.zeros(3, dtype=F64), atol=1e-14)
    assert_close(z.T @ z / 100, torch.eye(3, dtype=F64), rtol=0.0, atol=1e-13)
    with pytest.raises(ValueError, match="num_samples must exceed the 3 outputs"):
        standard_draws(3, 3)
