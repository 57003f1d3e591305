"""Pyro's autoguide contract, run over every guide we ship.

Adapted from ``tests/infer/test_autoguide.py`` of Pyro (https://github.com/pyro-ppl/pyro,
Apache-2.0, Copyright Contributors to the Pyro project): ``test_shapes``, ``test_median``,
``test_serialization``, ``test_quantiles``, ``test_init_scale``, ``test_predictive`` and
``test_replay_plates``. The models and assertions are Pyro's; what changed is the
parametrization (the :data:`~tests.pyro_suite.guides.GUIDES` registry instead of Pyro's
autoguide classes, our ELBOs next to Pyro's) and, in ``test_predictive``, the hand-written
``RandomLinear`` is the lifted ``nn.Linear`` it stands for. The Laplace guides and the
natural-gradient guide infer lifted network weights from data only (``network_only`` in the
registry): Pyro's data-free models with scalar latents do not apply to them, so they run in
``test_predictive`` (over the same regression as a ``bdl.models.regressor`` with σ fixed) and
in ``test_valid_models.py`` over lifted networks. Pyro's ``assert_equal(a, b, prec)``
is ``assert_close(a, b, atol=prec, rtol=0)`` here. ``AutoNormal``, ``AutoDiagonalNormal`` and
``AutoDelta`` run as controls: a case that fails for them too is marked as Pyro's limitation.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    Predictive,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceMeanField_ELBO,
)
from pyro.optim import Adam
from pyro.poutine.util import prune_subsample_sites
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.infer import TraceSuffStat_ELBO
from tests.common import assert_close
from tests.pyro_suite.guides import (
    KL_FALLBACK_IS_DOCUMENTED,
    TORCHSCRIPT_DEPRECATED,
    cases,
    known,
    not_reparameterized,
)

ELBOS = [Trace_ELBO, TraceMeanField_ELBO, TraceEnum_ELBO, TraceSuffStat_ELBO]

SHAPES_KNOWN = {
    **not_reparameterized("TraceMeanField_ELBO", "TraceSuffStat_ELBO", suffixes=("-1", "-10")),
}


def shapes_model():
    pyro.sample("z1", dist.Normal(0.0, 1.0))
    pyro.sample("z2", dist.Normal(torch.zeros(2), torch.ones(2)).to_event(1))
    with pyro.plate("plate", 3):
        pyro.sample("z3", dist.Normal(torch.zeros(3), torch.ones(3)))
    pyro.sample("z4", dist.MultivariateNormal(torch.zeros(2), torch.eye(2)))
    pyro.sample("z5", dist.Dirichlet(torch.ones(3)))
    pyro.sample("z6", dist.Normal(0, 1).expand((2,)).mask(torch.arange(2) > 0).to_event(1))
    pyro.sample("z7", dist.LKJCholesky(2, torch.tensor(1.0)))


@pytest.mark.parametrize(
    ("entry", "Elbo", "num_particles"),
    cases(
        over=[(Elbo, n) for Elbo in ELBOS for n in (1, 10)],
        generic=True,
        xfail=SHAPES_KNOWN,
    ),
)
@pytest.mark.filterwarnings(KL_FALLBACK_IS_DOCUMENTED)
def test_shapes(entry, Elbo, num_particles):
    guide = entry.make(shapes_model)
    elbo = Elbo(
        num_particles=num_particles,
        vectorize_particles=True,
        strict_enumeration_warning=False,
    )
    loss = elbo.loss(shapes_model, guide)
    assert np.isfinite(loss), loss


def median_model():
    pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.LogNormal(0.0, 1.0))
    pyro.sample("z", dist.Beta(2.0, 2.0))


@pytest.mark.slow
@pytest.mark.parametrize("entry", cases(elbo=True, generic=True))
@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED)
def test_median(entry):
    guide = entry.build(median_model)
    optim = Adam({"lr": 0.02, "betas": (0.8, 0.99)})
    elbo = JitTrace_ELBO(
        strict_enumeration_warning=False,
        num_particles=500,
        vectorize_particles=True,
        ignore_jit_warnings=True,
    )
    infer = SVI(median_model, guide, optim, elbo)
    for _ in range(100):
        infer.step()
    guide = entry.ready(guide, median_model, ())

    median = guide.median()
    # Pyro's atol 0.1. Derived: Adam at lr 0.02 moves each unconstrained location by ≤ ~lr a step
    # (100 steps reach the optimum from these starts) and, there, jitters with the gradient noise
    # of 500 particles, sd ~σ/√500 ≈ 0.045, against a restoring slope ~1: the medians end within
    # 0.03 of the exact ones (every guide, seeds 0–3). 0.1 is 5 Adam steps, 3× that; a median
    # read off the unconstrained location (y: 0 for 1) or the mode (e⁻¹ for 1) is off by ≥ 0.37.
    assert_close(median["x"], torch.tensor(0.0), atol=0.1, rtol=0)
    if entry.name == "AutoDelta":
        assert_close(median["y"], torch.tensor(-1.0).exp(), atol=0.1, rtol=0)
    else:
        assert_close(median["y"], torch.tensor(1.0), atol=0.1, rtol=0)
    assert_close(median["z"], torch.tensor(0.5), atol=0.1, rtol=0)


def serialization_model():
    pyro.sample("x", dist.Normal(0.0, 1.0))
    with pyro.plate("plate", 2):
        pyro.sample("y", dist.LogNormal(0.0, 1.0))
        pyro.sample("z", dist.Beta(2.0, 2.0))


@pytest.mark.parametrize(
    ("entry", "jit"),
    cases(over=[False, True], generic=True),
)
@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED)
def test_serialization(entry, jit):
    guide = entry.make(serialization_model)
    pyro.set_rng_seed(0)
    expected = guide.call()
    latent_names = sorted(guide())
    expected_params = {k: v.data for k, v in guide.named_parameters()}

    if jit:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            traced_guide = torch.jit.trace_module(guide, {"call": ()}, check_trace=False)
        f = io.BytesIO()
        torch.jit.save(traced_guide, f)
        del guide, traced_guide
        pyro.clear_param_store()
        f.seek(0)
        guide_deser = torch.jit.load(f)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            f = io.BytesIO()
            torch.save(guide, f)
            f.seek(0)
            guide_deser = torch.load(f, weights_only=False)

    pyro.set_rng_seed(0)
    actual = guide_deser.call()
    assert len(actual) == len(expected)
    for name, a, e in zip(latent_names, actual, expected):
        assert_close(a, e, msg=f"{name}: {a} vs {e}")

    actual_params = {k: v.data for k, v in guide_deser.named_parameters()}
    assert set(actual_params) == set(expected_params)
    for name, expected in expected_params.items():
        assert_close(actual_params[name], expected)


def quantiles_model():
    pyro.sample("y", dist.LogNormal(0.0, 1.0))
    pyro.sample("z", dist.Beta(2.0, 2.0).expand([2]).to_event(1))
    pyro.sample("x", dist.Normal(0.0, 1.0))


_INIT_SCALE = (
    "by design (documented trade-off, docs/methods/meanfield_radial.md): the default 1e-2 suits "
    "networks, and from it the scale of an N(0, 1) latent reaches only 0.67 in Pyro's 100 steps; "
    "init_scale=0.03 or 0.1 passes"
)
QUANTILES_KNOWN = {
    "meanfield": known(_INIT_SCALE, AssertionError),
    "swag": known(
        "by design: SWAG's spread is that of the SGD iterates around the mode, not a "
        "variational posterior fitted to the prior of a data-free model",
        AssertionError,
    ),
    "AutoDelta": known("Pyro limitation: AutoDelta has no quantiles()", AttributeError),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry", "Elbo"),
    cases(over=[Trace_ELBO, TraceSuffStat_ELBO], elbo=True, generic=True, xfail=QUANTILES_KNOWN),
)
@pytest.mark.filterwarnings(KL_FALLBACK_IS_DOCUMENTED)
def test_quantiles(entry, Elbo):
    guide = entry.build(quantiles_model)
    optim = Adam({"lr": 0.05, "betas": (0.8, 0.99)})
    elbo = Elbo(strict_enumeration_warning=False, num_particles=100, vectorize_particles=True)
    infer = SVI(quantiles_model, guide, optim, elbo)
    for _ in range(100):
        infer.step()
    guide = entry.ready(guide, quantiles_model, ())

    quantiles = guide.quantiles([0.1, 0.5, 0.9])
    median = guide.median()
    for name in ["x", "y", "z"]:
        assert not median[name].requires_grad
        assert torch.is_tensor(quantiles[name])
        assert len(quantiles[name]) == 3
        for q in quantiles[name]:
            assert not q.requires_grad
            assert q.shape == (() if name != "z" else (2,))
        assert_close(median[name], quantiles[name][1])

    assert -3.0 < quantiles["x"][0]
    assert quantiles["x"][0] + 1.0 < quantiles["x"][1]
    assert quantiles["x"][1] + 1.0 < quantiles["x"][2]
    assert quantiles["x"][2] < 3.0

    assert 0.01 < quantiles["y"][0]
    assert quantiles["y"][0] * 2.0 < quantiles["y"][1]
    assert quantiles["y"][1] * 2.0 < quantiles["y"][2]
    assert quantiles["y"][2] < 100.0

    assert (0.01 < quantiles["z"][0]).all()
    assert (quantiles["z"][0] + 0.1 < quantiles["z"][1]).all()
    assert (quantiles["z"][1] + 0.1 < quantiles["z"][2]).all()
    assert (quantiles["z"][2] < 0.99).all()


def _scales(guide) -> torch.Tensor:
    """The posterior scales of every unconstrained coordinate (Pyro's ``_loc_scale()[1]``)."""
    if hasattr(guide, "_loc_scale"):
        return guide._loc_scale()[1]
    return torch.cat([scale.reshape(-1) for _, scale in guide.locs_and_scales().values()])


@pytest.mark.parametrize("init_scale", [1e-1, 1e-4, 1e-8])
@pytest.mark.parametrize("entry", cases(["meanfield", "radial", "AutoDiagonalNormal"]))
def test_init_scale(entry, init_scale):
    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(5), torch.eye(5, 5)))
        with pyro.plate("plate", 100):
            pyro.sample("z", dist.Normal(0.0, 1.0))

    guide = type(entry.build(model))(model, init_scale=init_scale)
    guide()
    scale = _scales(guide)
    scale_rms = scale.pow(2).mean().sqrt().item()
    assert init_scale * 0.5 < scale_rms < 2.0 * init_scale  # Pyro's bound
    # Ours are deterministic: every scale is softplus(softplus⁻¹(init_scale)) in float32, a few
    # roundings (ε = 1.2e-7) away; measured within 5e-7 relative for all three guides and
    # scales. rel 1e-5 (~80 ulps) would still see a scale off by any factor Pyro's bound allows.
    assert scale_rms == pytest.approx(init_scale, rel=1e-5)


