r"""Three exact forms of a layer's squared per-example gradients, and the cost model that picks
one per layer call (docs/design/vogn.md, "The per-example cost model").

A ``Linear`` or convolution call is, per example :math:`n`, a sum over :math:`P` output positions
:math:`p` of outer products: :math:`G_n = \sum_p \delta_{np} u_{np}^\top`, with
:math:`\delta_{np}` the gradient at the output (``O`` numbers per group) and :math:`u_{np}` the
matching patch of the input (``K`` numbers per group: input channels per group × kernel size; the
input itself for ``Linear``). VOGN needs :math:`\sum_n G_n` and :math:`\sum_n G_n \odot G_n`:

- ``"grouped"``: every :math:`G_n` at once from one grouped weight-gradient convolution with the
  batch folded into the groups (:func:`~pyro_bdl.curvature.layer_rules.conv_per_example`), then
  squared and summed. No unfolded copy of the input, but the backend's grouped kernel is slow
  for many channels per group.
- ``"unfold"``: the input unfolded into patches ``(c, g, K, P)`` (im2col), :math:`G_n` by one
  batched matrix product over examples and groups, then squared and summed.
- ``"pairs"``: no :math:`G_n` at all. Expanding the square,

  .. math:: \sum_n G_n \odot G_n = \sum_n \sum_{p \le q} w_{pq}
     (\delta_{np} \odot \delta_{nq})(u_{np} \odot u_{nq})^\top, \quad w_{pp} = 1, w_{p<q} = 2,

  one matrix product over the :math:`B \cdot P(P+1)/2` (example, position pair) rows. With one
  position (a ``Linear`` on ``(B, in)``, a convolution whose output is 1 × 1: the last stage of
  a ResNet on CIFAR) this is :math:`(\delta^2)^\top(u^2)`, as cheap as the ordinary weight
  gradient; its cost grows as :math:`P^2`.

The cost model (:func:`form_costs`) charges each form its multiply-adds plus
:data:`FLOPS_PER_NUMBER` for every number it writes or reads through memory; the constants were
measured on one CPU thread (about 100 GFLOP/s against 5 GB/s for tensors past the caches) and
the ratio is about the same on a GPU (about 60 TFLOP/s fp32 against 3 TB/s). Each form runs in
chunks of the batch whose temporaries stay below a number budget.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyro_bdl.curvature.layer_rules import batch_slices, conv_per_example

__all__ = [
    "FORMS",
    "choose_form",
    "form_costs",
    "form_work",
    "pairs_squares",
    "pairs_sums",
    "patches",
    "unfold_per_example",
]

#: The forms :func:`choose_form` picks from (``PerExampleGradients(form=...)`` forces one).
FORMS = ("grouped", "unfold", "pairs")

#: Multiply-adds a number moved through memory costs as much time as (20 FLOP/byte × 4 bytes).
FLOPS_PER_NUMBER = 80

#: Memory passes over each per-example gradient number: written, squared in place, summed (and
#: the grouped kernel writes through an intermediate buffer of the same size: measured 2× slower
#: than the batched product on one CPU thread for ResNet-18's layers, whatever their shape).
PASSES = {"unfold": 3, "grouped": 6}

#: Memory passes over each unfolded input number: the strided copy, read by the product.
PATCH_PASSES = 4


def layer_shape(
    module: nn.Module, a: torch.Tensor, delta: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """``(B, O, K, P, g)``: batch, output channels, inputs per group and patch, positions,
    groups of one call of a ``Linear`` or convolution."""
    batch = a.shape[0]
    if isinstance(module, nn.modules.conv._ConvNd):
        g = module.groups
        k = module.in_channels // g * math.prod(module.kernel_size)
        return batch, module.out_channels, k, delta[0, 0].numel(), g
    return batch, delta.shape[-1], a.shape[-1], delta[0].numel() // delta.shape[-1], 1


def form_work(
    batch: int, out: int, k: int, positions: int, groups: int, conv: bool
) -> dict[str, tuple[int, int]]:
    """``{form: (FLOP, numbers moved through memory)}`` of one call; ``conv``: a convolution
    (``grouped`` is a convolution kernel, and ``unfold`` copies the input into patches)."""
    flops = 2 * batch * positions * out * k
    per_example = batch * out * k
    patches_ = batch * groups * k * positions if conv else 0
    pairs = positions * (positions + 1) // 2
    work = {
        "unfold": (flops, PASSES["unfold"] * per_example + PATCH_PASSES * patches_),
        # The squares' product and Σₙ Gₙ's; the two product matrices formed, then read.
        "pairs": (
            2 * batch * pairs * out * k + flops,
            2 * batch * pairs * (out + groups * k) + PATCH_PASSES * patches_,
        ),
    }
    if conv:
        work["grouped"] = (flops, PASSES["grouped"] * per_example)
    return work


def form_costs(batch: int, out: int, k: int, positions: int, groups: int, conv: bool):
    """Estimated cost of each form of one call, FLOP + :data:`FLOPS_PER_NUMBER` × numbers moved
    (:func:`form_work`)."""
    work = form_work(batch, out, k, positions, groups, conv)
    return {form: f + FLOPS_PER_NUMBER * n for form, (f, n) in work.items()}


def choose_form(module: nn.Module, a: torch.Tensor, delta: torch.Tensor, single: bool) -> str:
    """The cheapest form for one call; ``single``: the layer's only call in the pass (with weight
    sharing the calls' per-example gradients add before squaring, which ``pairs`` cannot)."""
    shape = layer_shape(module, a, delta)
    costs = form_costs(*shape, conv=isinstance(module, nn.modules.conv._ConvNd))
    if not single:
        costs.pop("pairs")
    return min(costs, key=costs.__getitem__)


