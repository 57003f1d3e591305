r"""Gradient all-reduce overlapped with backward: :class:`GradientBuckets`.

The parameters are split into buckets of at most ``bucket_cap_mb`` megabytes (one device and dtype
per bucket), in reverse order of registration, because backward produces the gradients of the
last layers first. Each parameter carries a ``register_post_accumulate_grad_hook``; when every
parameter of the next bucket in line has its gradient, the bucket is copied into a flat buffer and
an asynchronous ``all_reduce`` starts, while backward goes on computing the earlier layers'
gradients. Buckets start strictly in order, so every rank issues the same sequence of collectives
(Li et al., VLDB 2020, describe the same scheme for PyTorch's ``DistributedDataParallel``).

Every rank starts every bucket every step, also when its step failed or some parameters got no
gradient (their slots hold zeros): the sequence of collectives never depends on one rank's data,
which is what lets :func:`~pyro_bdl.distributed.agree_on_refusal` follow the buckets safely.

A bucket waits for each of its parameters to be hooked ``passes`` times (the number of backward
passes per step: one per particle for Pyro's non-vectorised ``Trace_ELBO``). A gradient that
arrives after its bucket started (more backward passes than expected) marks the step *stale*; the
caller then re-reduces the final gradients synchronously (``DataParallelSVI`` agrees on this
across ranks), so a wrong guess of ``passes`` costs time, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["GradientBuckets"]


class _Bucket:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.flat = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.work: dist.Work | None = None

    def fill(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                if p.grad is None:
                    self.flat[offset : offset + n].zero_()
                else:
                    self.flat[offset : offset + n].copy_(p.grad.reshape(-1))
                offset += n


class GradientBuckets:
    """Bucketed asynchronous mean all-reduce of the gradients of ``params``, started by gradient
    hooks during backward.

    Usage (one step)::

        buckets.arm()               # before backward
        loss.backward()             # hooks start the buckets as gradients arrive
        buckets.launch_remaining()  # every rank starts every bucket
        ...                         # other collectives may follow here
        finite = buckets.finish(trained)  # wait, average, write p.grad of ``trained``

    :param params: the parameters, the same list (names, shapes, dtypes, order) on every rank.
    :param process_group: the ``torch.distributed`` group.
    :param float bucket_cap_mb: the largest bucket, in megabytes (PyTorch DDP's default is 25).
    :param int passes: backward passes per step that accumulate into the gradients.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        process_group=None,
        *,
        bucket_cap_mb: float = 25.0,
        passes: int = 1,
    ):
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.passes = passes
        cap = bucket_cap_mb * 2**20
        self.buckets: list[_Bucket] = []
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for p in reversed(list(params)):
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            if groups.get(key) and sizes[key] + nbytes > cap:
                self.buckets.append(_Bucket(groups.pop(key)))
            if key not in groups:
                groups[key], sizes[key] = [], 0
            groups[key].append(p)
            sizes[key] += nbytes
        self.buckets += [_Bucket(ps) for ps in groups.values()]
        self._where = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for b in self.buckets for p in b.params
        ]
        self._armed = False
        self._seen: dict[int, int] = {}
        self._missing: list[int] = []
        self._next = 0
        self.stale = False
        #: How many buckets the hooks started during the last step's backward (the rest started
        #: after it, in :meth:`launch_remaining`).
        self.started_in_backward = 0

    def close(self) -> None:
        """Remove the hooks (the buckets are rebuilt when the parameters change)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def arm(self) -> None:
        """Start a step: count hooks from here, no bucket started."""
        self._seen = {}
        self._missing = [len(b.params) for b in self.buckets]
        self._next = 0
        self.stale = False
        self.started_in_backward = 0
        self._armed = True

    def _hook(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        key = id(param)
        index = self._where[key]
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        if index < self._next:
            self.stale = True  # more backward passes than expected: re-reduced by the caller
        elif count == self.passes:
            self._missing[index] -= 1
            self._launch_ready()

    def _launch(self, bucket: _Bucket) -> None:
        bucket.fill()
        bucket.work = dist.all_reduce(
            bucket.flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
        )

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1
            self.started_in_backward += 1

    def launch_remaining(self) -> None:
        """Start every bucket not started yet, in order (missing gradients count as zeros)."""
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1

    def wait(self) -> None:
        """Wait for every started bucket (call before leaving a step, whatever happened)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def finish(self, trained: Sequence[torch.Tensor]) -> bool:
        """Wait, divide by the world size and write the mean gradients of ``trained`` into their
        ``.grad`` (the others are left as they are).

        :returns: whether every averaged value is finite.
        """
        self.wait()
        wanted = {id(p) for p in trained}
        finite = True
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.flat /= self.world
                finite = finite and bool(torch.isfinite(bucket.flat).all())
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    if id(p) in wanted:
                        mean = bucket.flat[offset : offset + n].view_as(p)
                        if p.grad is None:
                            p.grad = mean.clone()
                        else:
                            p.grad.copy_(mean)
                    offset += n
        return finite
