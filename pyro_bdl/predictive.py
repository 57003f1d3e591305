r"""The posterior predictive of a model over a lifted network: the network's output for S
posterior draws, in one batched forward pass.

:func:`sample_outputs` draws the S weight samples from the guide at once under a plate (as
``Predictive(parallel=True)`` does) and replays them into the model, whose lifted network runs
once on the batched weights (:mod:`pyro_bdl.nn.vectorize`). For a
:class:`~pyro_bdl.models.NetworkModel` it replays them into
:meth:`~pyro_bdl.models.NetworkModel.prediction` alone (what the model returns: the network on a
tensor, mapping or tuple batch, its output reduced to the tensor the likelihood reads, a
one-output regressor's as ``(B,)``), so no labels are sampled; another model runs whole and must
return the network output. Either way the draws are what ``Predictive``'s ``"_RETURN"`` holds.
It works with every guide whose sites follow Pyro's plates (:class:`~pyro_bdl.guides.AutoMeanField`,
:class:`~pyro_bdl.guides.AutoRadial`, :class:`~pyro_bdl.guides.AutoSWAG`,
:class:`~pyro_bdl.guides.AutoSubnetLaplace` after ``fit``, VOGN's ``guide``); guides run under
``torch.no_grad()``, as ``Predictive`` runs them. ``max_parallel`` bounds the memory (and, for
convolutional networks on a CPU, keeps the activations in cache) by drawing at most that many
samples per batched pass. ``max_memory`` (default 4 GiB) bounds the output itself: the bytes
of ``num_samples`` outputs are estimated before the S draws are allocated, and a larger request
is refused with the fix. A parallel run on a :class:`~pyro_bdl.models.NetworkModel` measures
them with one draw on one row of the batch (its examples are along dim 0), so S draws cost one
vectorized pass over the batch and a one-row pass; a sequential run measures them with its
first draw (S draws, S passes), and a parallel run on another model with a draw of its own.
The one-row measure of a :class:`~pyro_bdl.models.NetworkModel` is kept per model and per
shapes, dtypes and devices of the measured row's tensors, so later calls on batches shaped alike
run the S draws' pass alone (on a GPU, where a small batch's pass is bound by the host's Python
work, the measuring pass cost as much as the S draws). The kept size is stale if the model's
output shape changes for inputs shaped alike (its network or output selector replaced in
place): call :func:`forget_output_sizes` then.
:func:`draw_outputs` is the same with a hook on what the guide draws: an ensemble's
:meth:`~pyro_bdl.guides.MemberGuide.member_outputs` draws all its members in one pass so.

Usage::

    logits = bdl.predictive.sample_outputs(model, guide, x_test, num_samples=32)  # (32, B, C)
    probs = logits.softmax(-1).mean(0)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from weakref import WeakKeyDictionary

import pyro
import torch
from pyro import poutine
from pyro.infer.predictive import _guess_max_plate_nesting
from torch.nn.modules.batchnorm import _BatchNorm

from pyro_bdl._validation import check_positive_int
from pyro_bdl.models import NetworkModel
from pyro_bdl.models.checks import batch_tensors, check_network_input
from pyro_bdl.models.structured import rows_of

__all__ = ["draw_outputs", "forget_output_sizes", "sample_outputs"]

#: The default bound on the bytes of the stacked outputs (see :func:`sample_outputs`).
DEFAULT_MAX_MEMORY = 4 * 2**30

#: The plate over posterior draws (Pyro's Predictive uses the same name).
SAMPLES_PLATE = "_num_predictive_samples"


def _draw(model, guide, args, kwargs, size: int | None, dim: int) -> torch.Tensor:
    """The output for ``size`` draws under a plate at ``dim`` (one draw, no plate, if ``None``)."""
    # A NetworkModel replays its own output path (structured batches, ModelOutput selectors).
    target = model.prediction if isinstance(model, NetworkModel) else model
    target_args = args[:1] if isinstance(model, NetworkModel) else args
    target_kwargs = {} if isinstance(model, NetworkModel) else kwargs
    # The guide runs for its draws alone, as Predictive runs it: densities masked out (unused
    # here, and a guide that draws its posterior only then, AutoSWAG, does).
    guide = poutine.mask(guide, mask=False)
    if size is None or size == 1:  # one draw: the network's own shapes, no sample dim to add
        tr = poutine.trace(guide).get_trace(*args, **kwargs)
        out = poutine.replay(target, trace=tr)(*target_args, **target_kwargs)
        return out if size is None else out.unsqueeze(0)
    with pyro.plate(SAMPLES_PLATE, size, dim=dim):
        tr = poutine.trace(guide).get_trace(*args, **kwargs)
        out = poutine.replay(target, trace=tr)(*target_args, **target_kwargs)
    if out.shape[0] != size:
        raise ValueError(
            f"the model's return value has leading dim {out.shape[0]} for {size} samples; "
            "sample_outputs needs a model that returns the network output (as "
            "pyro_bdl.models.classifier/regressor do)."
        )
    return out


def _check_output_memory(one: torch.Tensor, rows: int, num_samples: int, max_memory: int):
    """Refuse ``num_samples`` outputs shaped like the one-draw output ``one`` of ``rows`` rows of
    the batch (the outputs of the whole batch are ``rows`` times larger) beyond ``max_memory``
    bytes."""
    per_draw = one.numel() * one.element_size() * rows
    needed = num_samples * per_draw
    if needed > max_memory:
        shape = (one.shape[0] * rows, *one.shape[1:]) if rows > 1 and one.dim() else one.shape
        raise ValueError(
            f"num_samples={num_samples} outputs of shape {tuple(shape)} ({one.dtype}) need "
            f"{needed} bytes ({needed / 2**30:.1f} GiB), more than max_memory={max_memory}. "
            f"Ask for at most {max(max_memory // max(per_draw, 1), 1)} samples, "
            "call sample_outputs on batches of the inputs, or raise max_memory."
        )


def _probe_inputs(model, args: tuple, kwargs: dict) -> tuple[tuple, dict, int]:
    """The arguments of the draw that measures the output, and how many times its output is
    smaller than the whole batch's: one row of a :class:`~pyro_bdl.models.NetworkModel`'s
    batch (and labels, if given: the guide sees them too), whose examples are along dim 0 of
    every tensor; else all of the arguments (another model's output need not grow with a
    batch dim)."""
    whole = (args, kwargs, 1)
    if not isinstance(model, NetworkModel) or not args:
        return whole
    items = [item for item in (*args, *kwargs.values()) if item is not None]
    try:
        tensors = [t for item in items for t in batch_tensors(item).values()]
    except (TypeError, ValueError):  # not a batch the model's own checks pass: measure it whole
        return whole
    rows = {t.shape[0] if t.dim() else 0 for t in tensors}
    if len(rows) != 1 or min(rows) <= 1:
        return whole
    first = slice(0, 1)
    return rows_of(args, first), rows_of(kwargs, first), rows.pop()


#: Per NetworkModel: the one-draw output of one row (a meta tensor: its shape and dtype) per
#: signature of the row's tensors (see :func:`_row_signature`).
_OUTPUT_SIZES: WeakKeyDictionary[Any, dict[tuple, torch.Tensor]] = WeakKeyDictionary()


def forget_output_sizes(model=None) -> None:
    """Forget the output sizes kept for ``model`` (every model if ``None``), so that the next
    parallel :func:`sample_outputs` measures its output again: needed only where the model's
    output shape changed for inputs of the same shapes (its network replaced in place)."""
    if model is None:
        _OUTPUT_SIZES.clear()
    else:
        _OUTPUT_SIZES.pop(model, None)


def _row_signature(args: tuple, kwargs: dict) -> tuple | None:
    """What the output size of a NetworkModel's draw depends on besides the model: where each
    tensor of the (measured) arguments sits, and its shape, dtype and device; ``None`` for
    arguments that are not batches the model's checks pass (not kept then)."""
    try:
        return tuple(
            (where, name, tuple(t.shape), t.dtype, t.device)
            for where, item in (*enumerate(args), *sorted(kwargs.items()))
            if item is not None
            for name, t in batch_tensors(item).items()
        )
    except (TypeError, ValueError):
        return None


