r"""Kronecker-factored GGN (KFAC) of ``Linear`` and ``Conv2d`` layers, bias folded in.

For a layer with weight :math:`W` (out × k, a convolution's kernel flattened as ``unfold`` lays
out its input) and bias :math:`b`, write :math:`\bar W = [W, b]` and :math:`\bar a = [a; 1]` for
the layer input. The GGN block of :math:`\mathrm{vec}\,\bar W` (row-major) is

.. math:: \sum_n \sum_k \Big(\sum_t g_{nkt}\bar a_{nt}^\top\Big)^{\otimes 2}, \qquad
          g_{nkt} = \partial (L_{n,:,k}^\top f_n) / \partial z_{nt},

with :math:`L_n L_n^\top = \Lambda_n` (:func:`~pyro_bdl.curvature.ggn.output_hessian_factor`)
and :math:`z_{nt}` the layer output at position t. KFAC (Martens & Grosse 2015; the "expand"
form of Eschenhagen et al. 2023 for positions t) approximates it by :math:`G \otimes A` with

.. math:: A = \frac1T \sum_{n,t} \bar a_{nt}\bar a_{nt}^\top, \qquad
          G = \frac1N \sum_{n,k,t} g_{nkt} g_{nkt}^\top .

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
    r"""Add one batch's :math:`\frac1T\sum \bar a\bar a^\top` to ``a_sums`` and
    :math:`\sum g g^\top` to ``g_sums`` (one entry per layer, in place, in their dtype) and
    return the detached outputs (B, C).

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
    for i, layer in enumerate(layers):
        if not calls[layer.module]:
            raise ValueError(
                f"layer {type(layer.module).__name__} of the Kronecker-factored subnetwork is not "
                "called by the model's forward pass; choose a subnetwork of layers the model uses."
            )
        positions, local = 0, torch.zeros_like(a_sums[i])
        for a, z in calls[layer.module]:
            x = widened(augmented_input(layer, a))
            positions += x.shape[2]
            # Layers reading one input (LoRA's A matrices of query and value) share its product.
            key = (layer.kind, layer.bias, a.data_ptr(), a.shape, a.stride(), a.dtype)
            if layer.kind != "linear" or key not in grams:
                grams[key] = gram(x).to(local.dtype)
            local += grams[key]
            zs.append(z)
            owner.append(i)
            inputs.append(x if grad_sums is not None else None)
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
        for i, x_in, g in zip(owner, inputs, grads):
            if g is None:
                continue
            if squared > 0:
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
    return out.detach()