def patches(module: nn.Module, a: torch.Tensor, examples_inside: bool = False) -> torch.Tensor:
    """The input as patches (im2col) ``(c, g, P, K)``, or ``(g, P, c, K)`` if
    ``examples_inside``, each patch in the layout of the weight's ``(O/g, K)`` rows, for a
    ``Linear`` (``g = 1``; ``P``: the positions between batch and features) or a 1-, 2- or 3-d
    convolution (any stride, padding and padding mode, dilation, groups)."""
    c = a.shape[0]
    if not isinstance(module, nn.modules.conv._ConvNd):
        x = a.reshape(c, 1, -1, a.shape[-1])
        return x.permute(1, 2, 0, 3).contiguous() if examples_inside else x
    nd = a.dim() - 2
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, module._reversed_padding_repeated_twice, mode=mode)
    elif any(module.padding):
        a = F.pad(a, [p for p in reversed(module.padding) for _ in (0, 1)])  # type: ignore[arg-type]
    x = a.reshape(c, module.groups, -1, *a.shape[2:])
    for i in range(nd):
        span = (module.kernel_size[i] - 1) * module.dilation[i] + 1
        x = x.unfold(3 + i, span, module.stride[i])
    if any(d > 1 for d in module.dilation):
        steps: list[Any] = [slice(None, None, d) for d in module.dilation]
        x = x[(..., *steps)]
    # x: (c, g, C/g, out..., k...); the weight's rows are (C/g, k...), positions (out...).
    out_dims, k_dims = list(range(3, 3 + nd)), list(range(3 + nd, 3 + 2 * nd))
    order = [1, *out_dims, 0, 2, *k_dims] if examples_inside else [0, 1, *out_dims, 2, *k_dims]
    x = x.permute(order)
    positions = math.prod(x.shape[1 : 1 + nd] if examples_inside else x.shape[2 : 2 + nd])
    if examples_inside:
        return x.reshape(module.groups, positions, c, -1)
    return x.reshape(c, module.groups, positions, -1)


def _grads_by_position(module: nn.Module, delta: torch.Tensor, groups: int) -> torch.Tensor:
    """The output gradient as ``(c, g, O/g, P)``."""
    c = delta.shape[0]
    if isinstance(module, nn.modules.conv._ConvNd):
        return delta.reshape(c, groups, -1, delta[0, 0].numel())
    return delta.reshape(c, 1, -1, delta.shape[-1]).transpose(2, 3)


def unfold_per_example(module: nn.Module, a: torch.Tensor, delta: torch.Tensor):
    """Per-example weight gradients ``(c, *weight.shape)`` by one batched product of the
    patches, and bias gradients ``(c, O)``."""
    u = patches(module, a)
    c, g, _, k = u.shape
    d = _grads_by_position(module, delta, g)
    pe = torch.matmul(d, u)  # (c, g, O/g, K)
    return {
        "weight": pe.reshape(c, *_weight_shape(module, g * d.shape[2], k)),
        "bias": d.sum(-1).reshape(c, -1),
    }


