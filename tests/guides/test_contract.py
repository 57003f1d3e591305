"""The contract every guide over a lifted network keeps (docs/design/README.md).

Each check runs over the :data:`GUIDES` registry: site shapes, ``median()``, ``quantiles()``,
``get_posterior`` (per site or over the packed vector, as the guide defines it), ``state_dict``
and ``torch.save`` round trips (same samples after reload under the same seed), ``Predictive``,
and minibatches from a subsampled data plate. Guides are driven through public APIs only (SVI,
``collect()``, ``fit()``, ``VOGN.step``).

How to add a guide
------------------
Write a factory ``make_<yours>() -> Case`` that builds a fresh model with
:func:`small_model` (or your own small lifted model), your guide over it, and a ``fit(x, y)``
callable that trains it briefly (a few SVI steps, plus ``collect()``/``fit()`` for post-hoc
posteriors) so that it can sample. Then append one line to :data:`GUIDES`::

    GuideEntry("swag", make_swag, posterior="flat"),

``posterior`` says what ``guide.get_posterior`` returns: ``"site"`` for ``get_posterior(name)``,
the distribution of one site; ``"flat"`` for ``get_posterior()``, a distribution over all sites
packed into one vector in the model's order.

The factory must be deterministic (seed inside it), so that a second call rebuilds the same
model: the ``state_dict`` test builds a fresh case, calls ``case.guide(x, y)`` once to create lazy
parameters, loads the trained guide's state and compares samples under the same seed. If your
guide needs something else before ``load_state_dict`` (for example buffers that ``fit`` creates),
set ``prepare`` on the :class:`Case`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from torch import nn

from pyro_bdl import bayesianize, models, priors, sites
from pyro_bdl.guides import AutoMeanField, AutoRadial
from tests.common import assert_close

#: Dataset size and minibatch size of the small problem: the data plate subsamples 8 of 40.
N, BATCH, FEATURES, CLASSES = 40, 8, 5, 3


@dataclass
class Case:
    """One guide over one small lifted model.

    :ivar model: the Pyro model ``model(x, y=None)``.
    :ivar guide: the guide under test.
    :ivar fit: ``fit(x, y)`` trains briefly so that the guide can sample.
    :ivar prepare: ``prepare(x, y)`` readies a fresh guide for ``load_state_dict`` (default: one
        call of the guide, which creates lazy parameters).
    """

    model: Callable
    guide: Callable
    fit: Callable[[torch.Tensor, torch.Tensor], object]
    prepare: Callable[[torch.Tensor, torch.Tensor], object] | None = None

    def ready_for_loading(self, x, y) -> None:
        if self.prepare is not None:
            self.prepare(x, y)
        else:
            self.guide(x, y)


@dataclass(frozen=True)
class GuideEntry:
    """One guide under contract: its test id, its factory, and the form of its posterior."""

    name: str
    make: Callable[[], Case]
    posterior: Literal["site", "flat"] = "site"


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The full small dataset: ``N`` rows of ``FEATURES`` inputs and labels in [0, CLASSES)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return x, y


def small_model(seed: int = 0):
    """A lifted MLP classifier with a hidden (deterministic) LayerNorm, dataset size ``N``."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(FEATURES, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, CLASSES))
    bnn = bayesianize(net, priors.Normal(scale=1.0))
    return models.classifier(bnn, N)


def svi_fit(model, guide, *, steps: int = 3, lr: float = 1e-2, elbo=None):
    """A ``fit(x, y)`` running ``steps`` SVI steps on minibatches of ``BATCH`` rows."""

    def fit(x, y):
        svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), elbo or TraceMeanField_ELBO())
        for step in range(steps):
            rows = slice((step * BATCH) % N, (step * BATCH) % N + BATCH)
            loss = svi.step(x[rows], y[rows])
            assert torch.isfinite(torch.tensor(loss))

    return fit


def make_meanfield() -> Case:
    model = small_model()
    guide = AutoMeanField(model, init_scale=0.05)
    return Case(model, guide, svi_fit(model, guide))


def make_radial() -> Case:
    model = small_model()
    guide = AutoRadial(model, init_scale=0.05)
    return Case(model, guide, svi_fit(model, guide))


