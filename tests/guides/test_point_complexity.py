"""The point-estimate step of the guides built on one flat latent vector (AutoSWAG, and
AutoSubnetLaplace before ``fit``, its MAP phase: a ``Delta`` over the flat vector) costs memory
that does not grow with the number of sites at a fixed number of weights D.

Two measures, each for a model of 2 and of 40 sites holding the same D numbers in all: the bytes
of the distinct storages that autograd saves for the backward pass of the ``Trace_ELBO`` loss
(``torch.autograd.graph.saved_tensors_hooks``), and the bytes of every storage that operators
create during the forward and the backward pass (a ``TorchDispatchMode``). A per-site cost of
O(D), as slicing one flat vector per site would give (each slice's backward fills a zero tensor of
length D), shows as 38 extra D-vectors: 38 × 62.5 KiB here.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_mean

from pyro_bdl.guides import AutoSubnetLaplace, AutoSWAG
from tests.guides.test_swag_step_cost import AllocatedBytes

D = 16_000  # 2 × 8,000 or 40 × 400
ROWS = 4


def sites_model(num_sites: int):
    """``num_sites`` weight vectors of D / num_sites numbers and one observed site (the form
    AutoSubnetLaplace reads from a hand-written model)."""

    def model(x, y=None):
        weights = [
            pyro.sample(f"w{i}", dist.Normal(torch.zeros(D // num_sites), 1.0).to_event(1))
            for i in range(num_sites)
        ]
        mean = x @ torch.cat(weights)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(mean, 1.0), obs=y)

    return model


def make_guide(kind: str, model):
    if kind == "swag":
        return AutoSWAG(model, init_loc_fn=init_to_mean)
    return AutoSubnetLaplace(model, subnetwork="all", init_loc_fn=init_to_mean)


def step_bytes(kind: str, num_sites: int) -> tuple[int, int]:
    """(bytes saved for backward, bytes allocated in forward + backward) of one step."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, D, generator=g), torch.randn(ROWS, generator=g)
    model = sites_model(num_sites)
    guide = make_guide(kind, model)
    elbo = Trace_ELBO()
    elbo.differentiable_loss(model, guide, x, y)  # set-up (parameters, buffers) not counted
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), AllocatedBytes() as mem:
        loss = elbo.differentiable_loss(model, guide, x, y)
        loss.backward()
    assert guide.loc.grad is not None and guide.loc.grad.shape == (D,)
    return sum(storages.values()), mem.bytes


def test_the_measures_see_a_per_site_cost():
    # Slicing a flat vector per site: 40 slices save nothing large but their backward allocates
    # 40 zero-filled D-vectors; 40 products with a D-vector save 40 D-vectors.
    flat = torch.zeros(D, requires_grad=True)
    other = torch.ones(D)
    with AllocatedBytes() as mem:
        sum(flat[i : i + 1].sum() for i in range(40)).backward()  # type: ignore[union-attr]
    assert mem.bytes >= 40 * D * 4
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
    ):
        sum((flat * (other + i)).sum() for i in range(40))
    assert sum(saved) >= 40 * D * 4


@pytest.mark.parametrize("kind", ["swag", "laplace_map"])
def test_point_step_memory_does_not_grow_with_the_number_of_sites(kind):
    few_saved, few_allocated = step_bytes(kind, 2)
    many_saved, many_allocated = step_bytes(kind, 40)
    # Per-site scalars (log-densities, their gradients, shapes) add at most a few KiB in all;
    # one D-vector is 62.5 KiB, and a per-site O(D) cost would add 38 of them.
    slack = D * 4 // 4
    assert many_saved <= few_saved + slack, (few_saved, many_saved)
    assert many_allocated <= few_allocated + slack, (few_allocated, many_allocated)
