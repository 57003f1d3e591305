"""``TraceSuffStat_ELBO`` on constrained latent sites: the base KL under a shared bijection, pulled
back element-wise priors, Trace_ELBO's term (with its warning) for the rest, and a lifted network
with a learned noise scale.

The closed forms use the model y_i ~ N(0, σ), i = 1..N, σ ~ LogNormal(0, 1), with the guide
u = log σ ~ N(μ, s²): E_q[log p(y | σ)] = −N μ − (S/2) e^{−2μ + 2s²} − (N/2) log 2π with
S = Σ y_i², and KL(q ‖ p) = KL(N(μ, s²) ‖ N(0, 1)).
"""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from torch.nn.functional import softplus

from pyro_bdl import bayesianize, priors
from pyro_bdl.guides import AutoMeanField, AutoRadial
from pyro_bdl.infer import TraceSuffStat_ELBO
from pyro_bdl.infer.elbo import KLFallbackWarning
from tests.common import assert_close

F64 = torch.float64
N = 20


def _data() -> torch.Tensor:
    return 1.5 * torch.randn(N, dtype=F64, generator=torch.Generator().manual_seed(0))


def _sigma_model(prior):
    def model(y):
        sigma = pyro.sample("sigma", prior)
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(torch.zeros((), dtype=F64), sigma), obs=y)

    return model


def _lognormal_prior():
    return dist.LogNormal(torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64))


def _neg_elbo(mu: torch.Tensor, s: torch.Tensor, y: torch.Tensor, c: float = 1.0):
    """−ELBO of the LogNormal model in closed form, the model's log-densities scaled by c:
    c·E[log lik] + c·E_q[log p(z)] − E_q[log q(z)], where on z = e^u both log-densities carry −u,
    leaving (1 − c)·E[u] = (1 − c)·μ beside the base terms."""
    big_s = (y * y).sum()
    log_lik = -N * mu - big_s / 2 * torch.exp(-2 * mu + 2 * s * s) - N / 2 * math.log(2 * math.pi)
    log_p0 = -0.5 * math.log(2 * math.pi) - (mu * mu + s * s) / 2
    entropy0 = 0.5 * torch.log(2 * math.pi * math.e * s * s)
    return -(c * log_lik + c * log_p0 + entropy0 + (1 - c) * mu)


def _optimum(y):
    """(μ*, s*) maximizing the closed-form ELBO, by L-BFGS to machine precision."""
    p = torch.zeros(2, dtype=F64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [p], max_iter=500, tolerance_grad=1e-13, tolerance_change=0, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        loss = _neg_elbo(p[0], p[1].exp(), y)
        loss.backward()
        return loss

    opt.step(closure)
    return float(p[0].detach()), float(p[1].detach().exp())


def _guide(model, y, guide_cls=AutoMeanField, loc=0.3, scale=0.4):
    guide = guide_cls(model)
    guide(y)
    guide.set_loc_scale("sigma", loc=loc, scale=scale)
    return guide


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=F64)
    return float(t.mean()), float(t.std() / math.sqrt(len(values)))


ELBOS = {
    "exact": lambda: TraceSuffStat_ELBO(kl="auto"),
    "suffstat": lambda: TraceSuffStat_ELBO(kl="mc", num_kl_samples=1000),
    "trace_elbo": lambda: Trace_ELBO(),
}


@pytest.mark.parametrize("scale", [1.0, 0.25], ids=["unscaled", "model_scaled"])
@pytest.mark.parametrize("which", sorted(ELBOS))
def test_lognormal_sigma_loss_matches_the_closed_form_in_expectation(which, scale):
    # Each ELBO's loss, averaged over n = 400 independent draws, against the closed-form −ELBO.
    # Tolerance: 5 standard errors of the mean, the SE measured from the draws themselves. The
    # model-scaled case checks the Jacobian term that the two halves no longer cancel.
    y = _data()
    model = poutine.scale(_sigma_model(_lognormal_prior()), scale=scale)
    guide = _guide(model, y)
    elbo = ELBOS[which]()
    n = 400
    mean, se = _mean_and_se([elbo.loss(model, guide, y) for _ in range(n)])
    expected = float(
        _neg_elbo(torch.tensor(0.3, dtype=F64), torch.tensor(0.4, dtype=F64), y, c=scale)
    )
    assert abs(mean - expected) < 5 * se
    if which != "trace_elbo":
        assert elbo.kl_methods == {"sigma": "exact" if which == "exact" else "suffstat_normal"}