def make_subnet_laplace() -> Case:
    from pyro.infer import Trace_ELBO

    from pyro_bdl.guides import AutoSubnetLaplace

    model = small_model()
    # Every weight: the quantile check needs a spread on every site.
    guide = AutoSubnetLaplace(model, subnetwork="all")
    train = svi_fit(model, guide, elbo=Trace_ELBO())

    def fit(x, y):
        train(x, y)
        guide.fit((x, y))

    return Case(model, guide, fit)


def make_swag() -> Case:
    from pyro.infer import Trace_ELBO

    from pyro_bdl.guides import AutoSWAG

    model = small_model()
    guide = AutoSWAG(model, rank=3)
    train = svi_fit(model, guide, steps=2, elbo=Trace_ELBO())

    def fit(x, y):
        for _ in range(4):  # SGD steps between snapshots, so every weight moves
            train(x, y)
            guide.collect()

    return Case(model, guide, fit)


def make_vogn() -> Case:
    from pyro_bdl.infer import VOGN

    model = small_model()
    vogn = VOGN(model, dataset_size=N, lr=1e-2)

    def fit(x, y):
        for step in range(3):
            rows = slice((step * BATCH) % N, (step * BATCH) % N + BATCH)
            assert torch.isfinite(torch.tensor(vogn.step(x[rows], y[rows])))

    # VOGN sets its guide up on its first step (s starts from the first minibatch).
    return Case(model, vogn.guide, fit, prepare=lambda x, y: vogn.step(x[:BATCH], y[:BATCH]))


#: The guides under contract. Append one ``GuideEntry`` per guide (see the module docstring).
GUIDES: list[GuideEntry] = [
    GuideEntry("meanfield", make_meanfield),
    GuideEntry("radial", make_radial),
    GuideEntry("subnet_laplace", make_subnet_laplace, posterior="flat"),
    GuideEntry("swag", make_swag, posterior="flat"),
    GuideEntry("vogn", make_vogn),
]


@pytest.fixture(params=GUIDES, ids=lambda e: e.name)
def fitted(request):
    """A trained case, and a minibatch of the data."""
    x, y = data()
    case = request.param.make()
    case.fit(x, y)
    return request.param, case, x[:BATCH], y[:BATCH]


def weight_shapes(model) -> dict[str, torch.Size]:
    return {name: spec.shape for name, spec in sites(model.net).items()}


def latent_values(guide, x, y) -> dict[str, torch.Tensor]:
    trace = poutine.trace(guide).get_trace(x, y)
    return {
        name: site["value"].detach().clone()
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
    }


def test_sites_and_shapes(fitted):
    _, case, x, y = fitted
    shapes = weight_shapes(case.model)
    guide_trace = poutine.trace(case.guide).get_trace(x, y)
    model_trace = poutine.trace(poutine.replay(case.model, trace=guide_trace)).get_trace(x, y)
    for name, shape in shapes.items():
        assert name in guide_trace.nodes, f"guide has no site {name!r}"
        assert model_trace.nodes[name]["value"].shape == shape, name
        # The model really ran on the guide's draw.
        assert model_trace.nodes[name]["value"] is guide_trace.nodes[name]["value"]
        assert torch.isfinite(guide_trace.nodes[name]["value"]).all()
    assert model_trace.nodes["_RETURN"]["value"].shape == (BATCH, CLASSES)


def test_median(fitted):
    _, case, x, y = fitted
    median = case.guide.median(x, y)
    pyro.set_rng_seed(1)
    again = case.guide.median(x, y)  # a summary of the posterior, not a draw: no seed moves it
    for name, shape in weight_shapes(case.model).items():
        assert median[name].shape == shape, name
        assert torch.isfinite(median[name]).all()
        assert torch.equal(again[name], median[name]), name


def test_quantiles(fitted):
    _, case, x, y = fitted
    q = case.guide.quantiles([0.1, 0.5, 0.9], x, y)
    median = case.guide.median(x, y)
    for name, shape in weight_shapes(case.model).items():
        assert q[name].shape == (3, *shape), name
        assert (q[name][0] < q[name][1]).all() and (q[name][1] < q[name][2]).all(), name
        # Every family here is symmetric about its median; 1e-5 absorbs float32 round-off.
        assert_close(q[name][1], median[name], atol=1e-5, rtol=0)


