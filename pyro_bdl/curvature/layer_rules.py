r"""Per-layer rules for per-example gradients: plain functions of a layer's saved input and the
gradient at its output (DESIGN.md 4.5), used by :class:`~pyro_bdl.curvature.PerExampleGradients`.

Each returns per-example gradients of one chunk of examples, ``(c, *parameter shape)``.

References:

- Goodfellow, "Efficient Per-Example Gradient Computations", arXiv 1510.01799, 2015.
- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019, Appendix B.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["batchnorm_per_example", "conv_per_example", "linear_per_example"]


def linear_per_example(a: torch.Tensor, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example weight and bias gradients of a ``Linear`` layer, ``(c, out, in)`` and
    ``(c, out)``, from inputs ``(c, ..., in)`` and output gradients ``(c, ..., out)``."""
    c = a.shape[0]
    a3 = a.reshape(c, -1, a.shape[-1])
    d3 = delta.reshape(c, -1, delta.shape[-1])
    return {"weight": torch.bmm(d3.transpose(1, 2), a3), "bias": d3.sum(1)}  # both fresh


def _unfold(conv: nn.modules.conv._ConvNd, a: torch.Tensor) -> torch.Tensor:
    """The conv's input patches, ``(c, C_in·K, L)`` (what the conv multiplies its weight by)."""
    nd = a.dim() - 2
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        a = F.pad(a, conv._reversed_padding_repeated_twice, mode=mode)
        padding: tuple[int, ...] = (0,) * nd
    else:
        padding = tuple(conv.padding)  # type: ignore[arg-type]
    kernel, stride, dilation = conv.kernel_size, conv.stride, conv.dilation
    if nd == 2:
        return F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
    if nd == 1:
        return F.unfold(
            a.unsqueeze(2),
            (1, kernel[0]),
            dilation=(1, dilation[0]),
            padding=(0, padding[0]),
            stride=(1, stride[0]),
        )
    # Conv3d: no im2col in torch; take strided windows of span d·(k−1)+1, then every d-th element.
    a = F.pad(a, [p for p in reversed(padding) for _ in range(2)])
    for i in range(nd):
        a = a.unfold(2 + i, dilation[i] * (kernel[i] - 1) + 1, stride[i])
    index: tuple[Any, ...] = (Ellipsis, *(slice(None, None, d) for d in dilation))
    a = a[index]
    c, cin = a.shape[:2]
    positions = a.shape[2 : 2 + nd]
    a = a.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    return a.reshape(c, cin * math.prod(kernel), math.prod(positions))


def conv_per_example(
    conv: nn.modules.conv._ConvNd, a: torch.Tensor, delta: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example weight ``(c, *weight.shape)`` and bias ``(c, C_out)`` gradients of a conv."""
    c, groups = a.shape[0], conv.groups
    cols = _unfold(conv, a)  # (c, C_in·K, L)
    d = delta.reshape(c, groups, conv.out_channels // groups, -1)  # (c, G, C_out/G, L)
    cols = cols.reshape(c, groups, cols.shape[1] // groups, cols.shape[2])
    w = torch.matmul(d, cols.transpose(-1, -2))  # (c, G, C_out/G, C_in/G·K)
    weight_shape = (conv.out_channels, conv.in_channels // groups, *conv.kernel_size)
    return {"weight": w.reshape(c, *weight_shape), "bias": d.sum(-1).reshape(c, -1)}


def batchnorm_per_example(
    bn: nn.modules.batchnorm._BatchNorm, a: torch.Tensor, delta: torch.Tensor, batch: torch.Tensor
) -> dict[str, torch.Tensor]:
    r"""Per-example gradients ``(c, C)`` of a BatchNorm's affine weight and bias.

    ``a`` and ``delta`` are a chunk of the saved input and output gradient; ``batch`` is the whole
    saved input, from which the batch statistics are recomputed in training mode. With
    :math:`\hat x = (a - m) r` the weight's gradient is
    :math:`\sum_p \delta_p \hat x_p = r(\sum_p \delta_p a_p - m \sum_p \delta_p)`, which needs
    only per-(example, channel) sums over contiguous positions, never :math:`\hat x` itself.
    """
    c, channels = a.shape[:2]
    a3, d3 = a.reshape(c, channels, -1), delta.reshape(c, channels, -1)
    if bn.training or bn.running_mean is None:
        whole = batch.reshape(batch.shape[0], channels, -1)
        count = whole.shape[0] * whole.shape[2]
        mean = whole.sum((0, 2)) / count
        var = (whole.square().sum((0, 2)) / count - mean.square()).clamp_min(0)
    else:
        assert bn.running_var is not None
        mean, var = bn.running_mean, bn.running_var
    rstd = torch.rsqrt(var + bn.eps)
    bias = d3.sum(-1)
    weight = (torch.linalg.vecdot(d3, a3) - mean * bias) * rstd
    return {"weight": weight, "bias": bias}
