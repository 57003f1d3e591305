"""Everyday PyTorch idioms around a Laplace guide: copying and pickling it, a network with some
layers held in eval mode, the global random state, converting the network or the guide alone to
another dtype, and the public curvature helpers under ``torch.no_grad()``."""

from __future__ import annotations

import copy
import io
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.curvature import ParamSlot, diagonal_ggn, output_hessian_factor, subnet_jacobian
from pyro_bdl.guides import AutoSubnetLaplace

SETTINGS = {
    "kron": dict(subnetwork="all", hessian_structure="kron"),
    "full_last_layer": dict(subnetwork="last_layer"),
    "diag": dict(subnetwork="all", hessian_structure="diag"),
}


def _torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": _torch_save,
}


def _data(n: int = 32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return x, (x[:, 0] > 0).long()


def _net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(1)
    norm = [nn.BatchNorm1d(8)] if batchnorm else []
    return nn.Sequential(nn.Linear(3, 8), *norm, nn.Tanh(), nn.Linear(8, 2))


def _guide(net: nn.Module | None = None, **settings) -> AutoSubnetLaplace:
    lifted = bdl.bayesianize(net if net is not None else _net())
    guide = AutoSubnetLaplace(bdl.models.classifier(lifted, 32), prior_precision=1.0, **settings)
    guide(*_data())
    return guide


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_copy_of_a_fitted_guide_predicts_alone_and_leaves_the_original_whole(name, how):
    """Pyro's ``AutoGuide.__getstate__`` cleared the model on the original itself: after a
    ``deepcopy``, ``pickle.dumps`` or ``torch.save`` the original (and the copy) raised
    "'NoneType' object is not subscriptable" in fit and predict."""
    x, y = _data()
    guide = _guide(**SETTINGS[name]).fit((x, y), check_mode=False)
    before = guide.predict(x)
    twin = COPIES[how](guide)
    assert torch.equal(guide.predict(x), before)
    assert torch.equal(twin.predict(x), before)
    pyro.set_rng_seed(3)
    expected = guide.get_posterior().sample((2,))
    pyro.set_rng_seed(3)
    assert torch.equal(twin.get_posterior().sample((2,)), expected)
    # Refitting the copy on other rows changes the copy alone: no storage is shared.
    twin.fit((x[:12], y[:12]), check_mode=False)
    assert not torch.equal(twin.predict(x), before)
    assert torch.equal(guide.predict(x), before)


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_of_an_unfitted_guide_fits_as_the_original_does(how):
    x, y = _data()
    guide = _guide(**SETTINGS["kron"])
    twin = COPIES[how](guide)
    expected = guide.fit((x, y), check_mode=False).predict(x)
    assert torch.equal(twin.fit((x, y), check_mode=False).predict(x), expected)


def _closure_model():
    net = bdl.bayesianize(_net())

    def model(x, y=None):
        logits = net(x)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    return model, _data()


def _lambda_split_model():
    x, _ = _data()
    net = bdl.bayesianize(_net())  # two outputs: the mean and s, σ² = softplus(s)
    split = lambda out: (out[:, 0], torch.log(nn.functional.softplus(out[:, 1])))  # noqa: E731
    return bdl.models.heteroscedastic_regressor(net, 32, split=split), (x, x[:, 0])


def _flat(prediction) -> torch.Tensor:
    """Probabilities, or a regression's (mean, variance), as one vector."""
    parts = prediction if isinstance(prediction, tuple) else (prediction,)
    return torch.cat([t.reshape(-1) for t in parts])


@pytest.mark.parametrize("make", [_closure_model, _lambda_split_model])
def test_a_copy_without_its_model_refuses_to_predict_with_the_fix(make):
    """A model that does not pickle (a closure, a NetworkModel with a lambda) is left out of a
    pickled guide, as Pyro does, and the copy says how to get a guide that predicts."""
    model, (x, y) = make()
    guide = AutoSubnetLaplace(model, subnetwork="all", prior_precision=1.0)
    guide(x, y)
    guide.fit((x, y), check_mode=False)
    generator = torch.Generator().manual_seed(0)
    before = _flat(guide.predict(x, generator=generator))
    twin = pickle.loads(pickle.dumps(guide))
    with pytest.raises(RuntimeError, match=r"without its model.*state_dict"):
        twin.predict(x)
    pyro.set_rng_seed(3)
    expected = guide.get_posterior().sample()
    pyro.set_rng_seed(3)
    assert torch.equal(twin.get_posterior().sample(), expected)  # it still samples
    generator.manual_seed(0)
    assert torch.equal(_flat(guide.predict(x, generator=generator)), before)


def _modes(net: nn.Module) -> list[bool]:
    return [m.training for m in net.modules()]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_fit_and_predict_give_every_layer_its_own_mode_back(name):
    """A network in training mode with a frozen (eval-mode) BatchNorm came back with the
    BatchNorm in training mode: the mode was restored with net.train()."""
    x, y = _data()
    net = _net(batchnorm=True)
    guide = _guide(net, **SETTINGS[name])
    net.train()
    net[1].eval()
    held = _modes(net)
    guide.fit((x, y), check_mode=False)
    assert _modes(net) == held
    guide.predict(x)
    assert _modes(net) == held
    with pytest.raises(ValueError, match="class labels"):
        guide.fit((x, torch.full_like(y, 7)), check_mode=False)
    assert _modes(net) == held


@pytest.mark.parametrize("name", list(SETTINGS))
def test_predict_leaves_the_global_random_state_as_it_was(name):
    """The model run without targets drew them from the global generator: a probit predict
    (deterministic) moved the random state of everything after it."""
    x, y = _data()
    guide = _guide(**SETTINGS[name]).fit((x, y), check_mode=False)
    torch.manual_seed(9)
    guide.predict(x)
    after = torch.rand(3)
    torch.manual_seed(9)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize("converted", ["net", "guide"])
def test_a_network_and_a_guide_of_different_dtypes_are_refused_with_the_fix(converted):
    """net.double() (or guide.double()) alone after the set-up gave torch's raw "mat1 and mat2
    must have the same dtype" from inside the model."""
    x, y = _data()
    net = _net()
    guide = _guide(net, subnetwork="all").fit((x, y), check_mode=False)
    before = guide.predict(x)
    (net if converted == "net" else guide).double()
    x64 = x.double() if converted == "net" else x
    with pytest.raises(TypeError, match=r"guide's weights are .*net\.to\(.*guide\.to\("):
        guide.predict(x64)
    with pytest.raises(TypeError, match="guide's weights are"):
        guide.fit((x64, y), check_mode=False)
    (guide if converted == "net" else net).double()  # both converted: they agree again
    # float32 against float64 arithmetic on probabilities of order 1: the float32 MAP outputs
    # and Jacobians carry relative rounding ~1e-7 per operation over a few dozen operations,
    # so 1e-5 bounds the difference with room to spare.
    assert torch.allclose(guide.predict(x.double()), before.double(), atol=1e-5)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_curvature_helpers_differentiate_under_no_grad(mode):
    """They raised autograd's "element 0 of tensors does not require grad" there."""
    x, _ = _data(6)
    net = _net()
    slots = [
        ParamSlot(p, m, n)
        for m in net
        if isinstance(m, nn.Linear)
        for n, p in m.named_parameters(recurse=False)
    ]
    index = torch.arange(sum(p.numel() for p in net.parameters()))

    def factor(f):
        return output_hessian_factor(f, "categorical", None)

    expected = (
        subnet_jacobian(lambda: net(x), slots, index),
        diagonal_ggn(lambda: net(x), slots, factor),
    )
    with mode():
        got = (
            subnet_jacobian(lambda: net(x), slots, index),
            diagonal_ggn(lambda: net(x), slots, factor),
        )
    # The same operations on the same numbers: equal bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_first_call_under_inference_mode_gives_ordinary_weights():
    """The packed weights were an inference tensor then: fit raised "Setting requires_grad=True
    on inference tensor outside InferenceMode", and no optimizer step could update them."""
    x, y = _data()
    guide = AutoSubnetLaplace(
        bdl.models.classifier(bdl.bayesianize(_net()), 32), subnetwork="all", prior_precision=1.0
    )
    with torch.inference_mode():
        guide(x, y)
    assert not guide.loc.is_inference()
    got = guide.fit((x, y), check_mode=False).predict(x)
    pyro.clear_param_store()  # a guide of the same name would take the store's weights
    # The same weights, posterior and predictions as after a first call with autograd on.
    assert torch.equal(got, _guide(subnetwork="all").fit((x, y), check_mode=False).predict(x))
