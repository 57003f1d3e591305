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
    g = [state.momentum, *state.hidden_momentum]
    if len(g_hat) != len(params) or h_hat.shape != state.curvature.shape:
        raise ValueError(
            f"ivon_update needs ĝ for the mean and each of the {len(state.hidden)} hidden "
            f"parameters ({len(params)}) and ĥ of shape {tuple(state.curvature.shape)}; got "
            f"{len(g_hat)} and {tuple(h_hat.shape)}."
        )
    beta1, beta2 = hyper.betas
    delta = hyper.weight_decay
    t = state.step + 1
    torch._foreach_mul_(g, beta1)
    torch._foreach_add_(g, list(g_hat), alpha=1.0 - beta1)

    h = state.curvature
    a = torch.add(h, delta)  # h + δ before the update (> 0)
    diff = torch.sub(h, h_hat)
    # ½(1−β₂)²(h − ĥ)²/(h + δ), from the old h.
    correction = diff.mul_(diff).div_(a).mul_(0.5 * (1.0 - beta2) ** 2)
    h.mul_(beta2).add_(h_hat, alpha=1.0 - beta2).add_(correction)

    # m ← m − α (g/(1−β₁ᵗ) + δ(m − μ₀))/(h + δ), with the new h.
    offset = state.mean if hyper.prior_mean is None else state.mean - hyper.prior_mean
    numerator = torch.mul(offset, delta).add_(state.momentum, alpha=1.0 / (1.0 - beta1**t))
    torch.add(h, delta, out=a)
    state.mean.addcdiv_(numerator, a, value=-hyper.lr)
    if state.hidden:
        denominator = torch._foreach_add(state.hidden_curvature, hyper.hidden_weight_decay)
        step_size = -hyper.lr / (1.0 - beta1**t)
        torch._foreach_addcdiv_(state.hidden, state.hidden_momentum, denominator, value=step_size)
    return dataclasses.replace(state, step=t)


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
