r"""One block of a location-scale guide as one autograd node: the scales, the draw and every
site's (loc, scale, value) from the block's ``(2, n)`` parameter, with a backward that writes the
block's gradient once.

Built from torch's own operations, a block's step costs several block-long copies that the
hand-written mean-field step (one leaf per weight tensor) does not pay: the backward of the
per-site ``split`` of the locations, of the scales and of the draw each concatenate the sites'
gradients, and the backward of the ``unbind`` of the parameter into (loc, ρ) stacks them again.
:class:`BlockSites` receives the sites' gradients and writes each straight into its slice of the
block's gradient (∂w/∂μ = 1, ∂w/∂σ = ξ, ∂σ/∂ρ = sigmoid(ρ)): one block-long write per row.

The scale is ``softplus(ρ)``, evaluated by :func:`softplus_value` in L2-sized chunks as
``max(ρ, 0) + log1p(exp(−|ρ|))`` with ``log1p(u) = log(1 + u)·u / ((1 + u) − 1)`` (Goldberg's
form, exact to a few ulps; u where 1 + u rounds to 1): the CPU has a vectorised ``log`` but not
a vectorised ``log1p``, which makes torch's ``softplus`` the most expensive element-wise pass of
the step on a CPU. Other devices keep torch's ``softplus``. Gradients are torch's
(``softplus_backward``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

__all__ = ["BlockSites", "softplus", "softplus_value"]

#: Numbers per chunk of :func:`softplus_value`: its five temporaries (128 KB each in fp32) stay
#: in the L2 cache and in glibc's heap, where block-long ones would be mapped afresh per call.
_CHUNK = 1 << 15


@torch.no_grad()
def softplus_value(rho: torch.Tensor) -> torch.Tensor:
    """``softplus(rho)`` without a graph, fast on a CPU (module docstring); within a few ulps
    of :func:`torch.nn.functional.softplus`, which it is on other devices (a GPU has a fast
    ``log1p``, and the chunks would cost a kernel launch each)."""
    if rho.device.type != "cpu":
        return F.softplus(rho)
    out = torch.empty_like(rho, memory_format=torch.contiguous_format)
    for part, dest in zip(rho.reshape(-1).split(_CHUNK), out.view(-1).split(_CHUNK)):
        u = part.abs().neg_().exp_()  # exp(−|ρ|) ∈ (0, 1]: no overflow
        w = u + 1
        d = w - 1
        ratio = w.log_().mul_(u).div_(d)
        torch.where(d == 0, u, ratio, out=dest)
        dest.add_(part.clamp_min(0))
    return out


class _Softplus(torch.autograd.Function):
    @staticmethod
    def forward(rho):
        return softplus_value(rho)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (rho,) = ctx.saved_tensors
        return torch.ops.aten.softplus_backward(grad, rho, 1.0, 20.0)


def softplus(rho: torch.Tensor) -> torch.Tensor:
    """``softplus(rho)``, differentiable, with the value of :func:`softplus_value`.

    Under ``torch.jit.trace`` (Pyro's ``JitTrace_ELBO``, a traced guide) a custom autograd
    function would be recorded as a Python call that cannot be saved, so the same value is
    made of traceable operations there: ``v + (s − s.detach())`` is ``v`` to the bit with
    torch's softplus gradient.
    """
    if torch.jit.is_tracing():
        value = softplus_value(rho.detach())
        smooth = F.softplus(rho)
        return value + (smooth - smooth.detach())
    return _Softplus.apply(rho)


def _write_sum(out: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """``out[:] = a + b``, a missing gradient counting as zero."""
    if a is not None and b is not None:
        torch.add(a, b, out=out)
    elif a is not None:
        out.copy_(a)
    elif b is not None:
        out.copy_(b)
    else:
        out.zero_()


class BlockSites(torch.autograd.Function):
    """``apply(param, noise, sizes)``: from a block's ``(2, n)`` parameter (rows μ and ρ) the
    sites' flat locations, scales σ = softplus(ρ) and, where ``noise`` (n numbers drawn without
    a graph) is given, values w = μ + σ·noise: a tuple of ``len(sizes)`` locations, then as many
    scales, then (with noise) as many values.

    Usage (what :meth:`~pyro_bdl.guides.AutoLocScaleGuide.forward` does per block)::

        out = BlockSites.apply(param, noise, sizes)
        locs, scales, values = out[:k], out[k : 2 * k], out[2 * k :]

    The locations are views of ``param`` (not to be written in place). Once differentiable;
    not for ``torch.jit.trace`` (see :func:`softplus`).
    """

    @staticmethod
    def forward(ctx, param, noise, sizes):
        loc = param[0]
        scale = softplus_value(param[1])
        outputs = [*loc.split(sizes), *scale.split(sizes)]
        if noise is not None:
            outputs += torch.addcmul(loc, scale, noise).split(sizes)
        ctx.save_for_backward(param, noise)
        ctx.sizes = sizes
        ctx.set_materialize_grads(False)  # sites without a gradient hand back None, not zeros
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        param, noise = ctx.saved_tensors
        sizes = ctx.sizes
        count = len(sizes)
        grad = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        grad_loc, grad_rho = grad[0], grad[1]
        loc_grads, scale_grads = grads[:count], grads[count : 2 * count]
        value_grads = grads[2 * count :] if noise is not None else (None,) * count
        start = 0
        for size, g_loc, g_scale, g_value in zip(sizes, loc_grads, scale_grads, value_grads):
            stop = start + size
            _write_sum(grad_loc[start:stop], g_loc, g_value)
            dest = grad_rho[start:stop]
            if g_value is None:
                _write_sum(dest, g_scale, None)
            elif g_scale is None:
                torch.mul(g_value, noise[start:stop], out=dest)
            else:
                torch.addcmul(g_scale, g_value, noise[start:stop], out=dest)
            start = stop
        grad_rho.mul_(param[1].sigmoid())  # ∂σ/∂ρ
        return grad, None, None
