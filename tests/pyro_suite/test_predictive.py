"""Pyro's ``Predictive`` and ``WeighedPredictive`` checks, run over every guide we ship.

Adapted from ``tests/infer/test_predictive.py`` of Pyro (https://github.com/pyro-ppl/pyro,
Apache-2.0, Copyright Contributors to the Pyro project): ``test_shapes``,
``test_deterministic`` and ``test_posterior_predictive_svi_auto_diag_normal_guide``, with Pyro's
models, assertions and tolerances, and :data:`~tests.pyro_suite.guides.GUIDES` in place of
``AutoDiagonalNormal``. ``test_shapes_lifted`` is Pyro's ``test_shapes`` over a lifted network
(so that the network-only guides run too), and ``test_weighed_parallel_log_weights`` checks
the log-weights of ``WeighedPredictive(parallel=True)`` over a lifted network against the
log-joint of each sample computed one at a time.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.optim as optim
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, WeighedPredictive

from pyro_bdl import sites
from tests.common import assert_close
from tests.pyro_suite.guides import cases, lifted_classifier

PREDICTIVES = [Predictive, WeighedPredictive]


def binomial_model(num_trials):
    with pyro.plate("data", num_trials.size(0)):
        phi_prior = dist.Uniform(num_trials.new_tensor(0.0), num_trials.new_tensor(1.0))
        success_prob = pyro.sample("phi", phi_prior)
        return pyro.sample("obs", dist.Binomial(num_trials, success_prob))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry", "predictive", "return_trace"),
    cases(
        # Pyro's four combinations cost ~20 s each; the two here cover both predictives and
        # both ways of reading the result.
        over=[(Predictive, False), (WeighedPredictive, True)],
        elbo=True,
        generic=True,
    ),
)
def test_posterior_predictive_svi_auto_diag_normal_guide(entry, predictive, return_trace):
    true_probs = torch.ones(5) * 0.7
    num_trials = torch.ones(5) * 1000
    num_success = dist.Binomial(num_trials, true_probs).sample()
    conditioned_model = poutine.condition(binomial_model, data={"obs": num_success})
    guide = entry.build(conditioned_model)
    svi = SVI(conditioned_model, guide, optim.Adam(dict(lr=0.1)), Trace_ELBO())
    for _ in range(1000):
        svi.step(num_trials)
    guide = entry.ready(guide, conditioned_model, (num_trials,))
    posterior_predictive = predictive(binomial_model, guide=guide, num_samples=10000, parallel=True)
    if return_trace:
        marginal_return_vals = posterior_predictive.get_vectorized_trace(num_trials).nodes["obs"][
            "value"
        ]
    else:
        if predictive is Predictive:
            marginal_return_vals = posterior_predictive.get_samples(num_trials)["obs"]
        else:
            weighed_samples = posterior_predictive.get_samples(
                num_trials, model_guide=conditioned_model
            )
            marginal_return_vals = weighed_samples.samples["obs"]
            assert marginal_return_vals.shape[:1] == weighed_samples.log_weights.shape
    # Pyro's tolerance: 5% of 700 is 35, ~2.4 sd of one Binomial(1000, 0.7) draw (sd 14.5);
    # the mean of 10⁴ draws has sd ~0.15 plus the posterior's spread of phi.
    assert_close(marginal_return_vals.mean(dim=0), torch.ones(5) * 700, rtol=0.05)


def shapes_model():
    x = pyro.sample("x", dist.Normal(0, 1).expand([2]).to_event(1))
    with pyro.plate("plate", 5):
        loc, log_scale = x.unbind(-1)
        y = pyro.sample("y", dist.Normal(loc, log_scale.exp()))
    return dict(x=x, y=y)


@pytest.mark.parametrize(
    ("entry", "predictive", "parallel"),
    cases(over=[(p, par) for p in PREDICTIVES for par in (False, True)], generic=True),
)
def test_shapes(entry, predictive, parallel):
    num_samples = 10
    guide = entry.make(shapes_model)

    # Compute by hand.
    vectorize = pyro.plate("_vectorize", num_samples, dim=-2)
    trace = poutine.trace(vectorize(guide)).get_trace()
    expected = poutine.replay(vectorize(shapes_model), trace)()

    # Use Predictive.
    actual = predictive(
        shapes_model,
        guide=guide,
        return_sites=["x", "y"],
        num_samples=num_samples,
        parallel=parallel,
    )()
    if predictive is WeighedPredictive:
        assert actual.samples["x"].shape[:1] == actual.log_weights.shape
        assert actual.samples["y"].shape[:1] == actual.log_weights.shape
        actual = actual.samples
    assert set(actual) == set(expected)
    assert actual["x"].shape == expected["x"].shape
    assert actual["y"].shape == expected["y"].shape


@pytest.mark.parametrize(
    ("entry", "predictive", "parallel"),
    cases(over=[(p, par) for p in PREDICTIVES for par in (False, True)]),
)
def test_shapes_lifted(entry, predictive, parallel):
    num_samples = 10
    model, x, y = lifted_classifier()
    guide = entry.make(model, (x, y))
    names = [*sites(model.net), "y"]

    # Compute by hand.
    vectorize = pyro.plate("_vectorize", num_samples, dim=-2)
    trace = poutine.trace(vectorize(guide)).get_trace(x)
    replayed = poutine.trace(poutine.replay(vectorize(model), trace)).get_trace(x)
    expected = {name: replayed.nodes[name]["value"] for name in names}

    actual = predictive(
        model, guide=guide, return_sites=names, num_samples=num_samples, parallel=parallel
    )(x, y)
    if predictive is WeighedPredictive:
        for name in names:
            assert actual.samples[name].shape[:1] == actual.log_weights.shape
        actual = actual.samples
    assert set(actual) == set(expected)
    for name in names:
        assert actual[name].shape == expected[name].shape, name


@pytest.mark.parametrize("entry", cases())
def test_weighed_parallel_log_weights(entry):
    """``WeighedPredictive(parallel=True)`` over a lifted network: each sample's model
    log-probability is its log-joint computed alone (Pyro reshapes a weight sample to
    ``(S, *event_shape)`` without the data plate's singleton dim; the lift restores it)."""
    model, x, y = lifted_classifier()
    guide = entry.make(model, (x, y))
    result = WeighedPredictive(model, guide=guide, num_samples=4, parallel=True)(x, y)
    specs = sites(model.net).items()
    assert result.log_weights.shape == (4,)
    assert torch.isfinite(result.log_weights).all()
    for i in range(4):
        sample = {name: result.samples[name][i].reshape(spec.shape) for name, spec in specs}
        alone = poutine.trace(poutine.condition(model, sample)).get_trace(x, y)
        # Float32 sums of ~100 terms of size ~1: a relative 1e-5 is ~100 ulps.
        assert_close(result.model_log_prob[i], alone.log_prob_sum(), rtol=1e-5)


def deterministic_model_factory(with_plate, event_shape):
    def model(y=None):
        with pyro.util.optional(pyro.plate("plate", 3), with_plate):
            x = pyro.sample("x", dist.Normal(0, 1).expand(event_shape).to_event())
            x2 = pyro.deterministic("x2", x**2, event_dim=len(event_shape))

        pyro.deterministic("x3", x2)
        return pyro.sample("obs", dist.Normal(x2, 0.1).to_event(), obs=y)

    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry", "predictive", "with_plate", "event_shape"),
    cases(
        over=[(p, w, e) for p in PREDICTIVES for w in (True, False) for e in ((), (2,))],
        elbo=True,
        generic=True,
    ),
)
def test_deterministic(entry, with_plate, event_shape, predictive):
    model = deterministic_model_factory(with_plate, event_shape)
    y = torch.tensor(4.0)
    guide = entry.build(model)
    svi = SVI(model, guide, optim.Adam(dict(lr=0.1)), Trace_ELBO())
    for _ in range(100):
        svi.step(y)
    guide = entry.ready(guide, model, (y,))

    actual = predictive(model, guide=guide, return_sites=["x2", "x3"], num_samples=1000)()
    if predictive is WeighedPredictive:
        assert actual.samples["x2"].shape[:1] == actual.log_weights.shape
        assert actual.samples["x3"].shape[:1] == actual.log_weights.shape
        actual = actual.samples
    x2_batch_shape = (3,) if with_plate else ()
    assert actual["x2"].shape == (1000,) + x2_batch_shape + event_shape  # noqa: RUF005
    # x3 shape is prepended 1 to match Pyro shape semantics
    x3_batch_shape = (1, 3) if with_plate else ()
    assert actual["x3"].shape == (1000,) + x3_batch_shape + event_shape  # noqa: RUF005
    assert_close(actual["x2"].mean(), y, rtol=0.1)
    assert_close(actual["x3"].mean(), y, rtol=0.1)
