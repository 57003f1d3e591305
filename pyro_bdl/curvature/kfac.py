r"""Kronecker-factored GGN (KFAC) of ``Linear`` and ``Conv2d`` layers, bias folded in.

For a layer with weight :math:`W` (out × k, a convolution's kernel flattened as ``unfold`` lays
out its input) and bias :math:`b`, write :math:`\bar W = [W, b]` and :math:`\bar a = [a; 1]` for
the layer input. The GGN block of :math:`\mathrm{vec}\,\bar W` (row-major) is

.. math:: \sum_n \sum_k \Big(\sum_t g_{nkt}\bar a_{nt}^\top\Big)^{\otimes 2}, \qquad
          g_{nkt} = \partial (L_{n,:,k}^\top f_n) / \partial z_{nt},

with :math:`L_n L_n^\top = \Lambda_n` (:func:`~pyro_bdl.curvature.ggn.output_hessian_factor`)
and :math:`z_{nt}` the layer output at position t. KFAC (Martens & Grosse 2015) approximates
it by :math:`G \otimes A`, in one of the two forms of Eschenhagen et al. (2023):

*expand* (convolutions, a layer read once per output row, and models whose output rows are not
the layer's examples, such as one row per token): the positions act as further examples,

.. math:: A = \frac1T \sum_{n,t} \bar a_{nt}\bar a_{nt}^\top, \qquad
          G = \frac1N \sum_{n,k,t} g_{nkt} g_{nkt}^\top ;

*reduce* (a ``Linear`` over T > 1 positions of each example whose output is one row, such as a
sequence classifier's attention projections and LoRA adapters over (B, T, d)): the positions
are summed within each example before the Kronecker product,

.. math:: A = \sum_n \sum_k \frac{m_{nk}}{\sum_{k'} m_{nk'}}\,\tilde a_{nk}\tilde a_{nk}^\top,
          \qquad G = \frac1N \sum_{n,k} \tilde g_{nk}\tilde g_{nk}^\top, \qquad
          \tilde g_{nk} = \sum_t g_{nkt},\; m_{nk} = \lVert\tilde g_{nk}\rVert^2,

with :math:`\tilde a_{nk} = \sum_t w_{nkt}\bar a_{nt}`, :math:`w_{nkt} = g_{nkt}^\top\tilde
g_{nk} / m_{nk}` (so :math:`\sum_t w_{nkt} = 1`): of all :math:`\tilde a`, the one whose
:math:`\tilde g_{nk}\tilde a^\top` is nearest to the example's gradient :math:`\sum_t g_{nkt}
\bar a_{nt}^\top` in Frobenius norm. Where every position gets the same gradient (the paper's
mean-pooled case) :math:`w = 1/T` and this is the paper's reduce form; where the gradient
reaches one position only (a query read at the pooled [CLS] token, padding that attention
masks out) it takes that position's input instead of the mean over all T. On a tiny BERT with
LoRA adapters the expand form gave 0.37-0.86 of the exact GGN block's trace, this form
0.99-1.11 (``tests/hf/test_laplace_lora.py``). With T = 1 both forms are the classic KFAC.

It is exact when every example has the same :math:`g` (one output, a Gaussian likelihood, a
single layer). :func:`kfac_sums` returns the unnormalised sums of one batch, so that batches and
data-parallel ranks add them before dividing by the total N.

References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature", ICML 2015.
    Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
    ICML 2016.
    Eschenhagen et al., "Kronecker-Factored Approximate Curvature for Modern Neural Network
    Architectures", NeurIPS 2023.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pyro_bdl.curvature.ggn import residual_coefficients
from pyro_bdl.curvature.jacobian import (
    as_matrix,
    capture,
    exact,
    grad_factor,
    input_factor,
    widened,
)

__all__ = ["KronLayer", "augmented_input", "kfac_sums"]


@dataclass(frozen=True)
class KronLayer:
    """A layer KFAC treats: ``kind`` is ``"linear"`` or ``"conv"``; ``bias`` whether its bias is
    folded into the input factor."""

    module: nn.Module
    kind: str
    bias: bool


def augmented_input(layer: KronLayer, a: torch.Tensor) -> torch.Tensor:
    """The layer input as (B, k [+1], T), with a row of ones appended when the bias is folded."""
    x = input_factor(layer.kind, layer.module, a)
    if layer.bias:
        x = torch.cat([x, x.new_ones(x.shape[0], 1, x.shape[2])], 1)
    return x


def gram(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_{b,t} x_{b,:,t} x_{b,:,t}^\top` of ``x`` (B, k, T), as one matrix product in
    ``x``'s dtype (float32 or wider): a batch's sum of some thousand positions loses about
    :math:`10^{-6}` relatively in float32, and the batches add up in the sums' float64."""
    with exact(x.device):
        flat = x.transpose(1, 2).reshape(-1, x.shape[1])
        return flat.T @ flat


