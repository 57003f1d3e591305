r"""Memory budgets of subnetwork curvature: counting what is allocated, refusing what cannot fit,
and sizing the row chunks of the Jacobian.

A subnetwork Laplace fit holds three kinds of memory: the S × S matrices of the posterior
(:func:`check_memory` refuses a subnetwork whose matrices and one Jacobian chunk exceed the
budget before anything is computed), the ``B × C × S`` Jacobian chunk, and the network-dependent
memory of a chunk (forward graph, layer-output gradients, unfolded inputs). The last is measured
per row with :class:`TensorMemoryTracker` (:func:`jacobian_row_bytes`) and kept within a budget
the size of the S-dependent part (:func:`chunk_budget`, :func:`chunk_rows`), so the peak stays
:math:`O(B \cdot C \cdot S + S^2)` however large the network grows.

Usage::

    with TensorMemoryTracker(exclude=list(net.parameters())) as mem:
        guide.fit((x, y))
    print(mem.peak)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_bdl.curvature.jacobian import ParamSlot, subnet_jacobian

__all__ = [
    "MIN_CHUNK_MEMORY",
    "TensorMemoryTracker",
    "available_bytes",
    "check_memory",
    "chunk_budget",
    "chunk_rows",
    "forward_rows",
    "jacobian_row_bytes",
]

#: The least default chunk budget (bytes): small subnetworks should not crawl one row at a time.
MIN_CHUNK_MEMORY = 4 << 20


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages that operations allocate while active (CPU or GPU).

    A storage is counted once, from the first operation that returns it until the last tensor
    object on it is freed; ``exclude`` lists tensors whose storages (parameters, data) are not
    counted even when an operation returns a view of them. ``peak`` is the largest total seen.
    Tensors created by factory calls outside PyTorch operators (``torch.tensor`` from Python
    data) are missed, which is negligible here.

    Usage::

        with TensorMemoryTracker(exclude=list(net.parameters())) as mem:
            guide.fit((x, y))
        print(mem.peak)
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        super().__init__()
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.current -= self._sizes.pop(ptr)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._excluded:
            return
        if ptr not in self._refs:
            self._refs[ptr] = 0
            self._sizes[ptr] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._refs[ptr] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._track(t)
        return result


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (CUDA: the allocator's free bytes; CPU: available pages)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 62


def check_memory(
    count: int, outputs: int, batch_size: int, dtype: torch.dtype, device, budget: int | None
) -> None:
    """Raise a ``ValueError`` stating the bytes needed when three S × S matrices and one
    ``batch_size × C × S`` Jacobian chunk exceed ``budget`` (default: the device's free
    memory)."""
    item = torch.finfo(dtype).bits // 8
    needed = 3 * count * count * item + 4 * batch_size * outputs * count * item
    budget = budget or available_bytes(torch.device(device))
    if needed > budget:
        raise ValueError(
            f"a subnetwork of S = {count} weights needs about {needed:,} bytes "
            f"({needed / 2**30:.2f} GiB: three S × S matrices in {dtype} and one Jacobian "
            f"chunk) but only {budget:,} bytes are available; choose a smaller size, "
            "a smaller batch_size, or raise max_memory."
        )


def jacobian_row_bytes(
    forward_one: Callable[[], torch.Tensor],
    slots: Sequence[ParamSlot],
    index: torch.Tensor,
    *,
    exclude: Sequence[torch.Tensor] = (),
) -> int:
    """Peak bytes :func:`~pyro_bdl.curvature.jacobian.subnet_jacobian` allocates for the rows
    ``forward_one`` runs (forward graph, layer-output gradients, unfolded inputs, rows of J_S;
    small entry-picking temporaries), so callers can size row chunks from a budget.
    ``exclude``: weights, data."""
    with TensorMemoryTracker(exclude=exclude) as mem:
        subnet_jacobian(forward_one, slots, index, select_numbers=1 << 14)
    return max(mem.peak, 1)


def chunk_budget(
    count: int, outputs: int, batch_size: int, item: int, chunk_memory: int | None = None
) -> int:
    """Bytes one Jacobian chunk may use for its network-dependent memory: ``chunk_memory`` when
    given, else the size of the S-dependent part, ``max(2·S², batch_size·C·S)`` numbers of
    ``item`` bytes (at least :data:`MIN_CHUNK_MEMORY`). Two S × S matrices keep the Jacobian
    phase below the three S × S matrices of the factorisation that follows."""
    if chunk_memory:
        return chunk_memory
    return max(item * max(2 * count * count, batch_size * outputs * count), MIN_CHUNK_MEMORY)


def chunk_rows(
    network_at: Callable[[int], tuple[Callable[[], torch.Tensor], Sequence[ParamSlot]]],
    index: torch.Tensor,
    budget: int,
    batch_size: int,
    item: int,
    *,
    available: int,
    exclude: Sequence[torch.Tensor] = (),
) -> tuple[int, int]:
    """(rows per Jacobian chunk, numbers per entry-picking temporary) within ``budget`` bytes:
    3/4 for the rows' network memory, 1/4 for the three temporaries of
    :func:`~pyro_bdl.curvature.jacobian.subnet_jacobian`.

    ``network_at(n)`` gives ``(forward, slots)`` over the first ``n`` rows of a batch of
    ``available`` rows. The bytes per row are the difference between the peaks
    (:func:`jacobian_row_bytes`) of a two-row and a one-row chunk, which leaves out what a
    forward pass allocates once whatever the rows (the prior's tensors, for example)."""
    peaks = [jacobian_row_bytes(*network_at(n), index, exclude=exclude) for n in (1, 2)]
    per_row = peaks[1] - peaks[0] if available > 1 else peaks[0]
    rows = max(1, min(batch_size, budget * 3 // 4 // max(per_row, 1)))
    return rows, max(1, budget // 4 // (3 * item))


def forward_rows(
    network_at: Callable[[int], tuple[Callable[[], torch.Tensor], Sequence[ParamSlot]]],
    budget: int,
    batch_size: int,
    row_bytes: int,
    *,
    available: int,
    exclude: Sequence[torch.Tensor] = (),
) -> int:
    """Rows per chunk within ``budget`` bytes for a pass that holds the forward graph and
    ``row_bytes`` more per row: the graph's bytes per row are the difference between the peaks
    of a two-row and a one-row forward pass (``network_at`` as in :func:`chunk_rows`)."""
    peaks = []
    for n in (1, 2):
        forward, _ = network_at(n)
        with TensorMemoryTracker(exclude=exclude) as mem:
            forward()
        peaks.append(mem.peak)
    graph = peaks[1] - peaks[0] if available > 1 else peaks[0]
    per_row = max(graph, 1) + row_bytes
    return max(1, min(batch_size, budget // per_row))
