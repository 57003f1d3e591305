"""The optimizer object of a natural-gradient method: its learning rate and betas, where
PyTorch's learning-rate schedulers read and write them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NaturalGradientOptimizer"]


class NaturalGradientOptimizer(torch.optim.Optimizer):
    """The learning rate α and the betas of a natural-gradient method, for PyTorch's
    learning-rate schedulers.

    Pass it to any ``torch.optim.lr_scheduler`` class; the method reads ``param_groups[0]["lr"]``
    and ``["betas"]`` before every update. It holds none of the method's state
    (:class:`~pyro_bdl.infer.natural_gradient.state.NaturalGradientState` does) and one
    placeholder tensor as its parameter; :meth:`step` updates nothing and is called after each
    update, so that the schedulers see the optimizer step before theirs.
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once the one group exists: the method reads ``param_groups[0]`` only, so
        another group's hyperparameters would be ignored (and its state_dict not load back)."""
        if self.param_groups:
            keys = sorted(k for k in param_group if k != "params")
            raise ValueError(
                "a natural-gradient method has one parameter group: its lr and betas are "
                "param_groups[0]['lr'] and ['betas'], which apply to every weight; another group "
                f"would be ignored. Got a group with {keys}; "
                "set param_groups[0]['lr'] (or use a learning-rate scheduler) instead."
            )
        super().add_param_group(param_group)
