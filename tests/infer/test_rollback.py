"""The rollback's saved copies: exact restores, and copies fused by dtype.

On CUDA ``torch._foreach_copy_`` is one multi-tensor kernel only when every source has the first
one's dtype; a list mixing BatchNorm's float statistics with its int64 ``num_batches_tracked``
becomes a copy (a launch) per tensor. The checks below run on the CPU and look at the operator
calls themselves: one fused copy per dtype, each over sources of a single dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_bdl.infer.natural_gradient.ivon import copy_or_zero
from pyro_bdl.infer.rollback import Rollback, norm_layer_buffers


class ForeachCopies(TorchDispatchMode):
    """Records the source dtypes of every ``_foreach_copy_`` call and counts plain copies."""

    def __init__(self):
        super().__init__()
        self.calls: list[set[torch.dtype]] = []
        self.plain = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._foreach_copy_.default:
            self.calls.append({t.dtype for t in args[1]})
        elif func is torch.ops.aten.copy_.default:
            self.plain += 1
        return func(*args, **(kwargs or {}))


def _net() -> nn.Module:
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.BatchNorm1d(8))
    net.register_buffer("extra", torch.zeros(3, dtype=torch.float64))
    return net


def test_restore_puts_back_every_buffer_and_tensor_exactly():
    net = _net()
    entries = [*norm_layer_buffers([net]), (net, "extra")]
    state = [torch.randn(4), torch.arange(3)]
    before = [b.clone() for b in net.buffers()] + [t.clone() for t in state]
    rollback = Rollback(entries)
    for _ in range(2):  # the second save reuses the first one's storage
        rollback.save(state)
        net(torch.randn(5, 1, 4, 4))  # training mode: the statistics move
        net.extra.add_(1.0)
        for t in state:
            t.add_(7)
        rollback.restore()
    after = [b for b in net.buffers()] + state
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert any(b.dtype == torch.int64 for b in net.buffers())  # the mix the grouping is for


def test_saves_and_restores_copy_one_dtype_per_fused_call():
    net = _net()
    rollback = Rollback([*norm_layer_buffers([net]), (net, "extra")])
    rollback.save([torch.zeros(2), torch.zeros(2, dtype=torch.int32)])
    with ForeachCopies() as seen:
        rollback.save([torch.zeros(2), torch.zeros(2, dtype=torch.int32)])  # new state tensors
        rollback.save()
        rollback.restore()
    assert seen.calls, "no fused copy"
    assert all(len(dtypes) == 1 for dtypes in seen.calls), seen.calls
    # The buffers' storage is reused from the first save: float32, int64 and float64, three
    # calls for each of the two saves and the restore (the new state tensors are cloned).
    assert len(seen.calls) == 3 * 3


def test_copy_or_zero_copies_the_gradients_and_zeros_the_missing_ones_in_one_call():
    outs = [torch.full((2, 3), 5.0), torch.full((4,), 5.0), torch.full((1,), 5.0)]
    grads = [torch.randn(2, 3), None, torch.randn(1)]
    with ForeachCopies() as seen:
        copy_or_zero(outs, grads)
    assert torch.equal(outs[0], grads[0]) and torch.equal(outs[2], grads[2])
    assert torch.equal(outs[1], torch.zeros(4))
    assert len(seen.calls) == 1 and seen.plain == 0
