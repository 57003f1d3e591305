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
    beta1, beta2 = betas
    m.mul_(beta1).add_(g_hat)
    if bayesian:
        m.add_(mu, alpha=prior_precision_tilde)
    s.mul_(1.0 - beta2).add_(h_hat, alpha=beta2)
    mu.addcdiv_(m, s + (prior_precision_tilde + damping), value=-lr)


def vogn_scale(
    s: torch.Tensor, *, temperature: float, effective_size: float, prior_precision_tilde: float
) -> torch.Tensor:
    r""":math:`\sigma = \sqrt{\tau / (\tilde N (s + \tilde\delta))}`; the posterior precision is
    :math:`\tilde N s/\tau + \delta`."""
    return (temperature / (effective_size * (s + prior_precision_tilde))).sqrt()


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
            delta_tilde = group["temperature"] * group["prior_precision"] / group["effective_size"]
            for p in group["params"]:
                state = self.state[p]
                vogn_update(
                    p,
                    state["m"],
                    state["s"],
                    state.pop("g_hat"),
                    state.pop("h_hat"),
                    lr=group["lr"],
                    betas=group["betas"],
                    prior_precision_tilde=delta_tilde,
                    damping=group["damping"],
                    bayesian=group["bayesian"],
                )
        return loss