def _mean(posterior) -> torch.Tensor | None:
    try:
        return posterior.mean
    except NotImplementedError:  # a family without a closed-form mean
        return None


def test_get_posterior(fitted):
    entry, case, x, y = fitted
    shapes = weight_shapes(case.model)
    median = case.guide.median(x, y)
    if entry.posterior == "site":
        for name, shape in shapes.items():
            posterior = case.guide.get_posterior(name)
            assert posterior.batch_shape + posterior.event_shape == shape, name
            assert posterior.sample().shape == shape, name
            mean = _mean(posterior)
            # Every family here is symmetric about its median (weights have real support): both
            # are the float32 location, |w| < 0.5, where atol 1e-6 is ~30 ulps (0 measured).
            if mean is not None:
                assert_close(mean, median[name], atol=1e-6, rtol=0)
            with pytest.raises(ValueError, match="unknown site"):
                case.guide.get_posterior("no such site")
    else:
        # One distribution over the packed vector, sites in the model's order.
        packed = torch.cat([median[name].reshape(-1) for name in shapes])
        posterior = case.guide.get_posterior()
        assert posterior.batch_shape == () and posterior.event_shape == packed.shape
        draw = posterior.sample()
        assert draw.shape == packed.shape and torch.isfinite(draw).all()
        mean = _mean(posterior)
        if mean is not None:  # the same float32 location as above: atol 1e-6 ≈ 30 ulps
            assert_close(mean, packed, atol=1e-6, rtol=0)


def test_state_dict_round_trip(fitted):
    entry, case, x, y = fitted
    state = {k: v.clone() for k, v in case.guide.state_dict().items()}
    pyro.set_rng_seed(123)
    before = latent_values(case.guide, x, y)
    # A new process: empty param store, a fresh model and guide, then the saved state.
    pyro.clear_param_store()
    fresh = entry.make()
    fresh.ready_for_loading(x, y)
    fresh.guide.load_state_dict(state)
    pyro.set_rng_seed(123)
    after = latent_values(fresh.guide, x, y)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_torch_save_round_trip(fitted):
    _, case, x, y = fitted
    pyro.set_rng_seed(7)
    before = latent_values(case.guide, x, y)
    buffer = io.BytesIO()
    torch.save(case.guide, buffer)
    buffer.seek(0)
    pyro.clear_param_store()
    loaded = torch.load(buffer, weights_only=False)
    pyro.set_rng_seed(7)
    after = latent_values(loaded, x, y)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_predictive(fitted):
    # Sequential Predictive: torch layers cannot take a batch of weight tensors, so
    # parallel=True does not apply to lifted networks whatever the guide.
    _, case, x, _ = fitted
    predictive = Predictive(case.model, guide=case.guide, num_samples=4, return_sites=["y"])
    out = predictive(x)
    assert out["y"].shape == (4, BATCH)
    assert ((out["y"] >= 0) & (out["y"] < CLASSES)).all()
    # Different draws of the weights give different logits.
    logits = Predictive(case.model, guide=case.guide, num_samples=3, return_sites=["_RETURN"])(x)
    assert logits["_RETURN"].shape == (3, BATCH, CLASSES)
    assert not torch.equal(logits["_RETURN"][0], logits["_RETURN"][1])


def test_subsampled_minibatches(fitted):
    _, case, x_batch, _ = fitted
    x, y = data()
    shapes = weight_shapes(case.model)
    # The data plate subsamples: batches of different sizes give the same weight shapes, and the
    # likelihood site carries the N/B scale.
    for rows in (slice(0, BATCH), slice(BATCH, BATCH + 5)):
        guide_trace = poutine.trace(case.guide).get_trace(x[rows], y[rows])
        model_trace = poutine.trace(poutine.replay(case.model, trace=guide_trace)).get_trace(
            x[rows], y[rows]
        )
        for name, shape in shapes.items():
            assert guide_trace.nodes[name]["value"].shape == shape
        b = x[rows].shape[0]
        assert model_trace.nodes["y"]["scale"] == pytest.approx(N / b)
    assert x_batch.shape[0] == BATCH
