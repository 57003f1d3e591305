r"""The VOGN update as plain functions of tensors, and as a ``torch.optim.Optimizer`` so that
PyTorch learning-rate schedulers drive it (DESIGN.md 4.5; used by :class:`~pyro_bdl.infer.VOGN`).

References:

- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019 (Algorithm 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["VOGNOptimizer", "vogn_scale", "vogn_update"]


@torch.no_grad()
def vogn_update(
    mu: torch.Tensor,
    m: torch.Tensor,
    s: torch.Tensor,
    g_hat: torch.Tensor,
    h_hat: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    prior_precision_tilde: float,
    damping: float = 0.0,
    bayesian: bool = True,
) -> None:
    r"""One VOGN update of ``mu``, ``m``, ``s`` in place (DESIGN.md 4.5).

    With ``bayesian=False`` (hidden parameters such as BatchNorm's) the prior term
    :math:`\tilde\delta\mu` is left out of the momentum; :math:`\tilde\delta` still damps the step.
    """
    _update_all(
        [mu],
        [m],
        [s],
        [g_hat],
        [h_hat],
        lr=lr,
        betas=betas,
        prior_precision_tilde=prior_precision_tilde,
        damping=damping,
        bayesian=bayesian,
    )


def _update_all(
    mu: list[torch.Tensor],
    m: list[torch.Tensor],
    s: list[torch.Tensor],
    g_hat: list[torch.Tensor],
    h_hat: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    prior_precision_tilde: float,
    damping: float,
    bayesian: bool,
) -> None:
    """:func:`vogn_update` on lists of tensors, one ``torch._foreach_*`` call per operation."""
    beta1, beta2 = betas
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g_hat)
    if bayesian:
        torch._foreach_add_(m, mu, alpha=prior_precision_tilde)
    torch._foreach_mul_(s, 1.0 - beta2)
    torch._foreach_add_(s, h_hat, alpha=beta2)
    denominator = torch._foreach_add(s, prior_precision_tilde + damping)
    torch._foreach_addcdiv_(mu, m, denominator, value=-lr)


@torch.no_grad()
def vogn_scale(
    s: torch.Tensor,
    *,
    temperature: float,
    effective_size: float,
    prior_precision_tilde: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\sigma = \sqrt{\tau / (\tilde N (s + \tilde\delta))}`; the posterior precision is
    :math:`\tilde N s/\tau + \delta`. ``out`` receives the result if given."""
    out = torch.add(s, prior_precision_tilde, out=out)
    return out.mul_(effective_size / temperature).sqrt_().reciprocal_()


class VOGNOptimizer(torch.optim.Optimizer):
    """The VOGN update as a :class:`torch.optim.Optimizer`, so PyTorch LR schedulers drive it.

    Group 0 holds the flat posterior mean μ of every weight site; group 1 (if any) the hidden
    parameters. Every hyperparameter lives in ``param_groups`` (``lr``, ``betas``,
    ``prior_precision``, ``temperature``, ``effective_size``, ``damping``), so a scheduler may
    change any of them. :class:`VOGN` stores ĝ and ĥ in ``state[p]`` and then calls :meth:`step`.
    """

    def __init__(self, defaults: dict):
        # Both groups exist from the start (with placeholders until VOGN has seen the model), so
        # a scheduler created right after VOGN covers both.
        groups: list[dict[str, Any]] = [
            {"params": [torch.zeros(0)], "bayesian": True},
            {"params": [torch.zeros(0)], "bayesian": False},
        ]
        super().__init__(groups, defaults)

    def _install(self, mu: torch.Tensor, hidden: Sequence[torch.Tensor]) -> None:
        self.param_groups[0]["params"] = [mu]
        self.param_groups[1]["params"] = list(hidden)
        self.state.clear()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            delta_tilde = group["temperature"] * group["prior_precision"] / group["effective_size"]
            states = [self.state[p] for p in params]
            _update_all(
                params,
                [st["m"] for st in states],
                [st["s"] for st in states],
                [st.pop("g_hat") for st in states],
                [st.pop("h_hat") for st in states],
                lr=group["lr"],
                betas=group["betas"],
                prior_precision_tilde=delta_tilde,
                damping=group["damping"],
                bayesian=group["bayesian"],
            )
        return loss
