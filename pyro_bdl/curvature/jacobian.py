r"""The Jacobian of a network's outputs with respect to a subnetwork of its weights, computed
directly.

For outputs :math:`f(x, \theta) \in \mathbb{R}^C` and a subnetwork :math:`S` of the packed weight
vector, :func:`subnet_jacobian` returns :math:`J_S = \partial f / \partial \theta_S` of shape
``(B, C, S)`` without ever forming a ``B × C × D`` tensor over all ``D`` weights. For ``Linear``
and ``Conv2d`` layers a forward hook keeps the layer's input :math:`a`, one backward pass per
output gives the gradient :math:`g` at the layer's output, and the per-example derivative with
respect to weight :math:`W_{ij}` is :math:`g_i a_j` (summed over positions for convolutions and
sequence dims), evaluated only at the selected entries. Any other parameter falls back to one
backward pass per (example, output) pair that reads the gradient of that tensor only. A
``transform`` of the outputs (the difference of two logits, say) is differentiated instead of
them where fewer rows carry all that the caller needs: one backward pass per transformed output.

Memory is :math:`O(B \cdot C \cdot S)` for the result plus the forward graph of the network. The
same hooks give the diagonal GGN over all weights (:func:`~pyro_bdl.curvature.ggn.diagonal_ggn`).

Usage::

    slots = [ParamSlot(net[0].weight, net[0], "weight"), ParamSlot(net[0].bias, net[0], "bias")]
    jac = subnet_jacobian(lambda: net(x), slots, torch.tensor([0, 5, 7]))

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pyro_bdl._grad_mode import differentiates
from pyro_bdl._validation import autocast_enabled

__all__ = ["ParamSlot", "exact", "subnet_jacobian", "widened"]


class ParamSlot(NamedTuple):
    """One weight tensor of the packed vector.

    :ivar value: the tensor the forward pass uses (it must require grad).
    :ivar module: the layer that uses it (``None``: use the generic fallback).
    :ivar str name: its name in ``module`` (``"weight"`` or ``"bias"`` take the fast path).
    """

    value: torch.Tensor
    module: nn.Module | None
    name: str


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is in a narrower float (bfloat16, float16, as a network run under
    ``torch.autocast`` gives): curvature is accumulated in float32 or float64, never narrower."""
    if t.is_floating_point() and torch.finfo(t.dtype).bits < 32:
        return t.float()
    return t


def exact(device: torch.device) -> contextlib.AbstractContextManager:
    """A block where ``torch.autocast`` is off on ``device``, so that the products that
    accumulate (curvature, sums over samples) run in their operands' (widened) dtype rather
    than the autocast one; nothing to do where autocast is off or unknown (the meta device)."""
    if not autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def fast_kind(slot: ParamSlot) -> str | None:
    """``"linear"``/``"conv"`` when the per-example derivative has a closed form from hooks."""
    m = slot.module
    if slot.name not in ("weight", "bias") or m is None:
        return None
    if isinstance(m, nn.Linear):
        return "linear"
    if (
        isinstance(m, nn.Conv2d)
        and m.groups == 1
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    ):
        return "conv"
    return None


