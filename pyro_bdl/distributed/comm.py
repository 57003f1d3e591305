r"""Plain collective helpers on ``torch.distributed``: rank queries, bucketed mean all-reduce and
broadcast, and the per-epoch data shards.

These are functions of tensors (docs/design/distributed.md);
:class:`~pyro_bdl.distributed.DataParallelSVI` is a thin shell around them. Each collective
flattens its tensors into one bucket per (device, dtype), so that a step costs one message per
bucket rather than one per parameter.

The reductions that first agree on every rank's status and shapes are in
:mod:`~pyro_bdl.distributed.reduce`.

Usage::

    idx = shard_indices(len(x_train), epoch=epoch, seed=0)   # this rank's examples

References:

- Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020
  (gradient buckets, broadcasting from rank 0 at start).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from pyro_bdl._validation import all_finite, check_positive_int

__all__ = [
    "all_gather_scalars",
    "all_reduce_",
    "broadcast_",
    "device_dtype_buckets",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "shard_indices",
]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(process_group=None) -> int:
    """This process's rank in ``process_group`` (0 when ``torch.distributed`` is not set up)."""
    return dist.get_rank(process_group) if _initialized() else 0


def get_world_size(process_group=None) -> int:
    """The number of ranks in ``process_group`` (1 when ``torch.distributed`` is not set up)."""
    return dist.get_world_size(process_group) if _initialized() else 1


def is_main_process(process_group=None) -> bool:
    """``True`` on rank 0, and in a plain single-process run: the rank that writes checkpoints,
    logs and figures.

    Usage::

        if is_main_process():
            torch.save(state, path)
    """
    return get_rank(process_group) == 0


def comm_device(process_group=None) -> torch.device:
    """Where small control tensors must live for the group's backend (NCCL needs CUDA)."""
    if _initialized() and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_scalars(values: Sequence[float], process_group=None) -> torch.Tensor:
    """Every rank's ``values`` as a float64 tensor of shape ``(world_size, len(values))``, on the
    CPU (row r holds rank r's values). One collective; every rank must pass the same length."""
    local = torch.tensor([float(v) for v in values], dtype=torch.float64)
    world = get_world_size(process_group)
    if world == 1:
        return local.unsqueeze(0)
    device = comm_device(process_group)
    out = [torch.empty_like(local, device=device) for _ in range(world)]
    dist.all_gather(out, local.to(device), group=process_group)
    return torch.stack(out).cpu()


def device_dtype_buckets(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by (device, dtype), keeping their order within each group."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in ts:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def all_reduce_(tensors: Sequence[torch.Tensor], process_group=None, *, mean: bool = True) -> bool:
    """Replace every tensor by its mean (or, ``mean=False``, its sum) over the ranks of
    ``process_group``, in place, without agreeing first: for callers that have already agreed on
    every rank's status and shapes in a collective of their own
    (:class:`~pyro_bdl.distributed.DataParallelSVI`). Everyone else uses
    :func:`~pyro_bdl.distributed.allreduce_mean_`, which agrees first.

    The result is identical (bitwise) on every rank, because the collective returns one reduced
    buffer to all of them.

    :returns: whether every averaged value is finite (checked on the flat buckets, one
        reduction each, so that a NaN on any rank is seen by all of them).
    """
    world = get_world_size(process_group)
    finite = True
    for bucket in device_dtype_buckets(tensors):
        flat = _flat(bucket)
        if world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
            if mean:
                flat /= world
            _unflatten_into(flat, bucket)
        finite = finite and all_finite([flat])
    return finite


def broadcast_(tensors: Sequence[torch.Tensor], process_group=None, *, src: int = 0) -> None:
    """Overwrite every tensor, in place, with its value on rank ``src`` of ``process_group``."""
    if get_world_size(process_group) == 1:
        return
    global_src = src if process_group is None else dist.get_global_rank(process_group, src)
    for bucket in device_dtype_buckets(tensors):
        flat = _flat(bucket)
        dist.broadcast(flat, src=global_src, group=process_group)
        _unflatten_into(flat, bucket)


def _check_nonnegative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name} must be an int >= 0; got {type(value).__name__} {value!r}. Pass a Python int."
        )
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}. Pass 0 or more.")
    return int(value)


def shard_indices(
    dataset_size: int,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    epoch: int,
    seed: int = 0,
    shuffle: bool = True,
) -> torch.Tensor:
    r"""The indices of the examples that rank ``rank`` trains on in epoch ``epoch``.

    Every rank draws the same permutation of ``range(dataset_size)`` from ``(seed, epoch)`` and
    takes its own contiguous slice of ``dataset_size // world_size`` entries, so within an epoch
    the shards are disjoint (no example is seen twice) and all have the same length (so every
    rank runs the same number of steps and the collectives never wait on a rank that ran out).

    **When N is not divisible by the world size** the last ``N mod world_size`` entries of the
    epoch's permutation are left out of that epoch. No example is duplicated (a padded sampler
    such as ``torch.utils.data.DistributedSampler`` repeats examples instead, which double-counts
    them in the N/B-scaled likelihood); because the permutation changes every epoch, a different
    handful is left out each time, and each example is left out with probability
    (N mod R)/N per epoch. With ``shuffle=False`` the order is ``0..N-1`` and the same tail is
    always left out.

    Usage::

        for epoch in range(epochs):
            idx = shard_indices(len(x), epoch=epoch, seed=0)
            for batch in idx.split(batch_size):
                svi.step(x[batch], y[batch])

    :param int dataset_size: N, the number of training examples (at least ``world_size``).
    :param int rank: this rank (default: the rank in the default process group, or 0).
    :param int world_size: R, the number of ranks (default: the default group's size, or 1).
    :param int epoch: the epoch number; each epoch gets a fresh permutation.
    :param int seed: the base seed, the same on every rank.
    :param bool shuffle: permute the examples (default) or keep them in order.
    :returns: a ``torch.long`` tensor of ``dataset_size // world_size`` indices.
    """
    check_positive_int("dataset_size", dataset_size)
    world_size = get_world_size() if world_size is None else world_size
    rank = get_rank() if rank is None else rank
    check_positive_int("world_size", world_size)
    _check_nonnegative_int("rank", rank)
    if rank >= world_size:
        raise ValueError(
            f"rank must lie in [0, world_size) = [0, {world_size}); got {rank}. Pass the "
            "process's rank in the group (torch.distributed.get_rank())."
        )
    epoch = _check_nonnegative_int("epoch", epoch)
    seed = _check_nonnegative_int("seed", seed)
    if dataset_size < world_size:
        raise ValueError(
            f"dataset_size ({dataset_size}) must be at least world_size ({world_size}) so that "
            "every rank gets one example; use fewer ranks or more data."
        )
    per_rank = dataset_size // world_size
    if shuffle:
        # A SeedSequence over (seed, epoch) gives independent streams for every pair, unlike
        # arithmetic such as seed * K + epoch, where different pairs can collide.
        order = np.random.default_rng([seed, epoch]).permutation(dataset_size)
        perm = torch.as_tensor(order, dtype=torch.long)
    else:
        perm = torch.arange(dataset_size)
    return perm[rank * per_rank : (rank + 1) * per_rank].clone()
