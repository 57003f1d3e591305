"""The location-scale guides under more of Pyro's idioms: the param store saved and loaded around
a guide that is already set up."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO

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