@pytest.mark.parametrize("which", sorted(ELBOS))
def test_lognormal_sigma_gradient_vanishes_at_the_closed_form_optimum(which):
    # The same optimum: at (μ*, s*) the mean of n = 300 gradient estimates (over loc and ρ,
    # s = softplus(ρ)) is 0 within 5 standard errors per coordinate, SE from the estimates; at
    # another point it equals the closed-form gradient within the same tolerance.
    y = _data()
    model = _sigma_model(_lognormal_prior())
    mu_opt, s_opt = _optimum(y)
    for loc, scale in [(mu_opt, s_opt), (0.0, 0.5)]:
        guide = _guide(model, y, loc=loc, scale=scale)
        (param,) = guide.parameters()
        elbo = ELBOS[which]()
        grads = torch.stack(
            [
                torch.autograd.grad(elbo.differentiable_loss(model, guide, y), [param])[0]
                for _ in range(300)
            ]
        ).flatten(1)
        mean, se = grads.mean(0), grads.std(0) / math.sqrt(len(grads))
        mu = torch.tensor(loc, dtype=F64, requires_grad=True)
        rho = (torch.tensor(scale, dtype=F64).expm1().log()).requires_grad_()
        expected = torch.stack(torch.autograd.grad(_neg_elbo(mu, softplus(rho), y), [mu, rho]))
        assert ((mean - expected).abs() < 5 * se).all(), (mean, expected, se)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["exact", "trace_elbo"])
def test_lognormal_sigma_training_reaches_the_closed_form_optimum(which):
    # Adam, 2000 steps with the rate cut by 0.3 after 1000; the iterates of the last 1000 steps
    # are averaged. The average lies within the stationary spread of the iterates around the
    # optimum: tolerance 5 × their measured standard deviation.
    y = _data()
    model = _sigma_model(_lognormal_prior())
    guide = _guide(model, y, loc=0.0, scale=0.1)
    elbo = ELBOS[which]()
    optim = torch.optim.Adam(guide.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1000, gamma=0.3)
    iterates = []
    for step in range(2000):
        optim.zero_grad()
        elbo.differentiable_loss(model, guide, y).backward()
        optim.step()
        sched.step()
        if step >= 1000:
            iterates.append(torch.stack(guide.locs_and_scales()["sigma"]))
    its = torch.stack(iterates)
    optimum = torch.tensor(_optimum(y), dtype=F64)
    assert ((its.mean(0) - optimum).abs() < 5 * its.std(0)).all(), (its.mean(0), optimum)


def _paired_differences(model, guide, y, elbo, n):
    """TraceSuffStat_ELBO − Trace_ELBO under the same seed: the guide's draw (hence the likelihood)
    is shared, so each difference is the KL estimate minus log q(z) − log p(z), mean 0."""
    diffs = []
    for seed in range(n):
        pyro.set_rng_seed(seed)
        a = elbo.loss(model, guide, y)
        pyro.set_rng_seed(seed)
        diffs.append(a - Trace_ELBO().loss(model, guide, y))
    return diffs


PRIORS = {
    "LogNormal": (_lognormal_prior, "exact"),
    "Gamma": (lambda: dist.Gamma(torch.tensor(2.0, dtype=F64), 1.0), "streaming_elementwise"),
    "HalfCauchy": (lambda: dist.HalfCauchy(torch.tensor(1.0, dtype=F64)), "streaming_elementwise"),
    "Uniform": (lambda: dist.Uniform(torch.tensor(0.0, dtype=F64), 10.0), "streaming_elementwise"),
}


@pytest.mark.parametrize(
    "prior_name,guide_cls",
    [(name, AutoMeanField) for name in sorted(PRIORS)] + [("Gamma", AutoRadial)],
)
def test_constrained_priors_match_trace_elbo_in_expectation(prior_name, guide_cls):
    # The pulled-back priors (Gamma, HalfCauchy, Uniform) use the streaming estimator. Mean of
    # n = 300 paired differences within 5 of its standard errors (measured) of 0, no warning.
    make_prior, method = PRIORS[prior_name]
    y = _data()
    model = _sigma_model(make_prior())
    guide = _guide(model, y, guide_cls)
    elbo = TraceSuffStat_ELBO(num_kl_samples=100)
    mean, se = _mean_and_se(_paired_differences(model, guide, y, elbo, 300))
    assert abs(mean) < 5 * se
    assert elbo.kl_methods == {"sigma": method}


def _simplex_model(y):
    probs = pyro.sample("probs", dist.Dirichlet(torch.ones(3, dtype=F64)))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Categorical(probs), obs=y)


