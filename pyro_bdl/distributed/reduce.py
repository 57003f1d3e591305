r"""All-reduces that agree before any payload moves: the ``reduce_fn`` of VOGN, IVON and the
Laplace fit.

A rank that refuses its step (a NaN batch, a failed check) and simply raises leaves the other
ranks inside the collective: they hang, fail with "Connection closed by peer", or pair this
step's all-reduce with the refusing rank's next one; and two ranks that all-reduce tensors of
different lengths abort a process inside gloo. So each reduction here first all-gathers, from
every rank, a few numbers: its status (0: ready, else the kind of the error that made it refuse,
as in :mod:`~pyro_bdl.distributed.refusal`) and the signature of what it will send (the number
of tensors, of elements, and a checksum of their shapes and dtypes). If any rank refused, every
rank raises the same error naming it; if the signatures differ, every rank raises a
``ValueError`` naming them; only then does the payload move.

A refusing rank takes part through :meth:`AgreedReduce.refuse`, which the natural-gradient
driver calls on its refusal path (a method that raises before its reduction point calls it once
instead of the reduction). Costs one all-gather of five numbers per reduction.

Usage::

    vogn = bdl.infer.VOGN(model, dataset_size=N, reduce_fn=allreduce_mean())
    guide.fit((x_shard, y_shard), reduce_fn=allreduce_sum())
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pyro_bdl.distributed.comm import all_gather_scalars, all_reduce_, get_world_size
from pyro_bdl.distributed.refusal import refusal_status, settle_refusal

__all__ = [
    "AgreedReduce",
    "agree_before_reduce",
    "allreduce_mean",
    "allreduce_mean_",
    "allreduce_sum",
]


def _signature(tensors: Sequence[torch.Tensor]) -> list[float]:
    """(count, elements, checksum of the shapes and dtypes): exact in float64."""
    described = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
    return [
        float(len(tensors)),
        float(sum(t.numel() for t in tensors)),
        float(zlib.crc32(described)),
    ]


def agree_before_reduce(
    tensors: Sequence[torch.Tensor],
    error: BaseException | None = None,
    *,
    process_group=None,
    what: str = "allreduce_mean_",
) -> None:
    """Every rank's status and payload signature in one all-gather; raises on every rank if any
    rank refused (``error``, the agreed error of :func:`~pyro_bdl.distributed.agree_on_refusal`)
    or if the ranks' tensors differ in count, size, shape or dtype (``ValueError``). In one
    process it raises ``error`` itself, if given."""
    if get_world_size(process_group) == 1:
        if error is not None:
            raise error
        return
    signature = [0.0, 0.0, 0.0] if error is not None else _signature(tensors)
    stats = all_gather_scalars([*refusal_status(error), *signature], process_group)
    rows = settle_refusal(error, stats, step=None, process_group=process_group)
    if bool((rows == rows[0]).all()):
        return
    described = "; ".join(
        f"rank {r}: {int(n)} tensor(s), {int(k)} elements"
        for r, (n, k, _) in enumerate(rows.tolist())
    )
    raise ValueError(
        f"{what}: the ranks passed tensors of different shapes or dtypes ({described}; equal "
        "counts mean the shapes or dtypes differ); every rank must pass the same shapes, dtypes "
        "and order. Nothing was reduced, on any rank. Give every rank the same model and the "
        "same kind of batch."
    )


def allreduce_mean_(tensors: Sequence[torch.Tensor], process_group=None) -> bool:
    """Replace every tensor by its mean over the ranks of ``process_group``, in place, once the
    ranks have agreed (:func:`agree_before_reduce`: every rank raises the same error if one
    passes tensors of other shapes, or refused through :meth:`AgreedReduce.refuse`).

    The result is identical (bitwise) on every rank, because the collective returns one reduced
    buffer to all of them.

    :returns: whether every averaged value is finite.
    """
    agree_before_reduce(tensors, process_group=process_group, what="allreduce_mean_")
    return all_reduce_(tensors, process_group)


class AgreedReduce:
    """A ``reduce_fn`` whose ranks agree before the payload moves, and whose refusing rank takes
    part through :meth:`refuse`.

    Called with a list of tensors it reduces them in place and returns whether every result is
    finite (the ``reduce_fn`` of VOGN and IVON); called with one tensor it reduces it in place
    and returns it (the ``reduce_fn`` of the Laplace ``fit``).

    :param bool mean: average (``True``) or sum over the ranks.
    :param process_group: the ``torch.distributed`` group (default: the default group).
    """

    def __init__(self, *, mean: bool, process_group=None):
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a reduce_fn over a process_group needs torch.distributed to be initialised; call "
                "torch.distributed.init_process_group first (torchrun sets up the environment)."
            )
        self.mean, self.process_group = mean, process_group
        self._what = "allreduce_mean()" if mean else "allreduce_sum()"

    def __call__(self, tensors: torch.Tensor | Sequence[torch.Tensor]):
        single = isinstance(tensors, torch.Tensor)
        items: list[torch.Tensor] = [tensors] if isinstance(tensors, torch.Tensor) else [*tensors]
        agree_before_reduce(items, process_group=self.process_group, what=self._what)
        finite = all_reduce_(items, self.process_group, mean=self.mean)
        return tensors if single else finite

    def refuse(self, error: BaseException) -> None:
        """This rank refused the step before its reduction: take part in the other ranks'
        agreement instead, so that every rank raises the same error (raised here too, from
        ``error``). In one process it returns (the caller raises ``error``)."""
        if get_world_size(self.process_group) == 1:
            return
        agree_before_reduce((), error, process_group=self.process_group, what=self._what)


def allreduce_mean(process_group=None) -> AgreedReduce:
    """The ``reduce_fn`` of :class:`~pyro_bdl.infer.VOGN` and :class:`~pyro_bdl.infer.IVON` for
    ``process_group``: averages the list of tensors over the group's ranks in place, after the
    ranks agree (a rank that refuses its step makes every rank refuse it).

    Usage::

        vogn = bdl.infer.VOGN(model, dataset_size=N, reduce_fn=allreduce_mean())
    """
    return AgreedReduce(mean=True, process_group=process_group)


def allreduce_sum(process_group=None) -> AgreedReduce:
    """The ``reduce_fn`` of :meth:`~pyro_bdl.guides.AutoSubnetLaplace.fit` for ``process_group``:
    sums one tensor over the group's ranks in place and returns it, after the ranks agree."""
    return AgreedReduce(mean=False, process_group=process_group)
