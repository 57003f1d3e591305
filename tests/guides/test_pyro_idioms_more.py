"""The location-scale guides under more of Pyro's idioms: the param store saved and loaded around
a guide that is already set up, and the Radial KL compiled by Pyro's JIT mean-field ELBO."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, JitTraceMeanField_ELBO, Trace_ELBO, TraceMeanField_ELBO
from torch.distributions import kl_divergence

from pyro_bdl.distributions import Radial
from pyro_bdl.guides import AutoMeanField, AutoRadial, base

GUIDES = [AutoMeanField, AutoRadial]


def three_site_model():
    a = pyro.sample("a", dist.Normal(torch.zeros(8), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.zeros(6), 1.0).to_event(1))
    c = pyro.sample("c", dist.Normal(0.0, 1.0))
    pyro.sample("obs", dist.Normal(a.sum() + b.sum() + c, 1.0), obs=torch.tensor(3.0))


@pytest.mark.parametrize("guide_cls", GUIDES)
@pytest.mark.parametrize("block_numel", [base.BLOCK_NUMEL, 8], ids=["one_block", "blocks"])
@pytest.mark.parametrize("restore", ["load", "set_state"])
def test_a_param_store_loaded_into_a_set_up_guide_is_what_it_samples_and_trains(
    monkeypatch, tmp_path, guide_cls, block_numel, restore
):
    # Pyro's checkpoint idiom in one session: save the store, train on, load the store back.
    # SVI's optimizer updates the store's tensors, so the guide must sample from the loaded ones
    # (and show them once it ran); otherwise it keeps the later values and no step changes it.
    monkeypatch.setattr(base, "BLOCK_NUMEL", block_numel)
    guide = guide_cls(three_site_model)
    svi = SVI(three_site_model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    for _ in range(3):
        svi.step()
    path = str(tmp_path / "params.pt")
    store = pyro.get_param_store()
    store.save(path)
    # A state of plain tensors (no nn.Parameter), as a user may assemble one.
    state = {
        "params": {k: v.detach().clone() for k, v in store.get_state()["params"].items()},
        "constraints": store.get_state()["constraints"],
    }
    saved_loc, saved_scale = guide.loc.detach().clone(), guide.scale.detach().clone()
    for _ in range(3):
        svi.step()
    assert not torch.equal(guide.loc, saved_loc)

    if restore == "load":
        store.load(path)
    else:
        store.set_state(state)
    drawn = poutine.trace(guide).get_trace().nodes["a"]["fn"]
    assert torch.equal(getattr(drawn, "base_dist", drawn).loc, saved_loc[:8])
    assert torch.equal(guide.loc, saved_loc) and torch.equal(guide.scale, saved_scale)
    assert torch.equal(guide.median()["c"], saved_loc[-1])
    svi.step()
    assert not torch.equal(guide.loc, saved_loc)  # trains from the loaded values
    # The optimizer is new for the loaded tensor: Adam's first step moves each number by lr
    # (its update is lr·m̂/√v̂ = ±lr), so 0.1 at most, up to float32 rounding.
    assert float((guide.loc.detach() - saved_loc).abs().max()) <= 0.1 + 1e-6


def prior_only_model():
    """Latent sites and no data: the mean-field ELBO's loss is the sum of the sites' KLs."""
    pyro.sample("a", dist.Normal(torch.zeros(2, 4), 1.0).to_event(2))
    with pyro.plate("plate", 3):
        pyro.sample("c", dist.Normal(torch.zeros(2), 2.0).to_event(1))


@pytest.fixture
def quiet_jit():
    # The tracer warns about Python control flow on shapes (static here) and torch deprecates
    # torch.jit.trace itself; Pyro's JIT ELBOs still use it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_jit_mean_field_elbo_compiles_the_exact_kl(quiet_jit, guide_cls):
    # Under torch.jit.trace a site's event shape holds traced sizes: the Radial KL and entropy
    # must still see the number of weights as a number.
    guide = guide_cls(prior_only_model, init_scale=0.3)
    guide()
    with torch.no_grad():
        guide.loc.uniform_(-1.0, 1.0)
    elbo = JitTraceMeanField_ELBO()
    params = list(guide.parameters())
    eager = TraceMeanField_ELBO().differentiable_loss(prior_only_model, guide)
    expected_grads = torch.autograd.grad(eager, params)
    kl = sum(
        kl_divergence(guide.get_posterior(name), prior).sum()
        for name, prior in [
            ("a", dist.Normal(torch.zeros(2, 4), 1.0).to_event(2)),
            ("c", dist.Normal(torch.zeros(3, 2), 2.0).to_event(1)),
        ]
    )
    for _ in range(2):  # the first call compiles, the second runs the compiled graph
        loss = elbo.loss_and_grads(prior_only_model, guide)
        # The loss is the closed-form KL: exact but for float32 rounding of a sum of order 10.
        assert loss == pytest.approx(float(kl.detach()), rel=1e-5)
        grads = [p.grad for p in params]
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want)
        for p in params:
            p.grad = None


def test_radial_entropy_and_kl_trace(quiet_jit):
    loc, scale = torch.randn(2, 4), torch.rand(2, 4) + 0.5
    prior = dist.Normal(torch.zeros(2, 4), 1.0).to_event(2)

    def terms(loc):
        q = Radial(loc, scale)
        return q.entropy(), kl_divergence(q, prior)

    traced = torch.jit.trace(terms, (loc,))
    for got, want in zip(traced(loc + 1.0), terms(loc + 1.0)):
        torch.testing.assert_close(got, want)