N, D = 3, 2


class LinearRegression(pyro.nn.PyroModule):
    """Pyro's test model, its ``RandomLinear`` being a lifted ``nn.Linear`` (weight prior
    N(0, 1), bias prior N(0, 10), as Pyro's)."""

    def __init__(self):
        super().__init__()
        self.linear = bayesianize(nn.Linear(D, 1), _regression_prior)

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1)
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        with pyro.plate("plate", N):
            return pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


def _regression_prior(module, name, like):
    scale = 1.0 if name == "weight" else 10.0
    return dist.Normal(torch.zeros_like(like), scale).to_event(like.dim())


def network_regression():
    """The same regression as the model the network-only guides take: σ fixed at its prior
    median 1 and the plate the data plate of :func:`pyro_bdl.models.regressor`."""
    net = nn.Sequential(nn.Linear(D, 1), nn.Flatten(0))
    return models.regressor(bayesianize(net, _regression_prior), N, noise_scale=1.0)


@pytest.mark.parametrize(
    "entry",
    cases(
        xfail={
            "laplace": known(
                "by design (refusal expected): a Kronecker-factored Laplace needs one prior "
                "precision per layer; Pyro's weight N(0, 1) and bias N(0, 10) differ",
                ValueError,
            ),
        }
    ),
)
@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED)
def test_predictive(entry):
    x, y = torch.randn(N, D), torch.randn(N)
    model = network_regression() if entry.network_only else LinearRegression()
    guide = entry.make(model, (x, y))
    model_trace = poutine.trace(model).get_trace(x, y=None)
    predictive = Predictive(model, guide=guide, num_samples=10)
    pyro.set_rng_seed(0)
    samples = predictive(x)
    for site in prune_subsample_sites(model_trace).stochastic_nodes:
        assert site in samples
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        traced_predictive = torch.jit.trace_module(predictive, {"call": (x,)})
    f = io.BytesIO()
    torch.jit.save(traced_predictive, f)
    f.seek(0)
    predictive_deser = torch.jit.load(f)
    pyro.set_rng_seed(0)
    samples_deser = predictive_deser.call(x)
    # Note that the site values are different in the serialized guide
    assert len(samples) == len(samples_deser)


