r"""Per-layer rules for per-example gradients: plain functions of a layer's saved input and the
gradient at its output (docs/design/vogn.md), used by
:class:`~pyro_bdl.curvature.PerExampleGradients`.

Each returns per-example gradients of one chunk of examples, ``(c, *parameter shape)``.
Below the rules: the chunking, summing and saved-statistics helpers the tape uses.

References:

- Goodfellow, "Efficient Per-Example Gradient Computations", arXiv 1510.01799, 2015.
- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019, Appendix B.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["batchnorm_per_example", "conv_per_example"]


def conv_per_example(
    conv: nn.modules.conv._ConvNd, a: torch.Tensor, delta: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example weight ``(c, *weight.shape)`` and bias ``(c, C_out)`` gradients of a conv.

    Example i's weight gradient is the weight gradient of the same conv on example i alone, so
    folding the batch into the channels, ``(1, c·C_in, ...)`` and ``(1, c·C_out, ...)``, and the
    groups, ``c·groups``, gives all of them in one grouped weight-gradient convolution: the
    backend's own kernel, with no unfolded (im2col) copy of the input.
    """
    c, groups, nd = a.shape[0], conv.groups, a.dim() - 2
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        a = F.pad(a, conv._reversed_padding_repeated_twice, mode=mode)
        padding = [0] * nd
    else:
        padding = list(conv.padding)  # type: ignore[arg-type]
    c_out, c_in = conv.out_channels, conv.in_channels // groups
    shape = (c * c_out, c_in, *conv.kernel_size)
    # Only the weight's shape is read when the weight gradient alone is asked for: on CPU a
    # stride-0 view spares the allocation; other backends (cuDNN checks layouts) get real zeros.
    if a.device.type == "cpu":
        weight = a.new_zeros((1,) * len(shape)).expand(shape)
    else:
        weight = a.new_zeros(shape)
    _, w, _ = torch.ops.aten.convolution_backward(
        delta.reshape(1, c * c_out, *delta.shape[2:]),
        a.reshape(1, c * a.shape[1], *a.shape[2:]),
        weight,
        None,
        list(conv.stride),
        padding,
        list(conv.dilation),
        False,
        [0] * nd,
        c * groups,
        [False, True, False],
    )
    bias = delta.reshape(c, c_out, -1).sum(-1)
    return {"weight": w.reshape(c, c_out, c_in, *conv.kernel_size), "bias": bias}


def batchnorm_per_example(
    bn: nn.modules.batchnorm._BatchNorm,
    a: torch.Tensor,
    delta: torch.Tensor,
    batch: torch.Tensor,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    r"""Per-example gradients ``(c, C)`` of a BatchNorm's affine weight and bias.

    ``a`` and ``delta`` are a chunk of the saved input and output gradient; ``batch`` is the whole
    saved input, from which the batch statistics are recomputed in training mode unless
    ``stats`` gives them, ``(mean, 1/sqrt(var + eps))`` as the forward pass saved them. With
    :math:`\hat x = (a - m) r` the weight's gradient is
    :math:`\sum_p \delta_p \hat x_p = r(\sum_p \delta_p a_p - m \sum_p \delta_p)`, which needs
    only per-(example, channel) sums over contiguous positions, never :math:`\hat x` itself.
    """
    c, channels = a.shape[:2]
    a3, d3 = a.reshape(c, channels, -1), delta.reshape(c, channels, -1)
    if stats is not None:
        mean, rstd = stats
    elif bn.training or bn.running_mean is None:
        whole = batch.reshape(batch.shape[0], channels, -1)
        count = whole.shape[0] * whole.shape[2]
        mean = whole.sum((0, 2)) / count
        var = (whole.square().sum((0, 2)) / count - mean.square()).clamp_min(0)
        rstd = torch.rsqrt(var + bn.eps)
    else:
        assert bn.running_var is not None
        mean, rstd = bn.running_mean, torch.rsqrt(bn.running_var + bn.eps)
    bias = d3.sum(-1)
    weight = (torch.linalg.vecdot(d3, a3) - mean * bias) * rstd
    return {"weight": weight, "bias": bias}


# -- helpers of PerExampleGradients: chunks, sums and squares, saved statistics ---------------


def batchnorm_saved_stats(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch mean and 1/sqrt(var + eps) that a training-mode BatchNorm saved for its
    backward pass (native kernel only), so the per-example rule need not recompute them."""
    fn = output.grad_fn
    if fn is None or type(fn).__name__ != "NativeBatchNormBackward0":
        return None
    mean, rstd = getattr(fn, "_saved_result1", None), getattr(fn, "_saved_result2", None)
    if not isinstance(mean, torch.Tensor) or not isinstance(rstd, torch.Tensor):
        return None
    if mean.dim() != 1 or mean.numel() != output.shape[1] or rstd.shape != mean.shape:
        return None  # evaluation mode saves empty tensors
    return mean, rstd


def batch_slices(batch_size: int, per_example: int, max_elements: int, chunk_size: int | None):
    size = chunk_size or max(1, min(batch_size, max_elements // max(per_example, 1)))
    for lo in range(0, batch_size, size):
        yield lo, min(lo + size, batch_size)


def accumulate_sums(
    out: dict[str, list[torch.Tensor]],
    pname: str,
    pe: torch.Tensor,
    dest: tuple[torch.Tensor, torch.Tensor] | None = None,
    add: bool = False,
) -> None:
    """Add one chunk's per-example gradients (c, *shape) to the running sums and squares (the
    first chunk writes into ``dest`` if given, or adds to it if ``add``)."""
    if pname in out or (dest is not None and add):
        g, s = out[pname] if pname in out else dest  # type: ignore[misc]
        g.add_(pe.sum(0))
        s.add_(pe.square_().sum(0))  # pe is a fresh per-chunk tensor: square it in place
        out[pname] = [g, s]
    elif dest is not None:
        torch.sum(pe, 0, out=dest[0])
        torch.sum(pe.square_(), 0, out=dest[1])
        out[pname] = list(dest)
    else:
        out[pname] = [pe.sum(0), pe.square_().sum(0)]
