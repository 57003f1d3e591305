"""The vectorized paths keep the old promises: a refusal names its cause and fix and changes
nothing (docs/design/README.md)."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.predictive import sample_outputs


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def _assert_unchanged(net: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = net.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def _setup(net: nn.Module):
    def model(x):
        return net(x)

    guide = AutoNormal(model)
    x = torch.randn(5, 3)
    with torch.no_grad():
        guide(x)
    return model, guide, x


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python control flow: vmap cannot batch it
            return y
        return -y


def _causes(err: BaseException) -> list[BaseException]:
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__
    return chain


def test_parallel_predictive_explains_data_dependent_control_flow():
    pyro.set_rng_seed(0)
    net = bdl.bayesianize(_Branching())
    model, guide, x = _setup(net)
    before = _state(net)
    with pytest.raises(RuntimeError) as info:
        Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
    ours = [e for e in _causes(info.value) if "cannot run vectorized" in str(e)]
    assert ours, str(info.value)
    message = str(ours[0])
    assert "data-dependent" in message or "branches in Python" in message
    assert "parallel=False" in message and "vectorize_particles=False" in message
    # chained to vmap's own error
    assert isinstance(ours[0].__cause__, RuntimeError)
    assert "vmap" in str(ours[0].__cause__)
    _assert_unchanged(net, before)
    # the sequential path the message names works
    out = Predictive(model, guide=guide, num_samples=2, parallel=False, return_sites=["_RETURN"])(x)
    assert out["_RETURN"].shape == (2, 5, 2)


def test_sample_outputs_refuses_too_many_samples_before_allocating():
    pyro.set_rng_seed(0)
    net = bdl.bayesianize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).eval()
    model, guide, x = _setup(net)
    before = _state(net)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    # 10**7 draws of a (5, 2) float32 output: 4e8 bytes, above a 1e8-byte bound.
    needed = 10**7 * 5 * 2 * 4
    for parallel in (True, False):
        rng = torch.get_rng_state()
        with pytest.raises(ValueError) as info:
            sample_outputs(model, guide, x, num_samples=10**7, parallel=parallel, max_memory=10**8)
        message = str(info.value)
        assert "num_samples=10000000" in message
        assert str(needed) in message and "max_memory=100000000" in message
        assert "at most 2500000 samples" in message and "batches" in message
        _assert_unchanged(net, before)
        for key, value in params.items():
            assert torch.equal(pyro.get_param_store()[key], value), key
        assert torch.equal(torch.get_rng_state(), rng)


def test_sample_outputs_check_does_not_change_the_draws():
    net = bdl.bayesianize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).eval()
    model, guide, x = _setup(net)
    pyro.set_rng_seed(1)
    low = sample_outputs(model, guide, x, num_samples=6, max_memory=6 * 5 * 2 * 4)
    with pytest.raises(ValueError, match=r"num_samples=7 .* need 280 bytes"):
        sample_outputs(model, guide, x, num_samples=7, max_memory=6 * 5 * 2 * 4)
    pyro.set_rng_seed(1)
    again = sample_outputs(model, guide, x, num_samples=6)
    assert torch.equal(low, again)
    with pytest.raises(ValueError, match="max_memory"):
        sample_outputs(model, guide, x, num_samples=6, max_memory=0)


# ------------------------------------------- training-mode BatchNorm under a vectorized pass


def _batchnorm_classifier():
    pyro.set_rng_seed(0)
    net = bdl.bayesianize(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    model = bdl.models.classifier(net, dataset_size=20)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    guide = bdl.guides.AutoMeanField(model)
    guide(x, y)  # set up: the inspection passes below are Pyro's own, not the guide's
    return net, model, guide, x, y


_REFUSED = r"BatchNorm layer '1' is in training mode.*eval\(\).*Nothing was updated"


def _refused_calls(model, guide, x, y):
    return {
        "Predictive(parallel=True)": lambda: Predictive(
            model, guide=guide, num_samples=3, parallel=True
        )(x),
        "Trace_ELBO(vectorize_particles=True)": lambda: pyro.infer.SVI(
            model,
            guide,
            pyro.optim.Adam({"lr": 0.1}),
            pyro.infer.Trace_ELBO(num_particles=3, vectorize_particles=True),
        ).step(x, y),
        # Our ELBO's loss (no step, so no step rollback): the network's own undo is what acts.
        "TraceSuffStat_ELBO(vectorize_particles=True).loss": lambda: bdl.infer.TraceSuffStat_ELBO(
            num_particles=3, vectorize_particles=True
        ).loss(model, guide, x, y),
    }


@pytest.mark.parametrize(
    "call",
    [
        "Predictive(parallel=True)",
        "Trace_ELBO(vectorize_particles=True)",
        "TraceSuffStat_ELBO(vectorize_particles=True).loss",
    ],
)
@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "after-a-training-step"])
def test_a_refused_vectorized_pass_leaves_the_running_statistics_as_they_were(call, trained):
    # Pyro's unvectorized inspection passes run before the vectorized pass and, in training
    # mode, write the running statistics; the refusal puts them back. A training step before
    # the call is kept: it is not the call's.
    net, model, guide, x, y = _batchnorm_classifier()
    set_up = int(net[1].num_batches_tracked)  # the guide's set-up pass ran the model
    if trained:
        svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), pyro.infer.Trace_ELBO())
        svi.step(x, y)
        svi.step(x, y)
    before = _state(net)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(RuntimeError, match=_REFUSED):
        _refused_calls(model, guide, x, y)[call]()
    _assert_unchanged(net, before)
    for key, value in params.items():
        assert torch.equal(pyro.get_param_store()[key], value), key
    # The kept steps did write the statistics.
    assert int(net[1].num_batches_tracked) == set_up + (2 if trained else 0)
    # The fix the message names works.
    net.eval()
    out = Predictive(model, guide=guide, num_samples=3, parallel=True, return_sites=["_RETURN"])
    assert out(x)["_RETURN"].shape == (3, 8, 2)


def test_a_refusal_keeps_the_statistics_a_forward_outside_pyro_wrote_before_it():
    # A forward outside Pyro between two refused calls is the user's: the second refusal puts
    # back the state after it, not the state before the first call.
    net, model, guide, x, _ = _batchnorm_classifier()
    predictive = Predictive(model, guide=guide, num_samples=3, parallel=True)
    with pytest.raises(RuntimeError, match=_REFUSED):
        predictive(x)
    net(x)  # the user's own forward in training mode, outside Pyro
    after_user = _state(net)
    with pytest.raises(RuntimeError, match=_REFUSED):
        predictive(x)
    _assert_unchanged(net, after_user)
