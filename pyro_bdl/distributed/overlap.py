r"""Gradient all-reduce overlapped with backward: :class:`GradientBuckets`.

The parameters are split into buckets of at most ``bucket_cap_mb`` megabytes (one device and dtype
per bucket), in reverse order of registration, because backward produces the gradients of the
last layers first. Each parameter carries a ``register_post_accumulate_grad_hook``; when every
parameter of the next bucket in line has its gradient, an asynchronous ``all_reduce`` of the
bucket starts, while backward goes on computing the earlier layers' gradients. Buckets start
strictly in order, so every rank issues the same sequence of collectives (Li et al., VLDB 2020,
describe the same scheme for PyTorch's ``DistributedDataParallel``).

**Gradients are views of the buckets** during a step (DDP's ``gradient_as_bucket_view``): each
bucket owns one flat buffer, and :meth:`GradientBuckets.arm` makes every parameter's ``.grad`` a
view of its slice, so backward accumulates straight into the buffer and no gradient is copied
in or written back per parameter. The last bucket, which starts after backward, is reduced in
place; the others, which start while backward may still write (see *stale* below), are reduced
from a copy of the buffer (one copy each way per bucket, as DDP without bucket views pays). A
``.grad`` that is not its view when the bucket starts (the loss replaced it, or a
``create_graph`` backward made a new tensor) is copied into the view, which becomes ``.grad``
again (one that carries a graph only after backward, as the loss may differentiate through it);
one replaced, or written in place, after its bucket started makes the step stale. After the step,
:meth:`GradientBuckets.release` zeroes the buffers; ``.grad`` stays a (zero) view where
``SVI`` would have left a gradient, and is ``None`` where it would be ``None``.

Every rank starts every bucket every step, also when its step failed or some parameters got no
gradient (their slots hold zeros): the sequence of collectives never depends on one rank's data,
which is what lets :func:`~pyro_bdl.distributed.agree_on_refusal` follow the buckets safely.

A bucket waits for each of its parameters to be hooked ``passes`` times (the number of backward
passes per step: one per particle for Pyro's non-vectorised ``Trace_ELBO``). A gradient that
arrives after its bucket started (more backward passes than expected) marks the step *stale*; the
caller agrees on this across ranks, and :meth:`GradientBuckets.finish` then re-reduces the final
gradients of the buckets that started early (their buffers still hold this rank's gradients; the
last bucket started after backward, so its sum is final): a wrong guess of ``passes`` costs time,
never correctness.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from pyro_bdl._validation import all_finite
from pyro_bdl.distributed.comm import broadcast_, comm_device

__all__ = ["GradientBuckets", "decode_rows", "encode_row"]


def _chunk_bits(dtype: torch.dtype) -> int:
    """Bits of a float64's pattern carried by one element of ``dtype``: integers below 2^bits
    must be exact in it (float64 holds 2^53, float32 2^24, float16 2^11, bfloat16 2^8). Even in
    float64 the pattern is cut, because −0 + 0 = +0 would change a raw value's bits."""
    return 16 if dtype in (torch.float64, torch.float32) else 8


def _chunk_type(dtype: torch.dtype) -> str:
    return "<u2" if _chunk_bits(dtype) == 16 else "u1"


def encode_row(values, dtype: torch.dtype, rank: int, world: int) -> torch.Tensor:
    """``values`` (k numbers, kept as float64) as a (world · k · c) vector of ``dtype``, nonzero
    only in rank ``rank``'s slots: each float64's little-endian bytes cut into c unsigned chunks,
    small integers that ``dtype`` holds exactly. Summed over ranks it is every rank's row, bit for
    bit (each slot adds one chunk to zeros), whatever the values are (NaN, inf, −0)."""
    raw = np.asarray(values, dtype="<f8").tobytes()
    chunks = np.frombuffer(raw, dtype=_chunk_type(dtype))
    out = np.zeros(world * len(chunks), dtype=np.float64)
    out[rank * len(chunks) : (rank + 1) * len(chunks)] = chunks
    return torch.from_numpy(out).to(dtype)