def test_fallback_warns_once_per_instance_and_site_and_is_trace_elbo():
    # Stick-breaking changes the shape and the Dirichlet is no transform of a base: the site
    # takes Trace_ELBO's term. Nothing else is drawn, so under one seed the loss and gradient are
    # Trace_ELBO's to rounding (equal per draw, hence in expectation).
    y = torch.tensor([0, 2, 2, 1])
    guide = AutoMeanField(_simplex_model)
    guide(y)
    (param,) = guide.parameters()
    elbo = TraceSuffStat_ELBO()
    with pytest.warns(KLFallbackWarning, match=r"site 'probs'.*StickBreakingTransform") as caught:
        for _ in range(3):
            elbo.loss(_simplex_model, guide, y)
    assert len(caught) == 1
    assert elbo.kl_methods == {"probs": "trace_elbo"}
    with pytest.warns(KLFallbackWarning, match="site 'probs'"):  # a new instance warns again
        TraceSuffStat_ELBO().loss(_simplex_model, guide, y)
    results = []
    for loss_fn in (elbo, Trace_ELBO()):
        pyro.set_rng_seed(3)
        loss = loss_fn.differentiable_loss(_simplex_model, guide, y)
        results.append((loss.detach(), torch.autograd.grad(loss, [param])[0]))
    assert_close(results[0][0], results[1][0], rtol=1e-12)
    assert_close(results[0][1], results[1][1], rtol=1e-10, atol=1e-12)


def test_fallback_site_beside_a_kl_site_matches_trace_elbo_in_expectation():
    # One site on Trace_ELBO's term, one on the streaming KL: n = 300 paired differences,
    # mean within 5 measured standard errors of 0.
    def model(y):
        _simplex_model(y)
        pyro.sample("s", dist.Gamma(torch.tensor(2.0, dtype=F64), 1.0))

    y = torch.tensor([0, 2, 2, 1])
    guide = AutoMeanField(model, init_scale=0.3)
    guide(y)
    elbo = TraceSuffStat_ELBO(num_kl_samples=100)
    with pytest.warns(KLFallbackWarning, match="site 'probs'"):
        mean, se = _mean_and_se(_paired_differences(model, guide, y, elbo, 300))
    assert abs(mean) < 5 * se
    assert elbo.kl_methods == {"probs": "trace_elbo", "s": "streaming_elementwise"}


def test_uniform_prior_under_exact_points_at_kl_auto():
    model = _sigma_model(PRIORS["Uniform"][0]())
    y = _data()
    guide = _guide(model, y)
    with pytest.raises(ValueError, match=r"site 'sigma' has no closed-form KL.*Use kl='auto'"):
        TraceSuffStat_ELBO(kl="exact").loss(model, guide, y)


# --- lifted network + learned noise scale ------------------------------------------------------


def _regression(prior=priors.Normal(scale=1.0)):
    torch.manual_seed(0)
    bnn = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(F64), prior)
    x = torch.randn(N, 3, dtype=F64)
    y = torch.randn(N, dtype=F64)

    def model(x, y):
        sigma = pyro.sample("sigma", _lognormal_prior())
        mean = bnn(x).squeeze(-1)
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(mean, sigma), obs=y)

    guide = AutoMeanField(model, init_scale=0.2)
    guide(x, y)
    return model, guide, x, y


@pytest.mark.parametrize("kl,method", [("auto", "exact"), ("mc", "suffstat_normal")])
def test_lifted_weights_and_a_learned_noise_scale(kl, method):
    # Every site has a KL (no warning: filterwarnings = error); the loss matches Trace_ELBO in
    # expectation (n = 300 paired differences within 5 measured SE of 0) and SVI trains.
    model, guide, x, y = _regression()
    elbo = TraceSuffStat_ELBO(kl=kl, num_kl_samples=1000)
    diffs = []
    for seed in range(300):
        pyro.set_rng_seed(seed)
        a = elbo.loss(model, guide, x, y)
        pyro.set_rng_seed(seed)
        diffs.append(a - Trace_ELBO().loss(model, guide, x, y))
    mean, se = _mean_and_se(diffs)
    assert abs(mean) < 5 * se
    assert set(elbo.kl_methods) == {"sigma", "0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(elbo.kl_methods.values()) == {method}
    (param,) = guide.parameters()
    (grad,) = torch.autograd.grad(elbo.differentiable_loss(model, guide, x, y), [param])
    assert torch.isfinite(grad).all() and (grad != 0).all()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), elbo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [svi.step(x, y) for _ in range(20)]
    assert all(math.isfinite(v) for v in losses)