#: Makes the context a block of draws runs in: called with the block's first draw and its size.
Draws = Callable[[int, int], AbstractContextManager]


def draw_outputs(
    model,
    guide,
    args: tuple,
    kwargs: dict,
    *,
    num_samples: int,
    parallel: bool = True,
    max_parallel: int | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    draws: Draws | None = None,
) -> torch.Tensor:
    """:func:`sample_outputs` with a hook on what the guide draws: draws ``start`` …
    ``start + size − 1`` (``size`` of them under one plate, or one plain draw) run inside
    ``draws(start, size)``; the draw that measures the output runs inside ``draws(0, 1)``.
    :meth:`~pyro_bdl.guides.MemberGuide.member_outputs` chooses each draw's ensemble member so.
    The arguments are :func:`sample_outputs`'s, with the model's ``args`` and ``kwargs`` given
    as a tuple and a dict.
    """
    check_positive_int("num_samples", num_samples)
    if max_parallel is not None:
        check_positive_int("max_parallel", max_parallel)
    check_positive_int("max_memory", max_memory)
    if isinstance(model, NetworkModel) and not args and "x" in kwargs:
        # The batch by keyword, as the model takes it too: the network's replay reads it first.
        kwargs = dict(kwargs)
        args = (kwargs.pop("x"),)
    around: Draws = draws if draws is not None else (lambda start, size: nullcontext())
    sequential = not parallel or num_samples == 1
    chunk = num_samples if max_parallel is None else max_parallel
    network = isinstance(model, NetworkModel)
    # Refused before anything runs: the draws replay the network alone, past the model's checks.
    if network and model.check_inputs and args:
        check_network_input(model.shape, args[0])
    if network and not sequential:
        _check_batchnorm_eval(model.net)
    probe_args, probe_kwargs, rows = (
        (args, kwargs, 1) if sequential else _probe_inputs(model, args, kwargs)
    )
    signature = _row_signature(probe_args, probe_kwargs) if network and not sequential else None
    kept = _OUTPUT_SIZES.get(model, {}).get(signature) if signature is not None else None
    if kept is not None:  # measured before on rows shaped alike: the S draws' pass alone
        _check_output_memory(kept, rows, num_samples, max_memory)
        with torch.no_grad(), poutine.block():
            return _draw_chunks(model, guide, args, kwargs, num_samples, chunk, 1, around)
    # Imported here: pyro_bdl.infer imports the guides, which import this module.
    from pyro_bdl.infer.rollback import Rollback, norm_layer_buffers

    owners = (model.net if network else model, guide)
    buffers = norm_layer_buffers(m for m in owners if isinstance(m, torch.nn.Module))
    call = Rollback.saved(buffers)
    if network:
        nesting = 1  # the data plate
    else:  # a run of the model, after the save: undone if the call is refused
        with torch.no_grad():
            nesting = _guess_max_plate_nesting(model, args, kwargs)
    with torch.no_grad(), poutine.block():
        # A draw measures the output before the S draws run. One row of a NetworkModel's batch
        # measures it for a parallel run (the S draws' pass is then the only full pass); a
        # sequential run's first draw is its first sample. The random streams and running
        # statistics moved since the call began are put back when it is refused, and those of
        # the measuring draw always in a parallel run, whose S draws then are those
        # sample_outputs gives without the check (and with a kept measure).
        probe = Rollback.saved(buffers)
        try:
            with around(0, 1):
                one = _draw(model, guide, probe_args, probe_kwargs, None, 0)
            _check_output_memory(one, rows, num_samples, max_memory)
        except BaseException:
            call.restore()
            raise
        if sequential:  # the measuring draw is the first sample
            outputs = [one]
            for i in range(1, num_samples):
                with around(i, 1):
                    outputs.append(_draw(model, guide, args, kwargs, None, 0))
            return torch.stack(outputs)
        probe.restore()
        if signature is not None:
            meta = torch.empty(one.shape, dtype=one.dtype, device="meta")
            _OUTPUT_SIZES.setdefault(model, {})[signature] = meta
        return _draw_chunks(model, guide, args, kwargs, num_samples, chunk, nesting, around)


