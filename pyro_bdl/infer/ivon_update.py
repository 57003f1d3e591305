r"""IVON's update as a pure function over VOGN's state (docs/design/ivon.md).

IVON keeps the same three vectors as VOGN in a :class:`~pyro_bdl.infer.VOGNState`: the mean
:math:`m` (``state.mean``), the gradient average :math:`g` (``state.momentum``) and the curvature
:math:`h` (``state.curvature``). With :math:`\lambda` the effective sample size (ess),
:math:`\delta` the weight decay (the prior precision divided by :math:`\lambda`, elementwise when
it differs between weights), :math:`\mu_0` the prior mean and :math:`t` the step number:

.. math::

    g &\leftarrow \beta_1 g + (1-\beta_1)\hat g, \\
    h &\leftarrow \beta_2 h + (1-\beta_2)\hat h
        + \tfrac12 (1-\beta_2)^2 \frac{(h-\hat h)^2}{h+\delta}, \\
    m &\leftarrow m - \alpha\,\frac{g/(1-\beta_1^t) + \delta (m-\mu_0)}{h+\delta}, \qquad
    \sigma = \frac{1}{\sqrt{\lambda (h+\delta)}}.

The correction term keeps :math:`h+\delta` positive whatever :math:`\hat h` is: with
:math:`a = h+\delta` and :math:`x = (h-\hat h)/a` the new :math:`h+\delta` is
:math:`a\,(\tfrac12(1-(1-\beta_2)x)^2 + \tfrac12) \ge a/2`.

Hidden (point-estimate) parameters have no noise, so no :math:`\hat h`: their :math:`h` stays at
its initial value :math:`h_0` and they take the same debiased step without the prior term,
damped by the mean weight decay.

References:

- Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan, Möllenhoff,
  "Variational Learning is Effective for Large Deep Networks", ICML 2024 (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pyro_bdl.infer.vogn_update import VOGNState

__all__ = ["IVONHyperparameters", "ivon_scale", "ivon_update"]


@dataclass(frozen=True)
class IVONHyperparameters:
    r"""The numbers one IVON update reads.

    :ivar float lr: α.
    :ivar tuple betas: (β₁, β₂); β₁ averages ĝ, β₂ averages ĥ (both weight the *old* value).
    :ivar weight_decay: δ = prior precision / ess, a number or a ``(D,)`` tensor.
    :ivar prior_mean: μ₀, a ``(D,)`` tensor, or ``None`` for zero.
    :ivar float hidden_weight_decay: the δ that damps the hidden parameters' step.
    """

    lr: float
    betas: tuple[float, float]
    weight_decay: float | torch.Tensor
    prior_mean: torch.Tensor | None = None
    hidden_weight_decay: float = 0.0


@torch.no_grad()
def ivon_update(
    state: VOGNState,
    g_hat: Sequence[torch.Tensor],
    h_hat: torch.Tensor,
    hyper: IVONHyperparameters,
) -> VOGNState:
    r"""One IVON update: returns the state after the step.

    ``g_hat`` holds ĝ of the mean first, then of each hidden parameter; ``h_hat`` is ĥ of the
    mean. As :func:`~pyro_bdl.infer.vogn_update.vogn_update`, the state's tensors are updated
    **in place** and the returned state holds them with ``step + 1``; nothing else is read or
    written.
    """
    params = [state.mean, *state.hidden]
    if len(g_hat) != len(params) or h_hat.shape != state.curvature.shape:
        raise ValueError(
            f"ivon_update needs ĝ for the mean and each of the {len(state.hidden)} hidden "
            f"parameters ({len(params)}) and ĥ of shape {tuple(state.curvature.shape)}; got "
            f"{len(g_hat)} and {tuple(h_hat.shape)}."
        )
    beta1, beta2 = hyper.betas
    t = state.step + 1
    debias, c = 1.0 / (1.0 - beta1**t), 1.0 - beta2
    delta, mu0 = hyper.weight_decay, hyper.prior_mean
    # Block by block, so that the dozen element-wise operations of a block run in cache and
    # their temporaries are small (a D-sized temporary costs more in page faults than the
    # arithmetic); each block is one slice of every vector.
    for block in blocks(state.mean.numel()):
        m, g, h = state.mean[block], state.momentum[block], state.curvature[block]
        gh, hh = g_hat[0][block], h_hat[block]
        d = delta[block] if isinstance(delta, torch.Tensor) else delta
        g.lerp_(gh, 1.0 - beta1)  # β₁g + (1−β₁)ĝ
        # β₂h + (1−β₂)ĥ + ½(1−β₂)²(h−ĥ)²/(h+δ) = h + r(c + ½c² r/(h+δ)), r = ĥ − h, c = 1 − β₂.
        a = torch.add(h, d)
        r = torch.sub(hh, h)
        factor = torch.div(r, a).mul_(0.5 * c * c).add_(c)
        h.addcmul_(r, factor)
        # m ← m − α (g/(1−β₁ᵗ) + δ(m − μ₀))/(h + δ), with the new h.
        offset = m if mu0 is None else torch.sub(m, mu0[block], out=r)
        numerator = torch.mul(offset, d, out=factor).add_(g, alpha=debias)
        m.addcdiv_(numerator, torch.add(h, d, out=a), value=-hyper.lr)
    if state.hidden:
        torch._foreach_lerp_(state.hidden_momentum, list(g_hat[1:]), 1.0 - beta1)
        denominator = torch._foreach_add(state.hidden_curvature, hyper.hidden_weight_decay)
        step_size = -hyper.lr * debias
        torch._foreach_addcdiv_(state.hidden, state.hidden_momentum, denominator, value=step_size)
    return dataclasses.replace(state, step=t)


#: Elements per block of :func:`ivon_update`: 512 KiB of float32 per vector, so that a block's
#: vectors and temporaries stay in cache while the Python overhead per block stays small.
BLOCK = 1 << 17


def blocks(n: int) -> list[slice]:
    """Slices of ``range(n)`` of :data:`BLOCK` elements (the last one shorter)."""
    return [slice(i, min(i + BLOCK, n)) for i in range(0, n, BLOCK)]


@torch.no_grad()
def ivon_scale(
    h: torch.Tensor,
    *,
    effective_size: float,
    weight_decay: float | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\sigma = 1/\sqrt{\lambda (h + \delta)}`: the posterior precision is
    :math:`\lambda h` plus the prior precision :math:`\lambda\delta`. ``out`` receives it."""
    out = torch.add(h, weight_decay, out=out)
    return out.mul_(effective_size).rsqrt_()
