"""The ready-made models keep their error promises under the newer features: params that
never collide between models, a Gaussian likelihood that refuses to overflow, batch checks
that do not depend on Pyro's validation switch, and call errors that name the fix. Every refusal
is checked for its type, its message and that nothing changed."""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl import models
from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint
from pyro_bdl.guides import AutoLaplace, AutoMeanField, AutoRadial, AutoSWAG
from tests.faults.common import assert_same, rng_states

N = 16


def _net(outputs: int = 1, batchnorm: bool = False):
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(3, 4)]
    layers += [nn.BatchNorm1d(4)] if batchnorm else []
    return bdl.bayesianize(nn.Sequential(*layers, nn.Tanh(), nn.Linear(4, outputs)))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, 3, generator=g), torch.randn(N, generator=g)


def _snapshot(*modules, rng: bool = True) -> dict:
    """The param store, each module's state (buffers included) and, optionally, every RNG."""
    state: dict = {
        "params": {n: v.detach().clone() for n, v in pyro.get_param_store().items()},
        "modules": [copy.deepcopy(m.state_dict()) for m in modules],
    }
    if rng:
        state["rng"] = rng_states()
    return state


# ---------------------------------------------------------------------------------------------
# 1. Every param a model creates has a name of its own


def test_two_point_regressors_keep_their_own_sigma():
    x, y = _data()
    first = models.regressor(_net(), N, 0.5, noise="point")
    second = models.regressor(_net(), N, 3.0, noise="point")
    first(x, y)
    second(x, y)
    assert (first.noise_scale, second.noise_scale) == (0.5, 3.0)
    assert first.param_names != second.param_names
    assert set(first.param_names + second.param_names) <= set(pyro.get_param_store().keys())
    assert first.param_names == (f"{first.name}.sigma",)


def test_default_names_are_never_reused_and_taken_names_are_refused():
    first = models.regressor(_net(), N, noise="point", name="reg")
    auto = [models.regressor(_net(), N, noise="point").name for _ in range(2)]
    assert len(set(auto)) == 2 and "reg" not in auto
    before = _snapshot(first.net)
    with pytest.raises(ValueError, match=r"name 'reg' is taken by another live model.*another"):
        models.regressor(_net(), N, noise="point", name="reg")
    with pytest.raises(ValueError, match=r"name must be a non-empty str without '\.'.*'a\.b'"):
        models.regressor(_net(), N, noise="point", name="a.b")
    assert_same(before, _snapshot(first.net))
    del first  # a name is free again once its model is gone
    assert models.regressor(_net(), N, noise="point", name="reg").name == "reg"


def test_a_point_sigma_round_trips_a_checkpoint_under_its_name(tmp_path):
    x, y = _data()
    model = models.regressor(_net(), N, 2.0, noise="point")
    guide = AutoMeanField(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    svi.step(x, y)
    trained = model.noise_scale
    save_checkpoint(tmp_path / "run.ckpt", guide=guide)
    pyro.clear_param_store()  # the same model object, with a fresh guide and store
    load_checkpoint(tmp_path / "run.ckpt", guide=AutoMeanField(model), example_args=(x, y))
    assert model.noise_scale == trained != 2.0


def test_a_checkpoint_with_the_old_shared_sigma_name_still_loads(tmp_path):
    x, y = _data()
    model = models.regressor(_net(), N, 2.0, noise="point")
    guide = AutoMeanField(model)
    SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO()).step(x, y)
    trained = model.noise_scale
    path = tmp_path / "old.ckpt"
    save_checkpoint(path, guide=guide)
    # Rewrite it as a release that named the param plain "sigma" wrote it.
    payload = torch.load(path, weights_only=True)
    (name,) = model.param_names
    for part in (payload["param_store"]["values"], payload["param_store"]["constraints"]):
        part["sigma"] = part.pop(name)
    payload["fingerprint"]["params"]["sigma"] = payload["fingerprint"]["params"].pop(name)
    payload.pop("checksums", None)  # such a file had none either
    torch.save(payload, path)
    pyro.clear_param_store()
    load_checkpoint(path, guide=AutoMeanField(model), example_args=(x, y))
    assert model.noise_scale == trained and "sigma" not in pyro.get_param_store()


