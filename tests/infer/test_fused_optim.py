"""FusedOptim: one torch optimizer over every parameter, on the trajectory of Pyro's
per-parameter optimizers."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint
from pyro_bdl.distributed import DataParallelSVI
from pyro_bdl.infer import FusedOptim

N, STEPS, ABSENT = 64, 20, (3, 4, 11)
CLIP = {"clip_norm": 0.5, "clip_value": 0.02}


def _setup():
    """A lifted 3-8-2 MLP with a mean-field guide, plus a model parameter ``shift`` that the
    steps in ``ABSENT`` do not use (so SVI does not pass it to the optimizer there)."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = bdl.bayesianize(
        nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)), bdl.priors.Normal(scale=1.0)
    )

    def model(x, y, shift=True):
        logits = bnn(x)
        if shift:
            logits = logits + pyro.param("shift", torch.zeros(2))
        with pyro.plate("data", N, subsample_size=len(x)):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    guide = bdl.guides.AutoMeanField(model, init_scale=0.05)
    x = torch.randn(N, 3)
    y = (x[:, 0] > 0).long()
    guide(x[:2], y[:2])  # its set-up draws random numbers: out of the seeded steps
    return model, guide, x, y


def _train(optim, steps=range(STEPS), state=None, setup=None):
    model, guide, x, y = setup or _setup()
    if state is not None:
        optim.set_state(state)
    svi = SVI(model, guide, optim, Trace_ELBO())
    for k in steps:
        pyro.set_rng_seed(k)
        b = slice(8 * (k % 8), 8 * (k % 8) + 8)
        svi.step(x[b], y[b], shift=k not in ABSENT)
    store = pyro.get_param_store()
    return {name: p.detach().clone() for name, p in store.named_parameters()}


def _assert_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        # Bit for bit: each parameter's update is the same sequence of element-wise operations
        # on the same numbers in both; torch's multi-tensor (foreach) kernels apply per tensor
        # exactly the arithmetic of the per-parameter loop, so no round-off can differ.
        assert torch.equal(a[name], b[name]), name


