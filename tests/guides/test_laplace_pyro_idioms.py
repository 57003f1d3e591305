"""The Laplace guides behave like Pyro guides under Pyro's own inference idioms: vectorized
particles, enumeration's packing, ``pyro.deterministic`` sites, mean-field and
sufficient-statistic ELBOs, and ``torch.jit`` probing."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, init_to_value
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoLaplace, AutoSubnetLaplace, NotFittedError
from pyro_bdl.guides.laplace.guide import StructureAttributeError
from pyro_bdl.infer.elbo import KLFallbackWarning, TraceSuffStat_ELBO
from tests.common import assert_close


def _plated_model(seen: list):
    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("p", 3, dim=-1):
            v = pyro.sample("v", dist.Normal(torch.zeros(3), 1.0))
            seen.append(tuple(v.shape))
            loc = v + w.sum(-1)
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=torch.ones(3))

    return model


@pytest.mark.filterwarnings("ignore:TraceEnum_ELBO found no sample sites")
@pytest.mark.parametrize("elbo_class", [Trace_ELBO, TraceEnum_ELBO], ids=lambda c: c.__name__)
def test_map_phase_gives_plated_sites_one_particle_dim(elbo_class):
    """Vectorized particles broadcast against the plate dims, as AutoDelta's do: the model sees
    (particles, 3) at a site of a plate of 3, not (particles, particles, 3)."""
    shapes = {}
    for name, make in [
        ("delta", AutoDelta),
        ("laplace", lambda m: AutoSubnetLaplace(m, subnetwork="all")),
    ]:
        pyro.clear_param_store()
        seen: list = []
        model = _plated_model(seen)
        guide = make(model)
        elbo = elbo_class(vectorize_particles=True, num_particles=10, max_plate_nesting=1)
        loss = elbo.loss(model, guide)
        assert torch.isfinite(torch.tensor(loss))
        shapes[name] = seen[-1]
    assert shapes["laplace"] == shapes["delta"] == (10, 3)


def test_deterministic_sites_are_not_observations():
    """``pyro.deterministic`` records (observed sample sites with ``_deterministic``) are not the
    data: the fit reads the one real observed site and predicts as without them."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        pyro.deterministic("f1", w.sum())
        with pyro.plate("data", len(x)):
            f = x @ w
            pyro.sample("obs", dist.Normal(f, 0.5), obs=y)
        pyro.deterministic("f2", f)

    def plain(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g)
    y = x @ torch.tensor([1.0, -1.0, 0.5]) + 0.5 * torch.randn(20, generator=g)
    means = []
    for m in (model, plain):
        pyro.clear_param_store()
        start = init_to_value(values={"w": torch.tensor([0.9, -1.1, 0.4])})
        guide = AutoSubnetLaplace(m, subnetwork="all", prior_precision=1.0, init_loc_fn=start)
        guide(x, y)
        guide.fit((x, y), check_mode=False)
        means.append(guide.predict(x))
    assert torch.equal(means[0][0], means[1][0]) and torch.equal(means[0][1], means[1][1])


def _bnn(structure: str):
    torch.manual_seed(0)
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    net = bdl.bayesianize(
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), bdl.priors.Normal(1.0)
    )
    model = bdl.models.classifier(net, len(y))
    guide = AutoSubnetLaplace(model, subnetwork="all", hessian_structure=structure)
    guide(x, y)
    guide.fit((x, y), check_mode=False)
    return model, guide, (x, y)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_a_fitted_guide_serves_pyro_elbos(structure):
    """Pyro's BNN checks: a fitted Laplace guide is the guide of TraceMeanField_ELBO and of a
    vectorized Trace_ELBO (finite losses, one particle dim per weight)."""
    pyro.clear_param_store()
    model, guide, (x, y) = _bnn(structure)
    assert math.isfinite(TraceMeanField_ELBO().loss(model, guide, x, y))
    elbo = Trace_ELBO(vectorize_particles=True, num_particles=4, max_plate_nesting=1)
    assert math.isfinite(elbo.loss(model, guide, x, y))
    with pyro.plate("particles", 4, dim=-2):
        trace = poutine.trace(guide).get_trace(x, y)
    weight = next(n for n in trace.nodes if n.endswith("weight"))
    assert trace.nodes[weight]["value"].shape[:-2] == (4, 1)


def test_a_fitted_guide_under_trace_suff_stat_elbo_takes_the_one_sample_fallback():
    """TraceSuffStat_ELBO has no M-sample KL for a joint (auxiliary) latent site: it says so
    with its KLFallbackWarning and uses the one-sample term, giving a finite loss."""
    pyro.clear_param_store()
    model, guide, (x, y) = _bnn("kron")
    with pytest.warns(KLFallbackWarning, match="_AutoSubnetLaplace_latent"):
        loss = TraceSuffStat_ELBO().loss(model, guide, x, y)
    assert math.isfinite(loss)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("fitted", [False, True], ids=["unfitted-subnet", "fitted-kron"])
def test_jit_trace_module_probes_the_properties(fitted):
    """``hasattr`` probing (``torch.jit.trace_module``) reads a property an unfitted guide or a
    kron posterior lacks as absent; reading it still gives the clear message."""
    pyro.clear_param_store()
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    net = bdl.bayesianize(nn.Sequential(nn.Linear(3, 2)), bdl.priors.Normal(1.0))
    model = bdl.models.classifier(net, len(y))
    guide = AutoLaplace(model) if fitted else AutoSubnetLaplace(model, subnetwork="all")
    guide(x, y)
    if fitted:
        guide.fit((x, y), check_mode=False)
    assert not hasattr(guide, "covariance")
    error, message = (
        (StructureAttributeError, "hessian_structure='kron' never forms")
        if fitted
        else (NotFittedError, "call guide.fit")
    )
    with pytest.raises(error, match=message) as info:
        _ = guide.covariance
    assert isinstance(info.value, AttributeError)
    torch.jit.trace_module(guide, {"forward": (x, y)}, check_trace=False, strict=False)


class _KwargsNet(nn.Module):
    """A tiny sequence classifier called as ``net(input_ids=..., attention_mask=...)``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(torch.float32)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        return self.head(pooled)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_a_dict_batch_is_sliced_by_rows(structure):
    """A structured batch (a dict of tensors passed as keyword arguments) is sliced along the
    rows like a tensor: fitting it in chunks of 4 rows gives the posterior of one pass, and
    the predictive takes a dict. Both sums are the same float32 terms grouped differently:
    rtol 1e-5 is round-off over 12 rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (12, 4), generator=g)
    mask = torch.ones(12, 4, dtype=torch.long)
    mask[::3, 2:] = 0
    x, y = {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (12,), generator=g)
    variances = []
    for batch_size in (4, 64):
        pyro.clear_param_store()
        torch.manual_seed(0)
        net = bdl.bayesianize(_KwargsNet(), bdl.priors.Normal(1.0))
        model = bdl.models.classifier(net, len(y))
        subnet = "all" if structure != "kron" else ["head.*"]
        guide = AutoSubnetLaplace(
            model, subnetwork=subnet, hessian_structure=structure, batch_size=batch_size
        )
        guide(x, y)
        guide.fit((x, y), check_mode=False)
        variances.append(guide.posterior.variances())
        probs = guide.predict(x)
        assert probs.shape == (12, 2) and torch.allclose(probs.sum(-1), probs.new_ones(12))
    assert_close(variances[0], variances[1], rtol=1e-5, atol=1e-7)
