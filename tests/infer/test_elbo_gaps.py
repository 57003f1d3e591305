"""TraceSuffStat_ELBO on sites its M-sample KL does not cover: a transform that changes the
site's shape (``LKJCholesky``) takes the documented one-sample fallback, and a prior masked out
whole contributes no KL."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

from pyro_bdl.guides import AutoMeanField, AutoRadial
from pyro_bdl.infer import TraceSuffStat_ELBO
from pyro_bdl.infer.elbo import KLFallbackWarning
from tests.common import assert_close


@pytest.mark.parametrize("num_particles", [1, 2])
def test_lkj_cholesky_site_takes_the_one_sample_fallback(num_particles):
    def model():
        pyro.sample("L", dist.LKJCholesky(3, 2.0))

    pyro.clear_param_store()
    guide = AutoMeanField(model)
    elbo = TraceSuffStat_ELBO(num_kl_samples=8, num_particles=num_particles)
    with pytest.warns(KLFallbackWarning, match=r"site 'L': the guide's transform"):
        loss = elbo.differentiable_loss(model, guide)
    assert elbo.kl_methods == {"L": "trace_elbo"}
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in guide.parameters())


def _masked_model(prior):
    def model():
        pyro.sample("z", prior.mask(False).to_event(1))
        pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    return model


@pytest.mark.parametrize("guide_cls", [AutoMeanField, AutoRadial])
@pytest.mark.parametrize("kl", ["auto", "mc", "direct"])
@pytest.mark.parametrize(
    "prior", [dist.Normal(torch.zeros(2), 1.0), dist.Laplace(torch.zeros(2), 0.5)]
)
def test_a_prior_masked_out_whole_contributes_no_kl(guide_cls, kl, prior):
    pyro.clear_param_store()
    model = _masked_model(prior)
    guide = guide_cls(model)
    elbo = TraceSuffStat_ELBO(num_kl_samples=16, kl=kl)
    loss = elbo.differentiable_loss(model, guide)
    assert elbo.kl_methods["z"] == "masked"
    loss.backward()
    # z's parameters do not enter the loss; w's do, with a finite gradient.
    grad = guide.loc_rho.grad
    assert torch.equal(grad[:, guide.layout["z"].slice], torch.zeros(2, 2))
    w = grad[:, guide.layout["w"].slice]
    assert torch.isfinite(w).all() and bool((w != 0).any())
    if kl == "auto" and guide_cls is AutoMeanField:
        # Only w's KL remains, here in closed form.
        loc, scale = guide.locs_and_scales()["w"]
        expected = kl_divergence(dist.Normal(loc, scale), dist.Normal(0.0, 1.0)).sum()
        assert_close(loss.detach(), expected.detach(), rtol=1e-6)  # float32 round-off
