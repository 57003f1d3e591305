# ruff: noqa: E501  (the expected messages are matched whole)
"""VOGN and IVON refuse bad steps, states and hyperparameters with our message, before anything
changes: a candidate state is checked before it is committed, inputs are checked before the model
runs, a state_dict of another model loaded before the first step is discarded when refused, and
non-finite states are refused by load_state_dict and load_checkpoint."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint
from pyro_bdl.infer import IVON, VOGN
from tests.faults.common import assert_same, rng_states

N = 32
METHODS = {"VOGN": VOGN, "IVON": IVON}


def regression(width: int = 3, seed: int = 0):
    """A linear regressor in float32 (no saturating layer, so large inputs give large gradients)
    and its data."""
    torch.manual_seed(seed)
    net = bayesianize(nn.Sequential(nn.Linear(width, 1), nn.Flatten(0)), priors.Normal(scale=1.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, width, generator=g)
    return net, models.regressor(net, N, 0.3), x, torch.sin(x[:, 0])


def snapshot(method, net: nn.Module) -> dict:
    """Everything a refused step or load must leave as it was."""
    return {
        "state": method.state_dict() if not method.needs_setup else None,
        "pending": method._pending,
        "guide": {k: v.clone() for k, v in method.guide.state_dict().items()},
        "net": {k: v.clone() for k, v in net.state_dict().items()},
        "optimizer": method.optimizer.state_dict(),
        "store": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
        "rng": rng_states(),
    }


def stepped(cls, **kwargs):
    """(net, x, y, method) after one good step of ``cls`` on :func:`regression`."""
    net, model, x, y = regression()
    method = cls(model, dataset_size=N, **kwargs)
    method.step(x, y)
    return net, x, y, method


def assert_refused(method, net, call, error: type, match: str) -> None:
    """``call()`` raises ``error`` matching ``match`` and changes nothing."""
    before = snapshot(method, net)
    with pytest.raises(error, match=match):
        call()
    assert_same(before, snapshot(method, net))


@pytest.fixture(autouse=True)
def _clear_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def test_an_ivon_update_that_would_write_inf_into_the_curvature_is_refused_and_recoverable():
    net, x, y, ivon = stepped(IVON)
    # x·1e12 gives ĝ ~ 1e25 and ĥ ~ 1e26, finite in float32, but the update's (h − ĥ)² ~ 1e52
    # is not: before the fix the step returned a loss and wrote NaN into h.
    assert_refused(
        ivon,
        net,
        lambda: ivon.step(x * 1e12, y),
        FloatingPointError,
        r"IVON step 2: the update would make the curvature of weights non-finite; the step was refused and nothing was updated",
    )
    assert ivon.step_count == 1
    loss = ivon.step(x, y)  # the run goes on: nothing bad was written
    assert ivon.step_count == 2 and bool(torch.isfinite(ivon.state.curvature).all())
    assert math.isfinite(loss)


def test_a_vogn_update_that_would_overflow_the_mean_is_refused():
    net, x, y, vogn = stepped(VOGN, lr=1e-3)
    before = snapshot(vogn, net)
    # α·m/(s + δ̃) with α = 1e38 overflows float32 in μ: the candidate μ is inf.
    vogn.optimizer.param_groups[0]["lr"] = 1e38
    with pytest.raises(
        FloatingPointError,
        match=r"VOGN step 2: the update would make the mean of weights non-finite",
    ):
        vogn.step(x, y)
    vogn.optimizer.param_groups[0]["lr"] = 1e-3  # the only change, made by the test
    assert_same(before, snapshot(vogn, net))
    vogn.step(x, y)
    assert vogn.step_count == 2


@pytest.mark.parametrize("name", METHODS)
def test_a_state_dict_of_another_architecture_loaded_before_the_first_step_is_discarded(name):
    _, other_model, xo, yo = regression(width=5)
    donor = METHODS[name](other_model, dataset_size=N)
    donor.step(xo, yo)
    state = donor.state_dict()
    pyro.clear_param_store()
    net, model, x, y = regression()
    method = METHODS[name](model, dataset_size=N)
    method.load_state_dict(state)  # the sites are unknown until the model is read
    before = snapshot(method, net)
    with pytest.raises(
        ValueError,
        match=rf"{name} step 1: the state_dict loaded before the first step does not fit this model: the state_dict is from a different model: mismatching sites .* It was discarded, and nothing else changed",
    ):
        method.step(x, y)
    assert_same({**before, "pending": None}, snapshot(method, net))
    method.step(x, y)  # usable again: the next step starts afresh
    assert method.step_count == 1


def _broken(state: dict, key: str, value: float, index: int = 0) -> dict:
    broken = {**state, key: state[key].clone()}
    broken[key][index] = value
    return broken


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (
            "curvature",
            float("nan"),
            r"'curvature' holds 1 non-finite value\(s\) \(NaN or inf\), the first at index \(2,\)",
        ),
        ("momentum", float("inf"), r"'momentum' holds 1 non-finite value\(s\)"),
        ("mean", float("-inf"), r"'mean' holds 1 non-finite value\(s\)"),
    ],
)
def test_a_non_finite_state_dict_is_refused_by_load_state_dict(name, key, value, match):
    net, _, _, method = stepped(METHODS[name])
    state = _broken(method.state_dict(), key, value, index=2)
    damaged = rf"the {name} state_dict is damaged: {match}"
    assert_refused(method, net, lambda: method.load_state_dict(state), ValueError, damaged)
    # Before the first step too: refused at load time, nothing held pending.
    fresh = METHODS[name](method.model, dataset_size=N)
    with pytest.raises(ValueError, match=rf"the {name} state_dict is damaged: {match}"):
        fresh.load_state_dict(state)
    assert fresh._pending is None


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (
            VOGN,
            r"the VOGN state_dict is damaged: 'curvature' must be >= 0 \(a mean of squared gradients\); got -1.0",
        ),
        # IVON's h may be negative while h + δ > 0 (δ = 1/N here); -1 makes σ NaN.
        (
            IVON,
            r"the IVON state_dict's curvature gives a posterior scale σ that is not finite and > 0 at 1 weight\(s\) \(the first at index 0, curvature -1.0\)",
        ),
    ],
)
def test_a_negative_precision_is_refused(cls, match):
    net, _, _, method = stepped(cls)
    state = _broken(method.state_dict(), "curvature", -1.0)
    assert_refused(method, net, lambda: method.load_state_dict(state), ValueError, match)


def test_load_checkpoint_refuses_a_nan_curvature(tmp_path):
    net, _, _, ivon = stepped(IVON)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, modules={"ivon": ivon})
    payload = torch.load(path, weights_only=True)
    payload["modules"]["ivon"]["curvature"][1] = float("nan")
    # A state that was NaN when saved (not damaged after): the file's checksums are left out, as
    # in a file written by an earlier release, so that the state check itself is what refuses.
    payload.pop("checksums", None)
    torch.save(payload, path)
    assert_refused(
        ivon,
        net,
        lambda: load_checkpoint(path, modules={"ivon": ivon}),
        ValueError,
        r"cannot be restored; nothing was changed:\n  - module 'ivon': the IVON state_dict is damaged: 'curvature' holds 1 non-finite value",
    )


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (
            IVON,
            {"ess": 1e-40},
            r"IVON: ess must be a finite number in \[0.001, 1e\+12\]; got 1e-40",
        ),
        (
            IVON,
            {"ess": float("nan")},
            r"IVON: ess must be a finite number in \[0.001, 1e\+12\]; got nan",
        ),
        (
            IVON,
            {"hess_init": 0.0},
            r"IVON: hess_init must be a finite number in \[1e-12, 1e\+12\]; got 0.0",
        ),
        (IVON, {"lr": float("nan")}, r"lr must be finite and > 0; got nan"),
        (IVON, {"betas": (0.9, 1.0)}, r"betas\[1\] \(beta2\) must lie in \[0, 1\); got 1.0"),
        (IVON, {"num_particles": 0}, r"num_particles must be >= 1; got 0"),
        (
            VOGN,
            {"augmentation_factor": 1e-9},
            r"VOGN: augmentation_factor must be a finite number in \[0.001, 1e\+06\]; got 1e-09",
        ),
        (VOGN, {"betas": (-0.1, 0.9)}, r"betas\[0\] \(beta1\) must lie in \[0, 1\); got -0.1"),
        (VOGN, {"prior_precision": 0.0}, r"prior_precision must be finite and > 0; got 0.0"),
        (VOGN, {"damping": -1.0}, r"damping must be a finite number >= 0; got -1.0"),
    ],
)
def test_hyperparameters_are_checked_at_construction(cls, kwargs, match):
    _, model, _, _ = regression()
    with pytest.raises(ValueError, match=match):
        cls(model, dataset_size=N, **kwargs)


@pytest.mark.parametrize("name", METHODS)
def test_a_nan_batch_is_refused_with_our_message_before_the_model_runs(name):
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), priors.Normal())

    def model(x, y=None, *, weights=None):  # hand-written: Pyro would name 'logits'
        logits = net(x)
        with pyro.plate("data", N, subsample_size=x.shape[0]):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g)
    y = (x[:, 0] > 0).long()
    method = METHODS[name](model, dataset_size=N)
    method.step(x, y)
    bad = x.clone()
    bad[5, 1] = float("nan")
    before = snapshot(method, net)
    with pytest.raises(
        ValueError,
        match=rf"{name} step 2: the argument args\[0\] contains 1 non-finite value\(s\) \(NaN or inf\); the first is at index \(5, 1\)\..* Nothing was updated",
    ):
        method.step(bad, y)
    assert_same(before, snapshot(method, net))
    with pytest.raises(ValueError, match=r"the argument weights=\[1\] contains 1 non-finite"):
        method.step(x, y, weights=[torch.ones(2), torch.tensor([0.0, float("inf")])])
    assert_same(before, snapshot(method, net))
    # Before the first step too: nothing set up, nothing in the param store.
    fresh = METHODS[name](model, dataset_size=N)
    before = snapshot(fresh, net)
    with pytest.raises(ValueError, match=rf"{name} step 1: the argument args\[0\]"):
        fresh.step(bad, y)
    assert fresh.needs_setup
    assert_same(before, snapshot(fresh, net))


def test_vogn_warns_when_its_curvature_averages_a_single_example():
    # B = 1 with β₂ = 0.999 (Adam's habit; ours weights the new ĥ): s is one example's squared
    # gradient, 0 wherever that example does not reach (here a zero input column), where the
    # step is α·m/δ̃.
    _, model, x, y = regression()
    x[:, 2] = 0.0
    vogn = VOGN(model, dataset_size=N, betas=(0.9, 0.999))
    with pytest.warns(
        UserWarning,
        match=r"VOGN step 1: batch size 1 with betas\[1\] = 0.999: the curvature s ← \(1 − β₂\)s \+ β₂ĥ holds about B/β₂ = 1 example\(s\) of squared gradients.* a batch size of 16 or more, or a smaller betas\[1\]",
    ):
        vogn.step(x[:1], y[:1])
    vogn.step(x[1:2], y[1:2])  # once per run: no second warning (errors under filterwarnings)
    averaged = VOGN(model, dataset_size=N)
    averaged.step(x[:1], y[:1])  # the default β₂ = 0.01, about 100 examples' worth: no warning
