"""The location-scale guides under Pyro's own idioms: JIT-compiled ELBOs and traced guides, and
models whose sites change after the guide was set up."""

from __future__ import annotations

import io
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList

from pyro_bdl import bayesianize, models
from pyro_bdl.guides import AutoMeanField, AutoRadial
from pyro_bdl.guides.access import SiteSetChangedError, check_same_sites

GUIDES = [AutoMeanField, AutoRadial]


def plate_only_model():
    with pyro.plate("plate", 3):
        pyro.sample("z", dist.Normal(torch.zeros(3), torch.ones(3)))


def mixed_model():
    pyro.sample("a", dist.Normal(0.0, 1.0))
    with pyro.plate("plate", 3):
        pyro.sample("z", dist.Normal(torch.zeros(3), torch.ones(3)))
    pyro.sample("b", dist.Normal(torch.zeros(2), torch.ones(2)).to_event(1))


def subsampled_model(data):
    with pyro.plate("data", len(data), subsample_size=4) as idx:
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=data[idx])


CASES = [
    (plate_only_model, ()),
    (mixed_model, ()),
    (subsampled_model, (torch.arange(10.0),)),
]


@pytest.fixture
def quiet_jit():
    # The tracer warns about Python control flow on shapes (static here) and torch deprecates
    # torch.jit.trace itself; Pyro's JitTrace_ELBO still uses it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated
        yield


@pytest.mark.parametrize("guide_cls", GUIDES)
@pytest.mark.parametrize("model, args", CASES, ids=["plate_only", "mixed", "subsampled"])
def test_jit_elbo_loss_equals_loss_and_grads(quiet_jit, guide_cls, model, args):
    # Pyro's check: with the same seed, the eager ``loss`` and the compiled ``loss_and_grads``
    # see the same noise, so they agree to float32 rounding (the compiled graph may fuse and
    # reorder a few operations: 1e-6 relative is a few ulps of a loss of order 10).
    guide = guide_cls(model)
    elbo = JitTrace_ELBO()
    elbo.loss_and_grads(model, guide, *args)  # compiles
    for seed in range(3):
        pyro.set_rng_seed(seed)
        eager = elbo.loss(model, guide, *args)
        pyro.set_rng_seed(seed)
        compiled = elbo.loss_and_grads(model, guide, *args)
        assert compiled == pytest.approx(eager, rel=1e-6)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_traced_guide_draws_what_the_eager_guide_draws(quiet_jit, guide_cls):
    guide = guide_cls(plate_only_model)
    guide()
    traced = torch.jit.trace(guide, (), strict=False)  # the guide returns a dict
    pyro.set_rng_seed(1)
    eager = guide()["z"]
    pyro.set_rng_seed(1)
    assert torch.equal(traced()["z"], eager)


def test_jit_serialized_guide_list_of_mean_field_parts_draws_as_eager(quiet_jit):
    # Pyro's serialization check: a traced, saved and reloaded AutoGuideList draws what the
    # eager one draws under the same seed (plate-local sites "y", "z" in a part of their own).
    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))
        with pyro.plate("plate", 2):
            pyro.sample("y", dist.LogNormal(0.0, 1.0))
            pyro.sample("z", dist.Beta(2.0, 2.0))

    guide = AutoGuideList(model)
    guide.append(AutoMeanField(poutine.block(model, expose=["x"])))
    guide.append(AutoMeanField(poutine.block(model, hide=["x"])))
    guide()
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.trace_module(guide, {"call": ()}, strict=False), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    pyro.set_rng_seed(0)
    expected = guide.call()
    pyro.set_rng_seed(0)
    actual = loaded.call()
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))


def growing_model(names):
    """Pyro's dynamic-model idiom: the sites are whatever ``names`` holds when the model runs."""

    def model():
        for name in names:
            pyro.sample(name, dist.Normal(0.0, 1.0))

    return model


def svi_step(model, guide, *args):
    return SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step(*args)


@pytest.mark.parametrize("guide_cls", GUIDES)
@pytest.mark.parametrize(
    "later, message",
    [
        (["x0", "x1"], "new sites 'x1'; missing sites none"),
        (["y"], "new sites 'y'; missing sites 'x0'"),
        (["x1", "x0"], "same sites in another order"),
    ],
    ids=["grown", "renamed", "reordered"],
)
def test_a_guide_on_a_model_whose_sites_changed_refuses_naming_them(guide_cls, later, message):
    names = ["x0"] if later != ["x1", "x0"] else ["x0", "x1"]
    model = growing_model(names)
    svi_step(model, guide_cls(model))
    names[:] = later
    # A new guide of the same name finds the old packed parameters in the param store.
    with pytest.raises(SiteSetChangedError, match=message) as info:
        svi_step(model, guide_cls(model))
    assert "AutoNormal" in str(info.value) and "clear_param_store" in str(info.value)
    pyro.clear_param_store()  # the fix the message proposes
    guide = guide_cls(model)
    assert math.isfinite(svi_step(model, guide)) and guide.site_names == later


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_a_second_guide_for_another_network_names_the_param_store(guide_cls):
    """The usual way to meet the refusal: two methods or networks in one program, the second
    guide built without clearing the store. The message must say where the parameters came
    from and the fix, not that this guide's model changed."""
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    first = models.classifier(bayesianize(torch.nn.Linear(4, 3)), 8)
    svi_step(first, guide_cls(first), x, y)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    second = models.classifier(bayesianize(net), 8)
    with pytest.raises(SiteSetChangedError) as info:
        svi_step(second, guide_cls(second), x, y)
    message = str(info.value)
    assert message.startswith(f"Pyro's param store holds {guide_cls.__name__} parameters")
    assert "second" in message and "pyro.clear_param_store() before building it" in message
    pyro.clear_param_store()  # the fix the message proposes
    assert math.isfinite(svi_step(second, guide_cls(second), x, y))


def test_parameters_without_site_names_are_checked_by_size():
    # Parameters restored from elsewhere carry no site names: the sizes must still agree.
    check_same_sites("G", set_up=None, now=["a"], set_up_size=3, now_size=3)
    with pytest.raises(SiteSetChangedError, match=r"hold 2 numbers.*\('a', 'b'\) need 5"):
        check_same_sites("G", set_up=None, now=["a", "b"], set_up_size=2, now_size=5)