def is_reduce(layer: KronLayer, calls: Sequence[tuple], rows: int) -> bool:
    """Whether ``layer`` is in the "reduce" setting: a ``Linear`` whose calls read several
    positions t of each of the ``rows`` examples whose outputs are one row each (a sequence
    classifier's layers over (B, T, d)). Convolutions keep the expand form of Grosse & Martens."""
    if layer.kind != "linear" or any(a.shape[0] != rows for a, _ in calls):
        return False
    return sum(a.numel() // max(a.shape[0] * a.shape[-1], 1) for a, _ in calls) > 1


def reduce_parts(
    layer: KronLayer, xg: Sequence[tuple[torch.Tensor, torch.Tensor]], columns: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``(m, ã, g̃)`` of a reduce layer for one group of ``columns`` columns k of L: per column
    and example the summed gradient :math:`\tilde g_{nk} = \sum_t g_{nkt}` (k·B, out), its squared
    norm :math:`m_{nk}` (k, B) and the input average :math:`\tilde a_{nk} = \sum_t w_{nkt}\bar
    a_{nt}` (k, B, in) with :math:`w_{nkt} = g_{nkt}^\top\tilde g_{nk} / m_{nk}` (uniform 1/T where
    :math:`m_{nk} = 0`). ``xg`` holds each call's input (B, in, T) and output gradients
    (≥ columns, B, ...); the calls' positions are concatenated."""
    gs, xs = [], []
    for x, g in xg:
        flat = widened(grad_factor(layer.kind, g[:columns].flatten(0, 1)))
        gs.append(flat.unflatten(0, (columns, x.shape[0])))
        xs.append(x)
    g = torch.cat(gs, -1)  # (k, B, out, T)
    x = torch.cat(xs, -1).to(g.dtype)  # (B, in, T)
    with exact(g.device):
        g_sum = g.sum(-1)
        m = g_sum.square().sum(-1)
        w = (
            torch.einsum("kbot,kbo->kbt", g, g_sum)
            / m.clamp_min(torch.finfo(m.dtype).tiny)[..., None]
        )
        w = torch.where((m > 0)[..., None], w, w.new_full((), 1 / x.shape[-1]))
        mean_in = torch.einsum("kbt,bit->kbi", w, x)
    return m, mean_in, g_sum.flatten(0, 1)


def reduced_input_sum(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    r""":math:`\sum_n \sum_k (m_{nk} / \sum_{k'} m_{nk'})\,\tilde a_{nk}\tilde a_{nk}^\top` of one
    batch from every column group's :func:`reduce_parts` (uniform weights 1/K over the columns of
    an example with no curvature): one unit of weight per example, as the expand form's
    :math:`\frac1T\sum_t \bar a_{nt}\bar a_{nt}^\top`."""
    m = torch.cat([p[0] for p in parts])
    mean_in = torch.cat([p[1] for p in parts])
    total = m.sum(0)
    weight = torch.where(total > 0, m / total.clamp_min(torch.finfo(m.dtype).tiny), 1 / m.shape[0])
    with exact(mean_in.device):
        return torch.einsum("kb,kbi,kbj->ij", weight, mean_in, mean_in)


def kfac_sums(
    forward: Callable[[], torch.Tensor],
    layers: Sequence[KronLayer],
    factor_fn: Callable[[torch.Tensor], torch.Tensor],
    a_sums: list[torch.Tensor],
    g_sums: list[torch.Tensor],
    *,
    grad_bytes: int = 32 << 20,
    residual_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grad_sums: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    r"""Add one batch's sums of :math:`A` to ``a_sums`` and of :math:`N G` to ``g_sums`` (one
    entry per layer, in place, in their dtype; the expand or reduce form by :func:`is_reduce`)
    and return the detached outputs (B, C).

    ``factor_fn(outputs)`` gives :math:`L` (B, C, K); one vmapped backward pass per group of
    columns k, as many as keep the gradients at the layers' outputs within ``grad_bytes``
    (at least one). A layer called several times contributes every call as further positions t.
    With ``residual_fn`` (outputs (B, C) -> :math:`r` (B, C)) the gradient
    :math:`\sum_n J_n^\top r_n` of each layer's :math:`\bar W` (out × k [+1]) is added to
    ``grad_sums``, taken as one more column of the same backward passes.
    """
    modules = [layer.module for layer in layers]
    with capture(modules) as calls:
        out = as_matrix(forward())
    factor = factor_fn(out).detach()
    kept = factor.shape[-1]  # columns of L; a residual column after them is a gradient
    coef = None
    if residual_fn is not None and grad_sums is not None:
        r = residual_fn(out.detach())
        # The gradient is a weighted sum of the columns' passes when r lies in their span (the
        # categorical residual always does): then it costs no backward pass of its own.
        coef = residual_coefficients(factor, r)
        if coef is None:
            factor = torch.cat([factor, r.to(factor).unsqueeze(-1)], -1)
    zs, owner = [], []
    inputs: list[torch.Tensor | None] = []
    grams: dict[tuple, torch.Tensor] = {}
    reduced = [is_reduce(layer, calls[layer.module], out.shape[0]) for layer in layers]
    # Per reduce layer: each column group's (m, ã) of :func:`reduce_parts`, A after the passes.
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layers]
    for i, layer in enumerate(layers):
        if not calls[layer.module]:
            raise ValueError(
                f"layer {type(layer.module).__name__} of the Kronecker-factored subnetwork is not "
                "called by the model's forward pass; choose a subnetwork of layers the model uses."
            )
        positions, local = 0, torch.zeros_like(a_sums[i])
        for a, z in calls[layer.module]:
            x = widened(augmented_input(layer, a))
            zs.append(z)
            owner.append(i)
            inputs.append(x if grad_sums is not None or reduced[i] else None)
            if reduced[i]:
                continue
            positions += x.shape[2]
            # Layers reading one input (LoRA's A matrices of query and value) share its product.
            key = (layer.kind, layer.bias, a.data_ptr(), a.shape, a.stride(), a.dtype)
            if layer.kind != "linear" or key not in grams:
                grams[key] = gram(x).to(local.dtype)
            local += grams[key]
        if not reduced[i]:
            a_sums[i] += local / positions
    # Several columns of L per backward pass (vmapped), as many as keep their layer-output
    # gradients within ``grad_bytes``; one column (two classes) is one plain backward pass.
    per_column = sum(z.numel() * z.element_size() for z in zs)
    step = max(1, min(factor.shape[-1], grad_bytes // max(per_column, 1)))
    for k in range(0, factor.shape[-1], step):
        columns = factor[:, :, k : k + step].permute(2, 0, 1).to(out)
        if columns.shape[0] == 1:
            grads = tuple(
                None if g is None else g.unsqueeze(0)
                for g in torch.autograd.grad(
                    out, zs, grad_outputs=columns[0], retain_graph=True, allow_unused=True
                )
            )
        else:
            grads = torch.autograd.grad(
                out,
                zs,
                grad_outputs=columns,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        squared = max(0, min(columns.shape[0], kept - k))  # the columns of L in this group
        if squared > 0:
            xg: dict[int, list] = {}  # per reduce layer, its calls' (input, output gradients)
            for i, layer_in, g in zip(owner, inputs, grads):
                if reduced[i] and layer_in is not None and g is not None:
                    xg.setdefault(i, []).append((layer_in, g))
            for i, calls_xg in xg.items():
                m, mean_in, g_sum = reduce_parts(layers[i], calls_xg, squared)
                parts[i].append((m, mean_in))
                g_sums[i] += gram(g_sum.unsqueeze(-1)).to(g_sums[i].dtype)
        for i, x_in, g in zip(owner, inputs, grads):
            if g is None:
                continue
            if squared > 0 and not reduced[i]:
                gg = widened(grad_factor(layers[i].kind, g[:squared].flatten(0, 1)))
                g_sums[i] += gram(gg).to(g_sums[i].dtype)
            if grad_sums is None:
                continue
            assert x_in is not None  # kept whenever grad_sums is given
            if coef is not None and squared > 0:
                # Each example's gradient at the layer output, Σ_k c_nk g_nk.
                w = coef[:, k : k + squared].T.to(grad_sums[i].dtype)
                gr = (g[:squared].to(w.dtype) * w.reshape(*w.shape, *[1] * (g.dim() - 2))).sum(0)
            elif squared < g.shape[0]:
                gr = g[squared]
            else:
                continue
            gr = grad_factor(layers[i].kind, gr).to(grad_sums[i].dtype)
            grad_sums[i] += torch.einsum("bot,bkt->ok", gr, x_in.to(gr.dtype))
    for i, kept_parts in enumerate(parts):
        if kept_parts:
            a_sums[i] += reduced_input_sum(kept_parts).to(a_sums[i].dtype)
    return out.detach()