def decode_rows(flat: torch.Tensor, k: int, world: int) -> torch.Tensor:
    """The inverse of the sum over ranks of :func:`encode_row`: (world, k) float64."""
    chunks = flat.detach().cpu().double().numpy().astype(_chunk_type(flat.dtype))
    return torch.from_numpy(np.frombuffer(chunks.tobytes(), dtype="<f8").reshape(world, k).copy())


def _weak_hook(buckets: GradientBuckets) -> Callable[[torch.Tensor], None]:
    """``buckets._hook`` through a weak reference: a parameter's hook must not keep alive the
    buckets (two buffers the size of the gradients) of a step loop that is gone."""
    ref = weakref.ref(buckets)

    def hook(param: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._hook(param)

    return hook


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    # A sparse .grad (an embedding's) cannot be copied into a dense view as it is.
    return grad.to_dense() if grad.is_sparse else grad


class _Bucket:
    """One flat buffer for the gradients of ``params`` (the views that become their ``.grad``),
    ``extra`` slots after them for the ranks' control rows, and, for a bucket that may start
    during backward (``copy``), the buffer its all-reduce works on."""

    def __init__(self, params: list[torch.Tensor], extra: int = 0, *, copy: bool = True):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.numel + extra, dtype=params[0].dtype, device=params[0].device)
        self.grads = self.flat[: self.numel]
        offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()
        self.views = [self.grads[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:])]
        self.sent = torch.empty_like(self.flat) if copy else self.flat
        self.work: dist.Work | None = None
        #: The buffer's version when the bucket started (see sync).
        self.version = self.flat._version
        # The buffer's version after release(): another value means something wrote into the
        # views between steps (a backward pass outside step()).
        self.clean = self.flat._version

    def bind(self, had: set[int]) -> None:
        """Make every ``.grad`` its view; a gradient already there is kept (copied in), as
        autograd would accumulate onto it, and noted in ``had``."""
        dirty = self.flat._version != self.clean
        with torch.no_grad():
            for p, view in zip(self.params, self.views):
                grad = p.grad
                if grad is view:
                    had.add(id(p))
                    continue
                if grad is None:
                    if dirty:
                        view.zero_()
                else:
                    view.copy_(_dense(grad))
                    had.add(id(p))
                p.grad = view

    def sync(self, had: set[int], *, keep_graphs: bool = False) -> bool:
        """Copy into its view any ``.grad`` that is not its view (the loss replaced it), and make
        the view ``.grad`` again; returns whether there was one. With ``keep_graphs`` (during
        backward) a ``.grad`` that carries a graph (``create_graph=True``) stays ``.grad``: the
        loss may still differentiate through it."""
        replaced = False
        with torch.no_grad():
            for p, view in zip(self.params, self.views):
                grad = p.grad
                if grad is view:
                    continue
                replaced = True
                if grad is None:
                    view.zero_()
                    had.discard(id(p))
                else:
                    view.copy_(_dense(grad))
                    had.add(id(p))
                    if keep_graphs and grad.requires_grad:
                        continue
                p.grad = view
        # Taken after the copies: another version at the end of backward means something wrote
        # into the views since (a late gradient, or the loss scaling .grad in place).
        self.version = self.flat._version
        return replaced

    def release(self, keep: set[int]) -> None:
        """Zero the buffer; ``.grad`` becomes the (zero) view for the parameters in ``keep`` that
        have a gradient, and ``None`` for the others. A ``.grad`` that is not its view (the loss
        replaced it after its bucket started, then raised) goes too: no gradient outlives the
        step."""
        self.flat.zero_()
        self.clean = self.flat._version
        for p, view in zip(self.params, self.views):
            if p.grad is not None:
                p.grad = view if id(p) in keep else None


