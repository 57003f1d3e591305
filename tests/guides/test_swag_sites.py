"""AutoSWAG and a model whose sites changed (Pyro's idiom of a model that grows): refused with a
message naming the sites, before anything is set up."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_bdl as bdl
from pyro_bdl.guides.access import SiteSetChangedError


def _model(grown: bool):
    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        if grown:
            pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.tensor(0.3))

    return model


def test_a_new_guide_of_a_grown_model_refuses_the_stored_parameters_and_changes_nothing():
    old = bdl.guides.AutoSWAG(_model(False))
    SVI(_model(False), old, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step()
    store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    new = bdl.guides.AutoSWAG(_model(True))
    for _ in range(2):  # refused every time: nothing is left half set up
        with pytest.raises(SiteSetChangedError, match=r"hold 2 numbers.*\('a', 'b'\) need 5"):
            new()
        assert new.prototype_trace is None
    after = dict(pyro.get_param_store().items())
    assert store.keys() == after.keys()
    assert all(torch.equal(store[k], after[k]) for k in store)

    # The fix the message gives works.
    pyro.clear_param_store()
    assert set(new()) == {"a", "b"}