def test_a_learned_sigma_is_the_site_sigma_of_each_model():
    # The site name is the model's contract (guides index posteriors by it); it lives in one
    # model's trace, so two models each have their own.
    x, y = _data()
    for _ in range(2):
        model = models.regressor(_net(), N, noise="learned")
        trace = pyro.poutine.trace(model).get_trace(x, y)
        assert trace.nodes["sigma"]["type"] == "sample" and model.param_names == ()
    assert "sigma" not in pyro.get_param_store()


# ---------------------------------------------------------------------------------------------
# 2. A Gaussian likelihood that would overflow is refused before σ changes


def _point_run(scale: float = 1.0):
    x, y = _data()
    model = models.regressor(_net(), N, scale, noise="point")
    guide = AutoMeanField(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    svi.step(x, y)
    return model, svi, x, y


@pytest.mark.parametrize("validation", [True, False])
def test_targets_times_1e30_are_refused_and_sigma_stays_finite(validation):
    model, svi, x, y = _point_run()
    before = _snapshot(model.net, rng=False)
    with pyro.validation_enabled(validation):
        with pytest.raises(
            ValueError,
            match=r"overflows torch\.float32.*largest \|y\| = 2\.\d+e\+30.*Standardise the targets",
        ):
            svi.step(x, y * 1e30)
    assert_same(before, _snapshot(model.net, rng=False))
    assert torch.isfinite(torch.tensor(model.noise_scale))


def test_a_non_finite_point_sigma_is_refused_naming_the_param():
    model, svi, x, y = _point_run()
    (name,) = model.param_names
    with torch.no_grad():
        pyro.param(name).unconstrained().fill_(float("inf"))
    before = _snapshot(model.net, rng=False)
    with pytest.raises(ValueError, match=rf"σ \(param '{name}'\) is inf; it must be finite"):
        svi.step(x, y)
    assert_same(before, _snapshot(model.net, rng=False))


def test_float64_takes_targets_that_float32_refuses():
    x, y = _data()
    model = models.regressor(bdl.bayesianize(nn.Linear(3, 1).double()), N, 1.0)
    out = model(x.double(), y.double() * 1e30)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# 3. The batch checks run whatever Pyro's validation switch says


def _nan_x(x, y):
    x = x.clone()
    x[2, 1] = float("nan")
    return x, y


def _inf_y(x, y):
    y = y.clone()
    y[5] = float("inf")
    return x, y


BAD_BATCHES = {
    "NaN in x": (_nan_x, r"x contains 1 non-finite value\(s\).*index \(2, 1\)"),
    "inf in y": (_inf_y, r"y contains 1 non-finite value\(s\).*index \(5,\)"),
    "y of shape (N, 1)": (
        lambda x, y: (x, y[:, None]),
        r"y must have the network output's shape \(16,\); got \(16, 1\)",
    ),
    "rows of x and y differ": (
        lambda x, y: (x, y[:-1]),
        r"x and y must have the same number of rows; got 16 rows of x and y \(15,\)",
    ),
    "labels out of range": (
        lambda x, y: (x, torch.full((N,), 3)),
        r"class labels must lie in \[0, 3\); got min 3, max 3",
    ),
    "batch larger than N": (
        lambda x, y: (x.repeat(2, 1), y.repeat(2)),
        r"the batch has 32 rows but dataset_size is 16",
    ),
}
GUIDES = {
    "AutoMeanField": AutoMeanField,
    "AutoRadial": AutoRadial,
    "AutoSWAG": lambda model: AutoSWAG(model, rank=2),
    "AutoLaplace (MAP phase)": lambda model: AutoLaplace(model, hessian_structure="diag"),
}


@pytest.mark.parametrize("bad", list(BAD_BATCHES))
@pytest.mark.parametrize("which", list(GUIDES))
def test_bad_batches_are_refused_with_validation_off(which, bad):
    edit, match = BAD_BATCHES[bad]
    classify = bad == "labels out of range"
    net = _net(3 if classify else 1, batchnorm=True)
    model = models.classifier(net, N) if classify else models.regressor(net, N, 0.5)
    x, y = _data()
    y = torch.randint(0, 3, (N,)) if classify else y
    guide = GUIDES[which](model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    svi.step(x, y)
    bad_x, bad_y = edit(x, y)
    # Pyro's Trace_ELBO runs the guide before the model, and a sampling guide (mean-field,
    # Radial) draws its noise there: the model cannot give those random numbers back. Guides
    # that draw nothing in training (SWAG's SGD phase, Laplace's MAP phase) leave them too.
    draws = which in ("AutoMeanField", "AutoRadial")
    before = _snapshot(net, guide, rng=not draws)
    with pyro.validation_enabled(False), pytest.raises(ValueError, match=match):
        svi.step(bad_x, bad_y)
    assert_same(before, _snapshot(net, guide, rng=not draws))
    assert all(torch.isfinite(v).all() for v in pyro.get_param_store().values())


# ---------------------------------------------------------------------------------------------
# 4. Errors at the call boundary name the arguments and the fix


def test_a_loader_yielding_an_index_names_the_extra_argument_and_the_unpacking():
    x, y = _data()
    model = models.regressor(_net(), N, 0.5)
    guide = AutoMeanField(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    batch = next(iter(DataLoader(TensorDataset(x, y, torch.arange(N)), batch_size=4)))
    svi.step(*batch[:2])
    # The mean-field guide runs first and draws its noise (Pyro's order), so the RNG is checked
    # on the model's own call below.
    before = _snapshot(model.net, guide, rng=False)
    with pytest.raises(
        TypeError,
        match=r"takes \(x, y=None\) but got 1 more positional argument\(s\): Tensor\(4,\)\. "
        r".*\(x, y, index\).*`x, y, _ = batch; svi\.step\(x, y\)`",
    ):
        svi.step(*batch)
    assert_same(before, _snapshot(model.net, guide, rng=False))
    before = _snapshot(model.net, guide)
    with pytest.raises(TypeError, match=r"2 more positional.*int, str\. .*`x, y, \*_ = batch"):
        model(x, y, 1, "a")
    assert_same(before, _snapshot(model.net, guide))


def test_unexpected_keyword_arguments_are_named_with_the_fix():
    x, y = _data()
    model = models.regressor(_net(), N, 0.5)
    before = _snapshot(model.net)
    with pytest.raises(
        TypeError, match=r"keyword argument\(s\) \['labels'\]\. Pass the targets as y"
    ):
        model(x, labels=y)
    assert_same(before, _snapshot(model.net))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda net: models.classifier(net, N)(torch.zeros(2, 3), [0, 1]),
            TypeError,
            r"y must be a torch\.Tensor or None; got list\. Use torch\.as_tensor\(y\)",
        ),
        (
            lambda net: models.NetworkModel(
                net, likelihood="categorical", dataset_size=N, multilabel=True
            ),
            ValueError,
            r"multilabel=True needs likelihood='bernoulli'; got likelihood='categorical'\. Use",
        ),
        (
            lambda net: models.NetworkModel(
                net, likelihood="gaussian", dataset_size=N, noise_scale=1.0, split=lambda o: (o, o)
            ),
            ValueError,
            r"split belongs to a heteroscedastic regressor; got it with noise='fixed'\. Use",
        ),
    ],
)
def test_other_boundary_errors_give_what_came_and_the_fix(call, error, match):
    net = _net(1 if "split" in match else 3)
    before = _snapshot(net)
    with pytest.raises(error, match=match):
        call(net)
    assert_same(before, _snapshot(net))