class GradientBuckets:
    """Bucketed asynchronous mean all-reduce of the gradients of ``params``, started by gradient
    hooks during backward.

    Usage (one step)::

        buckets.arm()               # before backward: every .grad becomes a view of a bucket
        loss.backward()             # hooks start the buckets as gradients arrive
        stale = buckets.end_backward()
        buckets.launch_remaining(control)  # every rank starts every bucket
        rows = buckets.gathered()   # every rank's control values
        finite = buckets.finish(rereduce=stale_anywhere)  # wait, average: .grad holds the means
        ...                         # the optimizer step
        buckets.release(keep)       # whatever happened: zero the buffers, end the views

    :param params: the parameters, the same list (names, shapes, dtypes, order) on every rank.
        One that does not require grad has a slot but no hook.
    :param process_group: the ``torch.distributed`` group.
    :param float bucket_cap_mb: the largest bucket, in megabytes (PyTorch DDP's default is 25).
    :param int passes: backward passes per step that accumulate into the gradients.
    :param int control: how many control values each rank sends with the last bucket.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        process_group=None,
        *,
        bucket_cap_mb: float = 25.0,
        passes: int = 1,
        control: int = 0,
    ):
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.control = control
        self.passes = passes
        self._cap = bucket_cap_mb * 2**20
        self._params = list(params)
        # Until the first step has shown the order in which backward produces the gradients,
        # guess the reverse of the given order.
        self._build(self._params[::-1])
        #: Whether the buckets follow the order observed in a step (rank 0's, see reorder()).
        self.ordered = False
        self._arrivals: list[int] = []
        # torch refuses a hook on a tensor that does not require grad (a frozen parameter):
        # such a parameter gets no gradient from backward, so its bucket does not wait for it.
        hooked = [p for b in self.buckets for p in b.params if p.requires_grad]
        self._hooked = {id(p) for p in hooked}
        hook = _weak_hook(self)
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in hooked]
        # The hooks go with the buckets (a DataParallelSVI dropped without close()).
        self._finalizer = weakref.finalize(self, _remove, self._handles)
        self._armed = False
        self._seen: dict[int, int] = {}
        self._had: set[int] = set()
        self._missing: list[int] = []
        self._next = 0
        self.stale = False
        #: How many buckets the hooks started during the last step's backward (the rest started
        #: after it, in :meth:`launch_remaining`).
        self.started_in_backward = 0

    def _build(self, launch_order: list[torch.Tensor]) -> None:
        """Cut ``launch_order`` (the first to start first) into buckets of at most the cap, one
        device and dtype each."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        cut: list[list[torch.Tensor]] = []
        for p in launch_order:
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            if groups.get(key) and sizes[key] + nbytes > self._cap:
                cut.append(groups.pop(key))
            if key not in groups:
                groups[key], sizes[key] = [], 0
            groups[key].append(p)
            sizes[key] += nbytes
        cut += list(groups.values())
        # The last bucket to start also carries every rank's control row (see launch_remaining),
        # and starts after backward: it is reduced in place.
        bits = _chunk_bits(cut[-1][0].dtype)
        extra = self.world * self.control * (64 // bits)
        self.buckets = [_Bucket(ps) for ps in cut[:-1]] + [_Bucket(cut[-1], extra, copy=False)]
        self._where = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}

    def reorder(self) -> None:
        """Rebuild the buckets in the order rank 0's gradients arrived in its last step (then
        never again): one broadcast, which every rank must make at the same step, as
        DistributedDataParallel does after its first iteration."""
        index = {id(p): i for i, p in enumerate(self._params)}
        seen = [index[key] for key in self._arrivals]
        done = set(seen)
        rest = [i for i in range(len(self._params)) if i not in done][::-1]
        order = torch.tensor(seen + rest, dtype=torch.long, device=comm_device(self.process_group))
        broadcast_([order], self.process_group)
        self._build([self._params[i] for i in order.tolist()])
        self.ordered = True

    def close(self) -> None:
        """Remove the hooks (the buckets are rebuilt when the parameters change)."""
        self._finalizer()

    def arm(self) -> None:
        """Start a step: every ``.grad`` becomes a view of its bucket, hooks count from here, no
        bucket started."""
        self._seen = {}
        self._had = set()
        self._arrivals = []
        self._missing = [sum(id(p) in self._hooked for p in b.params) for b in self.buckets]
        self._next = 0
        self.stale = False
        self.started_in_backward = 0
        for bucket in self.buckets:
            bucket.bind(self._had)
        self._armed = True

    def has_grad(self) -> list[bool]:
        """Per parameter (in the order given), whether it has a gradient this step: one computed
        by backward, or one it held before the step (as ``p.grad is not None`` in ``SVI``)."""
        return [id(p) in self._seen or id(p) in self._had for p in self._params]

    def local_finite(self) -> bool:
        """Whether this rank's gradients are all finite (before any bucket is reduced in
        place, that is before :meth:`launch_remaining`)."""
        return all_finite([b.grads for b in self.buckets])

    def _hook(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        key = id(param)
        index = self._where[key]
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        if count == 1:
            self._arrivals.append(key)
        if index < self._next:
            self.stale = True  # more backward passes than expected: re-reduced in finish()
        elif count == self.passes:
            self._missing[index] -= 1
            self._launch_ready()

    def _launch(self, bucket: _Bucket) -> None:
        bucket.sync(self._had, keep_graphs=self._armed)
        if bucket.sent is not bucket.flat:
            bucket.sent.copy_(bucket.flat)
        bucket.work = dist.all_reduce(
            bucket.sent, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
        )

    def _launch_ready(self) -> None:
        # The last bucket waits for launch_remaining, which knows the control row.
        last = len(self.buckets) - 1
        while self._next < last and self._missing[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1
            self.started_in_backward += 1

    def end_backward(self) -> bool:
        """Backward is over: hooks stop counting, and every ``.grad`` that is not its view (the
        loss replaced or set it) is copied into its view now; one whose bucket had started makes
        the step stale, as does a write into a started bucket's views (a gradient scaled in
        place). Returns :attr:`stale`."""
        self._armed = False
        for index, bucket in enumerate(self.buckets):
            started = index < self._next
            version = bucket.version
            if (bucket.sync(self._had) or bucket.flat._version != version) and started:
                self.stale = True
        return self.stale

    def launch_remaining(self, control: Sequence[float] = ()) -> None:
        """Start every bucket not started yet, in order (missing gradients count as zeros); the
        last one carries this rank's ``control`` values (``control`` numbers, given when the
        buckets were built), which :meth:`gathered` returns for every rank."""
        self._armed = False
        last = self.buckets[-1]
        if self.control:
            row = [float(v) for v in control]
            if len(row) != self.control:
                raise ValueError(f"expected {self.control} control values; got {len(row)}.")
            encoded = encode_row(row, last.flat.dtype, self.rank, self.world)
            last.flat[last.numel :].copy_(encoded)
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1

    def gathered(self) -> torch.Tensor:
        """Every rank's control values, (world, control) float64: waits for the buckets."""
        self.wait()
        last = self.buckets[-1]
        return decode_rows(last.flat[last.numel :], self.control, self.world)

    def wait(self) -> None:
        """Wait for every started bucket (call before leaving a step, whatever happened)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def finish(self, *, rereduce: bool = False) -> bool:
        """Wait and divide by the world size: every ``.grad`` (a view) holds the mean gradient.

        :param bool rereduce: a rank's step was stale (every rank must pass the same value): the
            buckets that started during backward are reduced again, synchronously, from this
            rank's final gradients.
        :returns: whether every averaged value is finite.
        """
        self.wait()
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.sent is bucket.flat:
                    bucket.grads.div_(self.world)
                elif rereduce:
                    dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.process_group)
                    bucket.flat.div_(self.world)
                else:
                    torch.div(bucket.sent, self.world, out=bucket.flat)
        return all_finite([bucket.grads for bucket in self.buckets])  # one read back

    def release(self, keep: Sequence[torch.Tensor] = ()) -> None:
        """End the step (also a failed one): zero the buffers; ``.grad`` stays a zero view where
        ``SVI`` leaves a gradient (a parameter that had one before the step, got one in it, or is
        in ``keep``: the trained ones, whose gradients the step filled with zeros where this rank
        had none), and is ``None`` for the others."""
        self._armed = False
        kept = {id(p) for p in keep} | self._had | self._seen.keys()
        for bucket in self.buckets:
            bucket.release(kept)