def _check_batchnorm_eval(net: torch.nn.Module) -> None:
    """Refuse a BatchNorm layer in training mode before a vectorized draw: it would normalise
    with the statistics of the batch (of one row, for the measuring draw) and write its running
    statistics from inside the batched pass, which torch refuses with errors that name neither
    the layer nor the fix."""
    for name, m in net.named_modules():
        if isinstance(m, _BatchNorm) and m.training:
            raise ValueError(
                f"the network's BatchNorm layer {name!r} is in training mode, but "
                "the posterior draws run in one vectorized pass (parallel=True), where "
                "BatchNorm must use its running statistics. Call net.eval() before "
                "predicting (net.train() after, to go on training), or pass parallel=False."
            )


def _draw_chunks(
    model, guide, args: tuple, kwargs: dict, num_samples: int, chunk: int, nesting: int,
    around: Draws,
) -> torch.Tensor:  # fmt: skip
    """The outputs of ``num_samples`` draws, ``chunk`` of them per vectorized pass."""
    outputs = []
    for start in range(0, num_samples, chunk):
        size = min(chunk, num_samples - start)
        with around(start, size):
            outputs.append(_draw(model, guide, args, kwargs, size, -nesting - 1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def sample_outputs(
    model,
    guide,
    *args: Any,
    num_samples: int,
    parallel: bool = True,
    max_parallel: int | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    **kwargs: Any,
) -> torch.Tensor:
    """The model's return value (the network output) for ``num_samples`` posterior draws: the
    values ``Predictive(model, guide, num_samples=S)(x)["_RETURN"]`` holds, e.g. ``(S, B, C)``
    logits of a classifier and ``(S, B)`` means of a one-output regressor.

    :param callable model: a Pyro model that returns the network output, e.g.
        :func:`pyro_bdl.models.classifier`; BatchNorm layers must be in eval mode when
        ``parallel``.
    :param callable guide: any guide of ``model`` (called with the same arguments).
    :param args: the model's inputs (``x``, for a :class:`~pyro_bdl.models.NetworkModel` a
        tensor, a mapping of tensors or a tuple; no labels, so the outputs are predictions).
    :param int num_samples: S, the number of posterior draws.
    :param bool parallel: draw the S samples in one vectorized pass (``True``) or one after the
        other (``False``; same distribution, other random streams). One sample (S = 1) is one
        plain draw either way: a forward pass, not two.
    :param int max_parallel: at most this many samples per vectorized pass (default: all S).
    :param int max_memory: at most this many bytes for the returned outputs (default 4 GiB),
        checked before the S draws run: from a draw on one row of a
        :class:`~pyro_bdl.models.NetworkModel`'s batch (a parallel run; kept for later calls
        on rows shaped alike, see :func:`forget_output_sizes`), else from the first draw.
    :returns: a tensor of shape ``(S, *output_shape)``.
    """
    return draw_outputs(
        model,
        guide,
        args,
        kwargs,
        num_samples=num_samples,
        parallel=parallel,
        max_parallel=max_parallel,
        max_memory=max_memory,
    )
