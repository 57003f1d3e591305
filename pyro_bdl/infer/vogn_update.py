r"""VOGN's state and its update as a pure function (docs/design/vogn.md), and the thin
``torch.optim.Optimizer`` through which PyTorch learning-rate schedulers drive
:class:`~pyro_bdl.infer.VOGN`.

The update, with :math:`\tilde\delta = \tau\delta/\tilde N` (elementwise when the prior
precision :math:`\delta` differs between weights) and prior mean :math:`\mu_0`:

.. math::

    m \leftarrow \beta_1 m + \hat g + \tilde\delta(\mu - \mu_0), \qquad
    s \leftarrow (1-\beta_2) s + \beta_2 \hat h, \qquad
    \mu \leftarrow \mu - \alpha\, m / (s + \tilde\delta + \gamma).

Hidden parameters (point estimates) take the same step without the prior term.

References:

- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019 (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["VOGNHyperparameters", "VOGNOptimizer", "VOGNState", "vogn_scale", "vogn_update"]


@dataclass
class VOGNState:
    r"""Everything VOGN updates, in one object.

    :ivar mean: μ, the flat posterior mean of every weight site, ``(D,)``.
    :ivar momentum: m, like ``mean``.
    :ivar curvature: s, the running average of ĥ, like ``mean``.
    :ivar hidden: the hidden point-estimate parameters (the network's own tensors).
    :ivar hidden_momentum: m of each hidden parameter.
    :ivar hidden_curvature: s of each hidden parameter.
    :ivar int step: the number of updates done.
    """

    mean: torch.Tensor
    momentum: torch.Tensor
    curvature: torch.Tensor
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    hidden_momentum: list[torch.Tensor] = dataclasses.field(default_factory=list)
    hidden_curvature: list[torch.Tensor] = dataclasses.field(default_factory=list)
    step: int = 0


@dataclass(frozen=True)
class VOGNHyperparameters:
    r"""The numbers one update reads.

    :ivar float lr: α.
    :ivar tuple betas: (β₁, β₂); β₂ weights the new ĥ.
    :ivar prior_precision_tilde: δ̃ = τδ/Ñ, a number or a ``(D,)`` tensor.
    :ivar prior_mean: μ₀, a ``(D,)`` tensor, or ``None`` for zero.
    :ivar float hidden_precision_tilde: the δ̃ that damps the hidden parameters' step.
    :ivar float damping: γ, added to the denominator of the step only.
    """

    lr: float
    betas: tuple[float, float]
    prior_precision_tilde: float | torch.Tensor
    prior_mean: torch.Tensor | None = None
    hidden_precision_tilde: float = 0.0
    damping: float = 0.0


@torch.no_grad()
def vogn_update(
    state: VOGNState,
    g_hat: Sequence[torch.Tensor],
    h_hat: Sequence[torch.Tensor],
    hyper: VOGNHyperparameters,
) -> VOGNState:
    r"""One VOGN update: returns the state after the step.

    ``g_hat`` and ``h_hat`` hold ĝ and ĥ of μ first, then of each hidden parameter. For speed the
    state's tensors are updated **in place** (``torch._foreach_*`` calls over all of them) and the
    returned state holds the same tensors with ``step + 1``; the function reads nothing but its
    arguments and writes nothing but the state's tensors.
    """
    params = [state.mean, *state.hidden]
    m = [state.momentum, *state.hidden_momentum]
    s = [state.curvature, *state.hidden_curvature]
    if not len(g_hat) == len(h_hat) == len(params):
        raise ValueError(
            f"vogn_update needs ĝ and ĥ for μ and each of the {len(state.hidden)} hidden "
            f"parameters ({len(params)} each); got {len(g_hat)} and {len(h_hat)}."
        )
    beta1, beta2 = hyper.betas
    d_tilde = hyper.prior_precision_tilde
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, list(g_hat))
    # The prior's gradient δ̃(μ − μ₀), on μ only.
    offset = state.mean if hyper.prior_mean is None else state.mean - hyper.prior_mean
    if isinstance(d_tilde, torch.Tensor):
        state.momentum.addcmul_(d_tilde, offset)
    else:
        torch._foreach_add_([state.momentum], [offset], alpha=d_tilde)
    torch._foreach_mul_(s, 1.0 - beta2)
    torch._foreach_add_(s, list(h_hat), alpha=beta2)
    if isinstance(d_tilde, torch.Tensor) or d_tilde != hyper.hidden_precision_tilde:
        denominator = [torch.add(state.curvature, d_tilde).add_(hyper.damping)]
        if state.hidden_curvature:
            denominator += torch._foreach_add(
                state.hidden_curvature, hyper.hidden_precision_tilde + hyper.damping
            )
    else:
        denominator = list(torch._foreach_add(s, d_tilde + hyper.damping))
    torch._foreach_addcdiv_(params, m, denominator, value=-hyper.lr)
    return dataclasses.replace(state, step=state.step + 1)


@torch.no_grad()
def vogn_scale(
    s: torch.Tensor,
    *,
    temperature: float,
    effective_size: float,
    prior_precision_tilde: float | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\sigma = \sqrt{\tau / (\tilde N (s + \tilde\delta))}`; the posterior precision is
    :math:`\tilde N s/\tau + \delta`. ``out`` receives the result if given."""
    out = torch.add(s, prior_precision_tilde, out=out)
    return out.mul_(effective_size / temperature).sqrt_().reciprocal_()


class VOGNOptimizer(torch.optim.Optimizer):
    """The learning rate α and the betas of :class:`~pyro_bdl.infer.VOGN`, for PyTorch's
    learning-rate schedulers.

    Pass it to any ``torch.optim.lr_scheduler`` class; VOGN reads ``param_groups[0]["lr"]`` and
    ``["betas"]`` before every update. It holds no state of VOGN's (:class:`VOGNState` does) and
    one placeholder tensor as its parameter; :meth:`step` updates nothing and is called by VOGN
    after each update, so that the schedulers see the optimizer step before theirs.
    """

    def __init__(self, lr: float, betas: tuple[float, float]):
        super().__init__([torch.zeros(0)], {"lr": float(lr), "betas": tuple(betas)})

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    @property
    def betas(self) -> tuple[float, float]:
        b1, b2 = self.param_groups[0]["betas"]
        return float(b1), float(b2)

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return closure() if closure is not None else None
