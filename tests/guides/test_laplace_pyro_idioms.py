"""The Laplace guides behave like Pyro guides under Pyro's own inference idioms: vectorized
particles, enumeration's packing, ``pyro.deterministic`` sites, mean-field and
sufficient-statistic ELBOs, and ``torch.jit`` probing."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl.guides import AutoSubnetLaplace


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
