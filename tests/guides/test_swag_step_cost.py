"""AutoSWAG's point-estimate step: its memory traffic does not grow with the number of sites.

The guide keeps every site in one flat vector ``loc`` of length D. Reading each site as a slice of
it would make every slice's backward materialise a zero tensor of the full length D, so a step
would allocate O(sites × D) bytes; one ``torch.split`` for all sites allocates the gradient of
``loc`` once. The check counts the bytes of every new tensor storage made during the forward and
the backward pass of a ``Trace_ELBO`` loss, at fixed D, for few large sites and many small ones.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_mean
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pyro_bdl.guides import AutoSWAG

D = 1 << 14


class AllocatedBytes(TorchDispatchMode):
    """Sums the bytes of the storages that operators create (outputs that are not views of, or
    written into, one of their inputs), including those run by the autograd engine."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def sites_model(num_sites: int):
    """``num_sites`` latent vectors of D / num_sites numbers each (D numbers in all)."""

    def model():
        for i in range(num_sites):
            pyro.sample(f"w{i}", dist.Normal(torch.zeros(D // num_sites), 1.0).to_event(1))

    return model


def step_bytes(num_sites: int) -> tuple[int, int]:
    """Bytes allocated by the forward and by the backward pass of one point-estimate step."""
    model = sites_model(num_sites)
    guide = AutoSWAG(model, init_loc_fn=init_to_mean)
    elbo = Trace_ELBO()
    elbo.differentiable_loss(model, guide)  # set-up (the parameter and buffers) outside the count
    with AllocatedBytes() as forward:
        loss = elbo.differentiable_loss(model, guide)
    with AllocatedBytes() as backward:
        loss.backward()
    assert guide.loc.grad is not None and guide.loc.grad.shape == (D,)
    return forward.bytes, backward.bytes


def test_the_counter_sees_per_slice_zero_fills_in_backward():
    flat = torch.zeros(D, requires_grad=True)
    with AllocatedBytes() as counted:
        sum(flat[i : i + 1].sum() for i in range(64)).backward()  # type: ignore[union-attr]
    assert counted.bytes >= 64 * D * flat.element_size()


def test_point_estimate_step_allocates_the_same_for_few_and_many_sites():
    few_forward, few_backward = step_bytes(2)
    many_forward, many_backward = step_bytes(128)
    # Per-site scalars (log-densities and their gradients) add a few hundred bytes in all, next to
    # several copies of D = 16,384 floats (64 KiB each); slicing per site would add ~128 × 64 KiB.
    assert many_backward <= 1.05 * few_backward, (few_backward, many_backward)
    assert many_forward <= 1.05 * few_forward, (few_forward, many_forward)
    # And the backward pass makes a handful of D-vectors, not one per site.
    assert few_backward <= 8 * D * 4