def replay_model():
    a = pyro.sample("a", dist.Normal(0, 1))
    b = pyro.sample("b", dist.Normal(a[..., None], torch.ones(3)).to_event(1))
    c = pyro.sample("c", dist.MultivariateNormal(torch.zeros(3) + a[..., None], torch.eye(3)))
    with pyro.plate("i", 2):
        d = pyro.sample("d", dist.Dirichlet((b + c).exp()))
        pyro.sample("e", dist.Categorical(logits=d), obs=torch.tensor([0, 0]))
    return a, b, c, d


@pytest.mark.parametrize("sample_shape", [(), (6,), (5, 4)], ids=str)
@pytest.mark.parametrize("entry", cases(generic=True))
def test_replay_plates(entry, sample_shape):
    guide = entry.make(replay_model)
    with pyro.plate_stack("particles", sample_shape, rightmost_dim=-2):
        guide_trace = poutine.trace(guide).get_trace()
        a, b, c, d = poutine.replay(replay_model, guide_trace)()
    # Pyro's assertions verbatim (hence the tuple concatenation).
    assert a.shape == (sample_shape + (1,) if sample_shape else ())  # noqa: RUF005
    assert b.shape == (sample_shape + (1, 3) if sample_shape else (3,))  # noqa: RUF005
    assert c.shape == (sample_shape + (1, 3) if sample_shape else (3,))  # noqa: RUF005
    assert d.shape == sample_shape + (2, 3)  # noqa: RUF005