PAIRS = [
    (lambda: pyro.optim.Adam({"lr": 0.05}), lambda: FusedOptim(torch.optim.Adam, {"lr": 0.05})),
    (
        lambda: pyro.optim.SGD({"lr": 0.01, "momentum": 0.9}),
        lambda: FusedOptim(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    ),
    (
        # Per-parameter arguments: the model's shift and the guide's parameters form two groups.
        lambda: pyro.optim.Adam(lambda name: {"lr": 0.1 if name == "shift" else 0.02}),
        lambda: FusedOptim(torch.optim.Adam, lambda name: {"lr": 0.1 if name == "shift" else 0.02}),
    ),
    (
        lambda: pyro.optim.PyroOptim(torch.optim.SGD, {"lr": 0.05}, dict(CLIP)),
        lambda: FusedOptim(torch.optim.SGD, {"lr": 0.05}, dict(CLIP)),
    ),
]


@pytest.mark.parametrize("pair", PAIRS, ids=["adam", "sgd_momentum", "per_param", "clip"])
def test_same_trajectory_as_pyro(pair):
    per_param, fused = pair
    expected = _train(per_param())
    optim = fused()
    actual = _train(optim)
    _assert_equal(actual, expected)
    assert optim.optimizer is not None
    assert len(optim.optimizer.param_groups) == (2 if pair is PAIRS[2] else 1)
    assert all(g["foreach"] for g in optim.optimizer.param_groups)


def test_absent_parameter_does_not_move_or_age():
    model, guide, x, y = _setup()
    optim = FusedOptim(torch.optim.Adam, {"lr": 0.05})
    svi = SVI(model, guide, optim, Trace_ELBO())
    svi.step(x, y)
    shift = pyro.param("shift").unconstrained()
    before, step = shift.detach().clone(), optim.get_state()["shift"]["state"][0]["step"].clone()
    # A stale gradient on the absent parameter must not be used either.
    shift.grad = torch.ones_like(shift)
    svi.step(x, y, shift=False)
    assert torch.equal(shift.detach(), before)
    assert torch.equal(optim.get_state()["shift"]["state"][0]["step"], step)
    assert torch.equal(shift.grad, torch.ones_like(shift))  # left as it was
    loc = next(p for n, p in pyro.get_param_store().named_parameters() if n != "shift")
    assert loc.grad is None  # the stepped parameters' gradients are freed


@pytest.mark.parametrize("fused_first", [True, False])
def test_state_round_trip_mid_training(fused_first):
    """Stopping after 10 steps and restoring the state into a new optimizer (fused, or Pyro's
    per-parameter one: the state has the same form) continues exactly like the unbroken run."""
    expected = _train(FusedOptim(torch.optim.Adam, {"lr": 0.05}))
    first = (
        FusedOptim(torch.optim.Adam, {"lr": 0.05}) if fused_first else pyro.optim.Adam({"lr": 0.05})
    )
    _train(first, steps=range(10))
    params = {n: p.detach().clone() for n, p in pyro.get_param_store().named_parameters()}
    state = copy.deepcopy(first.get_state())
    setup = _setup()
    with torch.no_grad():  # in place: the guide holds these very tensors
        for name, p in pyro.get_param_store().named_parameters():
            p.copy_(params[name])
    second = (
        pyro.optim.Adam({"lr": 0.05}) if fused_first else FusedOptim(torch.optim.Adam, {"lr": 0.05})
    )
    _assert_equal(_train(second, steps=range(10, STEPS), state=state, setup=setup), expected)


def test_set_state_on_held_parameters_and_save_load(tmp_path):
    """``load`` (``set_state``) reaches the parameters the optimizer already holds, and gives
    back exactly the state that ``save`` wrote."""
    optim, setup = FusedOptim(torch.optim.Adam, {"lr": 0.05}), _setup()
    _train(optim, steps=range(5), setup=setup)
    saved = copy.deepcopy(optim.get_state())
    optim.save(str(tmp_path / "optim.pt"))
    _train(optim, steps=range(5, 8), setup=setup)
    optim.load(str(tmp_path / "optim.pt"))
    after = optim.get_state()
    assert after.keys() == saved.keys()
    for name, s in saved.items():
        for key, value in s["state"][0].items():
            assert torch.equal(after[name]["state"][0][key], value), (name, key)
    # Still one group: the reloaded parameters rejoined the group of their hyperparameters.
    assert optim.optimizer is not None and len(optim.optimizer.param_groups) == 1


def test_checkpoint_resume_matches_unbroken_run(tmp_path):
    expected = _train(FusedOptim(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}))
    optim = FusedOptim(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})
    setup = _setup()
    _train(optim, steps=range(10), setup=setup)
    save_checkpoint(tmp_path / "run.ckpt", guide=setup[1], optim=optim, step=10)
    setup = _setup()
    optim = FusedOptim(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})
    load_checkpoint(tmp_path / "run.ckpt", guide=setup[1], optim=optim)
    _assert_equal(_train(optim, steps=range(10, STEPS), setup=setup), expected)


def test_data_parallel_svi_accepts_it():
    model, guide, x, y = _setup()
    svi = DataParallelSVI(
        model, guide, FusedOptim(torch.optim.Adam, {"lr": 0.05}), Trace_ELBO(), seed=0
    )
    before = {n: p.detach().clone() for n, p in pyro.get_param_store().named_parameters()}
    svi.step(x, y)
    after = dict(pyro.get_param_store().named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before)


def test_refusals():
    with pytest.raises(TypeError, match=r"scheduler ExponentialLR.*PyroLRScheduler"):
        FusedOptim(torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.9})
    with pytest.raises(TypeError, match="not Pyro's wrapper"):
        FusedOptim(pyro.optim.Adam, {"lr": 1e-3})
    with pytest.raises(TypeError, match="optim_args must be a dict"):
        FusedOptim(torch.optim.Adam, [("lr", 1e-3)])
    with pytest.raises(TypeError, match="clip_args must be a dict"):
        FusedOptim(torch.optim.Adam, {"lr": 1e-3}, lambda module, name: {"clip_norm": 1.0})
    with pytest.raises(ValueError, match=r"clip_norm and clip_value; got \['norm'\]"):
        FusedOptim(torch.optim.Adam, {"lr": 1e-3}, {"norm": 1.0})
