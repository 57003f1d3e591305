r"""Ranks agree on refusals: one small collective per step decides whether every rank goes on.

A data-parallel step pairs collectives across ranks. If one rank refuses its batch (a check of the
model raises, its loss is NaN) and simply raises, the others wait in the next collective: they hang
until the timeout, fail with an unrelated connection error, or, worse, pair this step's collective
with the refusing rank's next step. So before any gradient is exchanged, every rank contributes a
status (0: ready, else the kind of its error) to one all-gather, and if any rank refused, every
rank raises the same exception type with the same message, naming the refusing ranks and their
reasons, at the same step (docs/design/distributed.md). Only on that path does a second collective
carry the reasons' text (as bytes, never pickles).

:func:`agree_on_refusal` is the primitive (``DataParallelSVI.step`` puts its loss and checksums in
the same all-gather, so a normal step costs no extra collective); :class:`StepAgreement` wraps
another step function with a ``reduce_fn`` (VOGN and IVON agree without it, through
:func:`~pyro_bdl.distributed.allreduce_mean`), and rolls back torch's random
generators and the normalisation statistics that the refused step's forward passes changed (with
:class:`~pyro_bdl.infer.rollback.Rollback`, the one mechanism that undoes a refused step).

Usage::

    agreement = StepAgreement(modules=[net])
    vogn = bdl.infer.VOGN(model, dataset_size=N, reduce_fn=agreement.wrap(allreduce_mean()))
    for x, y in batches:
        with agreement.step():
            vogn.step(x, y)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pyro_bdl._validation import all_finite
from pyro_bdl.distributed.comm import (
    all_gather_scalars,
    comm_device,
    get_world_size,
)
from pyro_bdl.distributed.errors import GuideNotInitializedError, StepRefusedError
from pyro_bdl.infer.rollback import Rollback, norm_layer_buffers

__all__ = [
    "AgreedStepReduce",
    "StepAgreement",
    "agree_on_refusal",
    "nonfinite_refusal",
    "refusal_status",
    "settle_refusal",
]

# The kinds the ranks name to each other by index (0 means "no refusal"): the most specific
# first, since a rank's error is matched with isinstance.
_KINDS: tuple[type[Exception], ...] = (
    GuideNotInitializedError,
    FloatingPointError,
    TypeError,
    ValueError,
    IndexError,
    KeyError,
    RuntimeError,
    StepRefusedError,
)
_MAX_REASON_BYTES = 4000


def _kind(error: BaseException) -> int:
    return next((i for i, k in enumerate(_KINDS, 1) if isinstance(error, k)), len(_KINDS))


def _reason(error: BaseException) -> bytes:
    kind = _KINDS[_kind(error) - 1]
    text = str(error) if type(error) is kind else f"{type(error).__name__}: {error}"
    return text.encode("utf-8")[:_MAX_REASON_BYTES]


def _gather_text(text: bytes, lengths: list[int], process_group) -> list[str]:
    """Every rank's ``text`` (``lengths[r]`` bytes on rank r), as uint8 tensors: no pickles."""
    width = max(lengths)
    local = torch.zeros(width, dtype=torch.uint8)
    if text:
        local[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    device = comm_device(process_group)
    rows = [torch.empty(width, dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(rows, local.to(device), group=process_group)
    return [
        bytes(row[:n].cpu().tolist()).decode("utf-8", "replace") for row, n in zip(rows, lengths)
    ]


def _agreed_error(
    refused: list[int], kinds: list[int], reasons: list[str], step: int | None
) -> Exception:
    at = "" if step is None else f" at step {step}"
    if len(refused) == 1:
        what = f"rank {refused[0]} refused its batch{at}: {reasons[refused[0]]}"
    else:
        listed = "; ".join(f"rank {r}: {reasons[r]}" for r in refused)
        names = ", ".join(map(str, refused))
        what = f"ranks {names} refused their batches{at}: {listed}"
    agreed = _KINDS[kinds[refused[0]] - 1](
        f"{what} (every rank raised this error; no rank changed any state in this step)"
    )
    agreed.refused_ranks = refused  # type: ignore[attr-defined]
    agreed.step = step  # type: ignore[attr-defined]
    return agreed


def agree_on_refusal(
    error: BaseException | None,
    values: Sequence[float] = (),
    *,
    step: int,
    process_group=None,
) -> torch.Tensor:
    r"""Tell every rank whether any rank refused this step, in one all-gather.

    Every rank of ``process_group`` must call it once per step, with the exception that made it
    refuse (``None`` when it is ready). If no rank refused it returns every rank's ``values``
    (float64, shape ``(world_size, len(values))``, gathered by the same collective). Otherwise
    every rank raises the same exception: the kind (``ValueError``, ``TypeError``,
    ``FloatingPointError``, ...; :class:`StepRefusedError` for other kinds) of the lowest refusing
    rank's error, with the message ``"rank 1 refused its batch at step 7: <its reason>"``, the
    attributes ``refused_ranks`` and ``step``, and on a refusing rank its own error as the cause.
    In one process the error itself is raised unchanged.

    Usage::

        try:
            loss = compute_loss_and_grads(batch)
            error = None
        except Exception as e:
            error = e
        agree_on_refusal(error, step=t)   # raises on every rank, or on none
        allreduce_mean_(grads)

    :param error: this rank's refusal, or ``None``.
    :param values: numbers to gather along with the status (the same count on every rank).
    :param int step: the step number named in the message.
    :param process_group: the ``torch.distributed`` group (default: the default group).
    :returns: the gathered ``values``, row r from rank r.
    """
    if get_world_size(process_group) == 1:
        if error is not None:
            raise error
        return torch.tensor([[float(v) for v in values]], dtype=torch.float64)
    stats = all_gather_scalars([*refusal_status(error), *values], process_group)
    return settle_refusal(error, stats, step=step, process_group=process_group)


def refusal_status(error: BaseException | None) -> tuple[int, int]:
    """The two numbers a rank contributes to the agreement: the index of its error's kind (0 when
    ready) and the length of its reason in bytes."""
    return (0, 0) if error is None else (_kind(error), len(_reason(error)))


def settle_refusal(
    error: BaseException | None, stats: torch.Tensor, *, step: int | None, process_group=None
) -> torch.Tensor:
    """The second half of :func:`agree_on_refusal`, for a caller that gathered every rank's
    ``[*refusal_status(error), *values]`` (``stats``, one row per rank) in a collective of its
    own: returns the ``values`` rows, or raises the agreed error on every rank (``step`` is
    named in its message unless ``None``)."""
    kinds = [int(k) for k in stats[:, 0].tolist()]
    if not any(kinds):
        return stats[:, 2:]
    reason = b"" if error is None else _reason(error)
    reasons = _gather_text(reason, [int(n) for n in stats[:, 1].tolist()], process_group)
    refused = [r for r, k in enumerate(kinds) if k]
    agreed = _agreed_error(refused, kinds, reasons, step)
    if error is not None:
        raise agreed from error
    raise agreed


def nonfinite_refusal(
    loss: float, named: list[tuple[str, torch.Tensor]], *, grads_finite: bool | None = None
) -> Exception | None:
    """This rank's refusal of a non-finite loss or gradient (``None`` when all are finite), naming
    the first parameter with a non-finite gradient: ``named`` holds (name, parameter) pairs.
    ``grads_finite`` is the answer where the caller has it already (checked on flat buffers
    that hold the gradients); otherwise the gradients are checked here."""
    fix = "; nothing was updated. Lower the learning rate or check that rank's data for NaN/inf."
    if not math.isfinite(loss):
        return FloatingPointError(f"its loss is {loss}{fix}")
    if grads_finite is None:
        grads_finite = all_finite([p.grad for _, p in named if p.grad is not None])
    if grads_finite:
        return None
    grads = [(n, p.grad) for n, p in named if p.grad is not None]
    bad = next((n for n, g in grads if not bool(torch.isfinite(g).all())), None)
    return (
        None if bad is None else FloatingPointError(f"the gradient of {bad!r} is not finite{fix}")
    )


class StepAgreement:
    r"""Make the ranks agree on refusals around a step function of your own that reduces
    through a ``reduce_fn``, and count its steps.

    VOGN and IVON need none: their ranks agree on refusals through
    :func:`~pyro_bdl.distributed.allreduce_mean` (a rank that refuses before its reduction calls
    the reduce_fn's ``refuse``), and they roll their own state back. A step function that raises
    before it reaches ``reduce_fn`` would leave the other ranks waiting inside ``reduce_fn``'s
    all-reduce. With a
    :class:`StepAgreement`, every rank exchanges its status exactly once per step: a rank that
    reaches ``reduce_fn`` does so just before the reduction (:meth:`wrap`), a rank that raised
    does so when the exception leaves ``with agreement.step():``. If any rank refused, every rank
    raises the same error (see :func:`agree_on_refusal`) at the same step, and the step's changes
    to torch's random generators and to the normalisation statistics of ``modules`` are rolled back.
    The refusal happens before ``reduce_fn`` runs, hence before VOGN's update: its state is
    untouched.

    Usage::

        agreement = StepAgreement(modules=[net])
        vogn = bdl.infer.VOGN(model, dataset_size=N, reduce_fn=agreement.wrap(allreduce_mean()))
        for x, y in batches:
            with agreement.step():
                loss = vogn.step(x, y)

    Take the first step with good batches (or call ``vogn.setup(x, y)`` on every rank) before
    relying on the roll-back: VOGN reads the model and creates its state at its first step.

    :param process_group: the ``torch.distributed`` group (default: the default group).
    :param modules: modules whose BatchNorm statistics a refused step must leave unchanged (the
        network).
    :ivar int num_steps_taken: the steps completed inside :meth:`step`; the step number in the
        messages.
    """

    def __init__(self, process_group=None, *, modules: Iterable[nn.Module] = ()):
        self.process_group = process_group
        self.modules = list(modules)
        if not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError(
                "modules must be torch.nn.Module instances (the network); got "
                f"{[type(m).__name__ for m in self.modules]}. Pass modules=[net]."
            )
        self.num_steps_taken = 0
        self._active = False
        self._agreed = False
        self._snapshot: Rollback | None = None

    def wrap(self, reduce_fn: Callable[[list[torch.Tensor]], object]) -> AgreedStepReduce:
        """``reduce_fn`` preceded by the exchange of statuses: pass the result as VOGN's
        ``reduce_fn``. Called outside :meth:`step` it raises ``RuntimeError``."""
        if not callable(reduce_fn):
            raise TypeError(
                f"reduce_fn must be callable; got {type(reduce_fn).__name__}. Pass the function "
                "that sums a list of tensors over the ranks (an all-reduce)."
            )
        return AgreedStepReduce(self, reduce_fn)

    def agree(self, error: BaseException | None = None) -> None:
        """Exchange this rank's status now (at most once per step; later calls do nothing)."""
        if not self._active:
            raise RuntimeError(
                "the ranks agree on a step only inside `with agreement.step():`; wrap the call "
                "that runs the step (for example vogn.step(x, y)) in it."
            )
        if self._agreed:
            return
        self._agreed = True
        agree_on_refusal(error, step=self.num_steps_taken, process_group=self.process_group)

    def step(self) -> StepAgreement:
        """The context of one step (``with agreement.step(): ...``)."""
        if self._active:
            raise RuntimeError(
                "agreement.step() contexts cannot be nested; this one is already open. Run one "
                "step per `with agreement.step():` block, one block after another."
            )
        return self

    def __enter__(self) -> StepAgreement:
        if self._active:
            raise RuntimeError(
                "agreement.step() contexts cannot be nested; this one is already open. Run one "
                "step per `with agreement.step():` block, one block after another."
            )
        # The modules' layers are looked up at every step: the network may change between steps.
        self._snapshot = Rollback.saved(norm_layer_buffers(self.modules))
        self._active, self._agreed = True, False
        return self

    def __exit__(self, kind, error, traceback) -> None:
        snapshot, self._snapshot = self._snapshot, None
        assert snapshot is not None
        try:
            if error is None:
                try:
                    self.agree()  # a step that never reached reduce_fn still pairs with the others
                except BaseException:
                    snapshot.restore()
                    raise
                self.num_steps_taken += 1
                return
            snapshot.restore()
            if isinstance(error, Exception) and not self._agreed:
                self.agree(error)  # raises the agreed error on every rank
        finally:
            self._active = False


class AgreedStepReduce:
    """The ``reduce_fn`` of :meth:`StepAgreement.wrap`: the agreement's exchange, then the
    wrapped reduction; a refusing rank takes part through :meth:`refuse` (as with
    :class:`~pyro_bdl.distributed.AgreedReduce`)."""

    def __init__(self, agreement: StepAgreement, reduce_fn: Callable[[list[torch.Tensor]], object]):
        self.agreement, self.reduce_fn = agreement, reduce_fn

    def __call__(self, tensors: list[torch.Tensor]) -> object:
        self.agreement.agree()
        return self.reduce_fn(tensors)

    def refuse(self, error: BaseException) -> None:
        """This rank refused before the reduction: exchange its status now (every rank raises
        the agreed error; in one process this returns)."""
        if get_world_size(self.agreement.process_group) > 1:
            self.agreement.agree(error)
