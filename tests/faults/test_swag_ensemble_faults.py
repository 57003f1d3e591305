"""Refused inputs of AutoSWAG, AutoEnsemble and AutoMultiSWAG change nothing: members of another
model (on the first call and every later one), NaN members in a state dict, guides that share
their parameters, non-finite weights at collect(). Each refusal is checked for its error type
and message, and the guide's state dict, Pyro's param store and the random states are compared
bit for bit before and after."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl.guides import AutoEnsemble, AutoSWAG
from pyro_bdl.guides.state_checks import StateDictMismatchError
from tests.faults.common import assert_same, rng_states
from tests.guides.test_contract import BATCH, data, small_model


def snapshot(guide) -> dict:
    store = pyro.get_param_store()
    if getattr(guide, "_values", None) is not None:
        # An ensemble not set up refuses state_dict(): its members wait unpacked until then.
        state = {
            f"{k}.{name}": v.clone() for k, vs in enumerate(guide._values) for name, v in vs.items()
        }
    else:
        state = {k: v.clone() for k, v in guide.state_dict().items()}
    return {
        "state": state,
        "store": {k: store.get_param(k).detach().clone() for k in store.keys()},
        "rng": rng_states(),
    }


def _members(count: int = 2) -> list[dict[str, torch.Tensor]]:
    x, y = data()
    out = []
    for k in range(count):
        pyro.set_rng_seed(k)
        pyro.clear_param_store()
        model = small_model(k)
        guide = AutoDelta(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
        svi.step(x[:BATCH], y[:BATCH])
        out.append(guide.median())
    return out


def _extra(values):
    return {**values, "bogus": torch.zeros(2)}


def _missing(values):
    return {k: v for k, v in values.items() if k != "0.bias"}


def _wider(values):
    return {**values, "0.bias": torch.zeros(values["0.bias"].shape[0] + 1)}


@pytest.mark.parametrize(
    "change, message",
    [
        (_extra, r"members\[0\] has sites \['bogus'\] that the model does not sample"),
        (_missing, r"0\.bias"),
        (_wider, r"0\.bias"),
    ],
    ids=["extra site", "missing site", "other width"],
)
def test_members_of_another_model_are_refused_on_every_call(change, message):
    x, y = data()
    model = small_model(0)
    guide = AutoEnsemble(model, [change(v) for v in _members()])
    before = snapshot(guide)
    for _ in range(2):
        # The same refusal every time: the set-up is all or nothing (never KeyError later).
        with pytest.raises(ValueError, match=message):
            guide(x, y)
        assert guide.prototype_trace is None
        assert_same(before, snapshot(guide))
        # member_outputs does not set the guide up (prediction arguments lack the targets).
        with pytest.raises(RuntimeError, match=r"before member_outputs"):
            guide.member_outputs(model, x, y)
        assert_same(before, snapshot(guide))


def test_ensemble_load_refuses_nan_members_and_changes_nothing():
    x, y = data()
    guide = AutoEnsemble(small_model(0), _members())
    guide(x, y)
    state = {k: v.clone() for k, v in guide.state_dict().items()}
    state["ensemble_locs"][1, 3] = float("nan")
    before = snapshot(guide)
    with pytest.raises(
        StateDictMismatchError, match=r"'ensemble_locs': members \[1\] contain NaN or inf"
    ):
        guide.load_state_dict(state)
    assert_same(before, snapshot(guide))


def test_guides_sharing_their_parameters_are_refused():
    x, y = data()
    pyro.clear_param_store()
    guides = []
    for k in range(2):  # no clear_param_store between: the second trains the first's tensors
        pyro.set_rng_seed(k)
        model = small_model(k)
        guide = AutoDelta(model)
        SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO()).step(x[:BATCH], y[:BATCH])
        guides.append(guide)
    store = pyro.get_param_store()
    before = {k: store.get_param(k).detach().clone() for k in store.keys()}
    rng = rng_states()
    with pytest.raises(ValueError, match=r"members\[0\] and members\[1\] share their parameter"):
        AutoEnsemble(model, guides)
    assert_same(before, {k: store.get_param(k).detach().clone() for k in store.keys()})
    assert_same(rng, rng_states())


def test_collect_refuses_non_finite_weights_from_pyro_svi_without_validation():
    x, y = data()
    pyro.clear_param_store()
    model = small_model(0)
    guide = AutoSWAG(model, rank=2)
    SVI(model, guide, pyro.optim.SGD({"lr": 1e-2}), Trace_ELBO()).step(x, y)
    guide.collect()
    with pyro.validation_enabled(False):
        # Pyro's SVI takes a step that overflows (inf · gradient): the point estimate is not
        # finite now, and nothing in Pyro's loop says so.
        SVI(model, guide, pyro.optim.SGD({"lr": float("inf")}), Trace_ELBO()).step(x, y)
    assert not torch.isfinite(guide.loc).all()
    before = snapshot(guide)
    with pytest.raises(ValueError, match=r"collect\(\): the weights contain NaN or inf"):
        guide.collect()
    assert_same(before, snapshot(guide))
    assert guide.num_collected == 1