def _weight_shape(module: nn.Module, out: int, k: int) -> tuple[int, ...]:
    if isinstance(module, nn.modules.conv._ConvNd):
        return (out, module.in_channels // module.groups, *module.kernel_size)
    return (out, k)


def pairs_squares(
    module: nn.Module,
    a: torch.Tensor,
    delta: torch.Tensor,
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    add: bool = False,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    r"""``{name: (Σₙ Gₙ, Σₙ Gₙ²)}`` of a chunk, weight and bias, by the position-pair identity,
    with no per-example gradient formed; written into (``add``: added to) ``out[name]`` where
    given, so the products land in their destination without a copy."""
    out = out or {}
    if a.dim() == 2 and not isinstance(module, nn.modules.conv._ConvNd):
        return _linear_sums(a, delta, out, add)
    u = patches(module, a, examples_inside=True)  # (g, P, c, K)
    g, p, c, k = u.shape
    d = _grads_by_position(module, delta, g).permute(1, 2, 3, 0).contiguous()  # (g, O/g, P, c)
    o = d.shape[1]
    if p == 1:
        du, uu = d.square(), u.square()
    else:
        # Pair rows (p, q ≥ p) in blocks of fixed p: products of contiguous slices, no gather.
        pairs = p * (p + 1) // 2
        uu, du = u.new_empty(g, pairs, c, k), d.new_empty(g, o, pairs, c)
        start = 0
        for first in range(p):
            stop = start + p - first
            torch.mul(u[:, first : first + 1], u[:, first:], out=uu[:, start:stop])
            torch.mul(d[:, :, first : first + 1], d[:, :, first:], out=du[:, :, start:stop])
            du[:, :, start + 1 : stop].mul_(2)  # w_pq = 2 off the diagonal
            start = stop
    shape = _weight_shape(module, g * o, k)
    dest = out.get("weight")
    if dest is None:
        dest = (u.new_empty(shape), u.new_empty(shape))
        add = False
    # Σ over (position, example) rows per group: Σₙ Gₙ, the ordinary weight gradient; over
    # (pair, example) rows: Σₙ Gₙ². Each one product per group, (g, O/g, ·) @ (g, ·, K).
    grad, squares = dest[0].view(g, o, k), dest[1].view(g, o, k)
    rows, cols = du.reshape(g, o, -1), uu.reshape(g, -1, k)
    if add:
        grad.baddbmm_(d.reshape(g, o, -1), u.reshape(g, -1, k))
    else:
        torch.bmm(d.reshape(g, o, -1), u.reshape(g, -1, k), out=grad)
    if p == 1:  # no cross terms: every term is a square
        squares.baddbmm_(rows, cols) if add else torch.bmm(rows, cols, out=squares)
    else:
        # Cross terms can round a true zero slightly below it; a sum of squares is not.
        part = torch.bmm(rows, cols).clamp_min_(0)
        squares.add_(part) if add else squares.copy_(part)
    bias = d.sum(2)  # (g, O/g, c): per-example bias gradients
    sums = (bias.sum(-1).reshape(-1), bias.square().sum(-1).reshape(-1))
    result = {"weight": dest}
    if "bias" in out:
        for total, value in zip(out["bias"], sums):
            total.add_(value) if add else total.copy_(value)
        result["bias"] = out["bias"]
    else:
        result["bias"] = sums
    return result


def _linear_sums(a, delta, out, add: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`pairs_squares` of a ``Linear`` on ``(c, in)``: one position, so
    Σₙ Gₙ = δᵀa and Σₙ Gₙ² = (δ²)ᵀ(a²), written by matrix products straight into ``out``."""
    result = {}
    d2 = delta.square()
    for name, x1, x2 in (
        ("weight", (delta.T, a), (d2.T, a.square())),
        ("bias", (delta,), (d2,)),
    ):
        op = torch.mm if name == "weight" else _column_sum
        dest = out.get(name)
        if dest is None:
            result[name] = (op(*x1), op(*x2))
            continue
        if add:
            dest[0].add_(op(*x1))
            dest[1].add_(op(*x2))
        else:
            op(*x1, out=dest[0])
            op(*x2, out=dest[1])
        result[name] = dest
    return result


def _column_sum(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return x.sum(0) if out is None else torch.sum(x, 0, out=out)


def pairs_sums(module, a, delta, targets, dest, add: bool, max_elements: int, chunk_size):
    """``{name: (Σₙ gₙ, Σₙ gₙ²)}`` over the batch by :func:`pairs_squares`, chunk by chunk
    (written into or added to ``dest[name]`` where given)."""
    sums = {n: dest[n] for n in targets if n in dest}
    batch = a.shape[0]
    if (
        chunk_size is None
        and numbers_per_example(module, "pairs", a, delta) * batch <= max_elements
    ):
        sums = pairs_squares(module, a, delta, out=sums, add=add)  # the whole batch at once
        return {n: sums[n] for n in targets}
    per_row = numbers_per_example(module, "pairs", a, delta)
    for lo, hi in batch_slices(batch, per_row, max_elements, chunk_size):
        # The first chunk writes (or adds, as asked) into the destinations; the others add.
        sums = pairs_squares(module, a[lo:hi], delta[lo:hi], out=sums, add=add or lo > 0)
    return {n: sums[n] for n in targets}


def per_example(module: nn.Module, form: str, a: torch.Tensor, delta: torch.Tensor):
    """Per-example gradients of a chunk by ``"grouped"`` or ``"unfold"``."""
    if form == "grouped":
        return conv_per_example(module, a, delta)  # type: ignore[arg-type]
    return unfold_per_example(module, a, delta)


def numbers_per_example(module: nn.Module, form: str, a: torch.Tensor, delta: torch.Tensor):
    """Numbers a form's temporaries hold per example (to size the chunks of the batch)."""
    _, out, k, positions, groups = layer_shape(module, a, delta)
    patch = groups * k * positions if isinstance(module, nn.modules.conv._ConvNd) else 0
    if form == "pairs":
        return (positions * (positions + 1) // 2 + positions) * (out + groups * k) + patch
    return out * k + patch
