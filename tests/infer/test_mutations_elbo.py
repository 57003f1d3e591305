"""TraceSuffStat_ELBO lines whose wrong versions the other ELBO tests let through: the Jacobian
term of a constrained site whose model and guide halves are scaled differently (checked at one
draw, without Monte Carlo noise), the average over several particles, a tensor scale, a
partial mask on a prior, and the scales of the one-sample fallback's two halves."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch.distributions import kl_divergence

from pyro_bdl.guides import AutoMeanField
from pyro_bdl.infer import TraceSuffStat_ELBO
from pyro_bdl.infer.elbo import KLFallbackWarning
from tests.scenarios import BayesianLinearRegression

F64 = torch.float64
N = 20


def sigma_model(y: torch.Tensor) -> None:
    """y_i ~ N(0, σ), i = 1..N, under σ ~ LogNormal(0, 1)."""
    sigma = pyro.sample("sigma", dist.LogNormal(torch.zeros((), dtype=F64), 1.0))
    with pyro.plate("data", N):
        pyro.sample("y", dist.Normal(torch.zeros((), dtype=F64), sigma), obs=y)


@pytest.mark.parametrize("c", [0.25, 3.0])
def test_a_scaled_constrained_site_adds_the_jacobian_term_at_the_guides_draw(c):
    # σ ~ LogNormal(0, 1) and the guide's σ = e^u, u ~ N(μ, s²): the KL of the bases is exact,
    # but with the model scaled by c its halves no longer cancel the Jacobian: log q(σ) and
    # log p(σ) each carry −u, so the site's ELBO term is
    #   c·E_q[log p₀(u)] + H(q₀) + (1 − c)·u
    # with u the guide's draw (the estimate of (1 − c)·E[u]), p₀ = N(0, 1), q₀ = N(μ, s²).
    # The loss at one draw is then a closed form in u, exact to float64 rounding.
    y = 1.5 * torch.randn(N, dtype=F64, generator=torch.Generator().manual_seed(0))
    model = poutine.scale(sigma_model, scale=c)
    mu, s = 0.3, 0.4
    guide = AutoMeanField(model)
    guide(y)
    guide.set_loc_scale("sigma", loc=mu, scale=s)
    pyro.set_rng_seed(11)
    z = poutine.trace(guide).get_trace(y).nodes["sigma"]["value"].detach()
    u = float(torch.log(z))
    pyro.set_rng_seed(11)
    elbo = TraceSuffStat_ELBO(kl="auto")
    loss = elbo.loss(model, guide, y)
    assert elbo.kl_methods == {"sigma": "exact"}
    log_lik = float(dist.Normal(torch.zeros((), dtype=F64), z).log_prob(y).sum())
    log_p0 = -0.5 * math.log(2 * math.pi) - (mu * mu + s * s) / 2
    entropy0 = 0.5 * math.log(2 * math.pi * math.e * s * s)
    expected = -(c * log_lik + c * log_p0 + entropy0 + (1 - c) * u)
    # float64, a few dozen terms: 1e-12 relative, while (1 − c)·u (left out, or with the wrong
    # sign) moves the loss by more than 1e-3 of it.
    assert abs((1 - c) * u) > 1e-3 * abs(expected)
    assert loss == pytest.approx(expected, rel=1e-12)


def test_several_particles_average_the_loss_and_the_gradients_of_one_particle_each():
    # num_particles = 3 draws the weights three times in a row: its loss and its gradients are
    # the means of three one-particle evaluations that make the same draws (the exact KL takes
    # no random numbers, so the guide's draws are the only ones). float64: 1e-12 relative.
    sc = BayesianLinearRegression(n=20)
    model = sc.model()
    pyro.clear_param_store()
    guide = AutoMeanField(model, init_scale=0.3)
    guide(sc.x, sc.y)
    params = [p for p in pyro.get_param_store().values() if p.requires_grad]

    def run(num_particles: int, calls: int, method: str) -> tuple[float, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        elbo = TraceSuffStat_ELBO(kl="exact", num_particles=num_particles)
        pyro.set_rng_seed(4)
        losses = [getattr(elbo, method)(model, guide, sc.x, sc.y) for _ in range(calls)]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad / calls for p in params]
        return sum(losses) / calls, grads

    for method in ("loss", "loss_and_grads"):
        one_loss, one_grads = run(1, 3, method)
        three_loss, three_grads = run(3, 1, method)
        assert three_loss == pytest.approx(one_loss, rel=1e-12)
        for a, b in zip(three_grads, one_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert any(bool(g.abs().sum() > 0) for g in three_grads)


@pytest.mark.parametrize("kl", ["auto", "mc"])
def test_a_tensor_model_scale_weights_the_prior_half_as_a_number_does(kl):
    # poutine.scale(model, c) scales E_q[log p] and not E_q[log q]: a tensor c is no more the
    # guide's scale 1 than the number c is, and gives the same loss (the same draws: the
    # direct (T₁, T₂) of kl="mc" come from the same generator calls). float64: 1e-12 relative.
    sc = BayesianLinearRegression(n=20)
    model = sc.model()
    pyro.clear_param_store()
    guide = AutoMeanField(model, init_scale=0.3)
    guide(sc.x, sc.y)
    values = []
    for c in (0.25, torch.tensor(0.25, dtype=F64)):
        pyro.set_rng_seed(2)
        elbo = TraceSuffStat_ELBO(kl=kl, num_kl_samples=100)
        values.append(elbo.loss(poutine.scale(model, scale=c), guide, sc.x, sc.y))
    unscaled = TraceSuffStat_ELBO(kl=kl, num_kl_samples=100)
    pyro.set_rng_seed(2)
    # Scaling both halves by c instead would be c times the unscaled loss.
    assert values[1] != pytest.approx(0.25 * unscaled.loss(model, guide, sc.x, sc.y), rel=1e-3)
    assert values[1] == pytest.approx(values[0], rel=1e-12)


def test_a_partly_masked_prior_drops_only_its_masked_elements_log_density():
    # Only a prior masked out whole contributes no KL. A partial mask drops the log-density of
    # the masked elements from the prior half alone (Trace_ELBO semantics; the guide is not
    # masked), so the loss is KL(q₀ ‖ p₀) of the kept element minus the entropy of the masked
    # one's q₁: −E_q[log p₀] + E_q[log q₀] + E_q[log q₁].
    def model():
        prior = dist.Normal(torch.zeros(2, dtype=F64), 1.0).mask(torch.tensor([True, False]))
        pyro.sample("z", prior.to_event(1))

    pyro.clear_param_store()
    guide = AutoMeanField(model, init_scale=0.5)
    guide()
    m = 10**6
    elbo = TraceSuffStat_ELBO(num_kl_samples=m)
    pyro.set_rng_seed(0)
    loss = elbo.loss(model, guide)
    assert elbo.kl_methods == {"z": "streaming_elementwise"}
    loc, scale = (t.detach() for t in guide.locs_and_scales()["z"])
    kept = float(kl_divergence(dist.Normal(loc[0], scale[0]), dist.Normal(0.0, 1.0)))
    entropy = float(dist.Normal(loc[1], scale[1]).entropy())
    # The M-sample means: log N(μ + σξ | 0, 1) of the kept element has variance
    # (μσ)² + σ⁴/2 per sample, log q of each element (−ξ²/2 + const) variance ½; 5 standard
    # errors of each half bound the error, far below the entropy (≈ 0.73) the whole-site
    # reading would drop with the KL.
    se = math.sqrt(float((loc[0] * scale[0]) ** 2 + scale[0] ** 4 / 2) / m) + math.sqrt(1.0 / m)
    assert abs(loss - (kept - entropy)) < 5 * se
    assert abs(kept - entropy) > 100 * se


@pytest.mark.parametrize("c", [0.25, 3.0])
def test_the_one_sample_fallback_scales_only_the_prior_half(c):
    # A site without an M-sample KL (LKJCholesky: the guide's transform changes the site's
    # shape) enters through Trace_ELBO's term log p(z) − log q(z) at the guide's draw, whose
    # halves take their own sites' scales: under poutine.scale(model, c) the loss is
    # −c log p(z) + log q(z). One draw, no Monte Carlo: float32 rounding, 1e-5 relative.
    def model():
        pyro.sample("L", dist.LKJCholesky(3, torch.tensor(2.0, dtype=F64)))

    pyro.clear_param_store()
    guide = AutoMeanField(model)
    guide()
    pyro.set_rng_seed(3)
    site = poutine.trace(guide).get_trace().nodes["L"]
    z = site["value"].detach()
    log_q = float(site["fn"].log_prob(z).sum().detach())
    log_p = float(dist.LKJCholesky(3, torch.tensor(2.0, dtype=F64)).log_prob(z))
    elbo = TraceSuffStat_ELBO()
    pyro.set_rng_seed(3)
    with pytest.warns(KLFallbackWarning, match=r"site 'L'"):
        loss = elbo.loss(poutine.scale(model, scale=c), guide)
    assert elbo.kl_methods == {"L": "trace_elbo"}
    assert abs(log_q) > 0.1 and abs((1 - c) * log_q) > 1e-3 * abs(c * log_p - log_q)
    assert loss == pytest.approx(-(c * log_p - log_q), rel=1e-10)