def input_factor(kind: str, module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """The layer input as (B, K, T), so that the per-example weight gradient is
    ``Σ_t g[b,:,t] a[b,:,t]ᵀ`` with ``g`` from :func:`grad_factor`."""
    if kind == "linear":
        return a.reshape(a.shape[0], -1, a.shape[-1]).transpose(1, 2)
    assert isinstance(module, nn.Conv2d)
    return F.unfold(
        a,
        module.kernel_size,
        dilation=module.dilation,
        padding=module.padding,  # type: ignore[arg-type]
        stride=module.stride,
    )


def grad_factor(kind: str, g: torch.Tensor) -> torch.Tensor:
    """The gradient at the layer output as (B, O, T)."""
    if kind == "linear":
        return g.reshape(g.shape[0], -1, g.shape[-1]).transpose(1, 2)
    return g.flatten(2)


def _select(slot: ParamSlot, a, g, local: torch.Tensor, budget: int = 1 << 20):
    """Per-example derivatives at the flat entries ``local`` of ``slot``: shape (B, len(local)),
    from :func:`input_factor` and :func:`grad_factor`."""
    if slot.name == "bias":
        return g.sum(-1)[:, local]
    b, o, k = a.shape[0], g.shape[1], a.shape[1]
    if 4 * local.numel() >= o * k:
        # A dense selection (a whole adapter, say): one batched matrix product per chunk of
        # examples, B × O × K × T multiply-adds at BLAS speed, beats gathering B × S × T numbers
        # one column at a time; each chunk's product holds at most ``budget`` numbers.
        examples = max(1, budget // (o * k))
        parts = [
            torch.einsum("bot,bkt->bok", gp, ap).flatten(1)[:, local]
            for gp, ap in zip(g.split(examples), a.split(examples))
        ]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    out = []
    # Chunk the columns: each of the three temporaries below holds B × chunk × T ≤ ``budget``
    # numbers (for chunks of at least one column), not B × S × T.
    chunk = max(1, budget // (b * a.shape[2]))
    for part in local.split(chunk):
        rows, cols = part // k, part % k
        out.append((g[:, rows, :] * a[:, cols, :]).sum(-1))
    return torch.cat(out, 1)


def per_example_full(slot: ParamSlot, kind: str, a, g) -> torch.Tensor:
    """Per-example gradient of the whole tensor, (B, numel), in float32 or wider; callers chunk
    the batch."""
    a, g = input_factor(kind, slot.module, a), grad_factor(kind, g)  # type: ignore[arg-type]
    a, g = widened(a), widened(g)
    if slot.name == "bias":
        return g.sum(-1)
    with exact(g.device):
        return torch.einsum("bot,bkt->bok", g, a).flatten(1)


def batch_gradient(slot: ParamSlot, kind: str, a, g) -> torch.Tensor:
    """The gradient of the whole tensor summed over the batch, (numel,): what
    :func:`per_example_full` gives summed over examples, without the per-example tensor."""
    a, g = input_factor(kind, slot.module, a), grad_factor(kind, g)  # type: ignore[arg-type]
    a, g = widened(a), widened(g)
    if slot.name == "bias":
        return g.sum((0, -1))
    with exact(g.device):
        return torch.einsum("bot,bkt->ok", g, a).flatten()


@contextlib.contextmanager
def capture(modules: Sequence[nn.Module]) -> Iterator[dict[nn.Module, list]]:
    """Forward hooks recording ``(input, output)`` of every call of ``modules``."""
    calls: dict[nn.Module, list] = {m: [] for m in modules}

    def hook(module, inputs, output):
        calls[module].append((inputs[0].detach(), output))

    handles = [m.register_forward_hook(hook) for m in calls]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def placements(slots: Sequence[ParamSlot], index: torch.Tensor):
    """For each slot: (slot, fast kind, local flat indices, positions in ``index``)."""
    out, offset = [], 0
    for slot in slots:
        n = slot.value.numel()
        mask = (index >= offset) & (index < offset + n)
        pos = mask.nonzero().squeeze(-1)
        if pos.numel():
            out.append((slot, fast_kind(slot), index[pos] - offset, pos))
        offset += n
    return out


def as_matrix(out: torch.Tensor) -> torch.Tensor:
    if out.dim() == 1:
        return out.unsqueeze(-1)
    if out.dim() != 2:
        raise ValueError(
            f"the network outputs must have shape (B, C) or (B,); got {tuple(out.shape)}. "
            "Flatten the outputs per example."
        )
    return out


@differentiates
def subnet_jacobian(
    forward: Callable[[], torch.Tensor],
    slots: Sequence[ParamSlot],
    index: torch.Tensor,
    *,
    return_outputs: bool = False,
    select_numbers: int = 1 << 20,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    r"""Jacobian of the outputs with respect to the packed weights at ``index``: (B, C, S).

    The packed vector is the concatenation of ``slot.value.reshape(-1)`` in order. Examples must
    be independent (BatchNorm in eval mode). One backward pass per output for ``Linear``/``Conv2d``
    weights; one per (example, output) for anything else. ``forward`` runs with autograd on,
    also when called under ``torch.no_grad()`` or ``torch.inference_mode()``.

    :param forward: runs the network and returns its outputs, (B, C) or (B,) (taken as C = 1).
    :param slots: the weight tensors, in packing order.
    :param torch.Tensor index: packed indices of the subnetwork (any order, no duplicates).
    :param bool return_outputs: also return the detached outputs (B, C).
    :param int select_numbers: numbers in each of the three temporaries that pick the selected
        entries of a layer (B × columns × positions); bounds their memory.
    :param transform: differentiate ``transform(outputs)`` (B, K) instead of the outputs: a map
        acting on each example's row alone, such as the difference of two logits, so that the
        Jacobian takes K backward passes rather than C (the returned outputs stay untransformed).
    """
    index = index.to(torch.long)
    placed = placements(slots, index.cpu())
    fast_modules = list({id(s.module): s.module for s, k, _, _ in placed if k}.values())
    with capture(fast_modules) as calls:  # type: ignore[arg-type]
        out = as_matrix(forward())
    target = out if transform is None else as_matrix(transform(out))
    if target.shape[0] != out.shape[0]:
        raise ValueError(
            f"transform must keep the batch dimension: outputs of shape {tuple(out.shape)} gave "
            f"{tuple(target.shape)}. Map each example's outputs alone."
        )
    b, c = target.shape
    jac = widened(target).new_zeros(b, c, index.numel())
    pairs = [(m, call) for m in fast_modules for call in calls[m]]
    zs = [z for _, (_, z) in pairs]
    fallback = [(s, loc, pos) for s, k, loc, pos in placed if not k]
    unfolded: dict[int, torch.Tensor] = {}
    for j in range(c):
        if zs:
            v = torch.zeros_like(target)
            v[:, j] = 1
            grads = torch.autograd.grad(
                target,
                zs,
                grad_outputs=v,
                retain_graph=j < c - 1 or bool(fallback),
                allow_unused=True,
            )
            g_of = {id(z): g for z, g in zip(zs, grads)}
            for slot, kind, loc, pos in placed:
                if not kind:
                    continue
                for a, z in calls[slot.module]:  # type: ignore[index]
                    g = g_of[id(z)]
                    if g is None:
                        continue
                    # The unfolded input does not depend on the output: build it once.
                    if id(z) not in unfolded:
                        unfolded[id(z)] = input_factor(kind, slot.module, a)  # type: ignore[arg-type]
                    with exact(jac.device):
                        part = _select(
                            slot,
                            widened(unfolded[id(z)]),
                            widened(grad_factor(kind, g)),
                            loc.to(a.device),
                            select_numbers,
                        )
                    jac[:, j, pos.to(jac.device)] += part
        for i in range(b if fallback else 0):
            values = [s.value for s, _, _ in fallback]
            grads = torch.autograd.grad(target[i, j], values, retain_graph=True, allow_unused=True)
            for (_, loc, pos), g in zip(fallback, grads):
                if g is not None:
                    jac[i, j, pos.to(jac.device)] = g.reshape(-1)[loc.to(g.device)].to(jac)
    return (jac, widened(out.detach())) if return_outputs else jac
