"""The checks :meth:`~pyro_bdl.infer.VOGN.step` makes on what can change between steps (the
learning rate and betas a scheduler writes, a scheduled temperature) and on the loss, each before
the step changes anything (docs/design/vogn.md)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from pyro_bdl._validation import check_positive, check_positive_int, check_probability

__all__ = ["check_arguments", "check_hyperparameters", "check_loss", "read_temperature"]


def _as_float(value: object) -> float | None:
    """``value`` as a float if it is a real number (or a one-element tensor), else ``None``."""
    if type(value) is float:  # the common case, before the slower checks below
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def check_arguments(
    model: object,
    *,
    dataset_size: int,
    lr: float,
    betas: tuple[float, float],
    prior_precision: float | None,
    temperature: float | Callable[[int], float],
    num_particles: int,
    augmentation_factor: float,
    damping: float,
    chunk_size: int | None,
    reduce_fn: object,
) -> None:
    """The checks of :class:`~pyro_bdl.infer.VOGN`'s constructor arguments."""
    if not callable(model):
        raise TypeError(f"model must be a callable Pyro model; got {type(model).__name__}.")
    check_positive_int("dataset_size", dataset_size)
    check_positive("lr", lr, fix="Pass a learning rate > 0, for example lr=1e-3.")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}.")
    check_probability("betas[0] (beta1)", betas[0], open_interval=False)
    check_probability("betas[1] (beta2)", betas[1], open_interval=False)
    if prior_precision is not None:
        check_positive(
            "prior_precision",
            prior_precision,
            fix="Pass δ > 0, e.g. 1.0, or leave it out to use the prior of bayesianize.",
        )
    if not callable(temperature):
        check_positive("temperature", temperature, fix="Pass τ > 0 (τ = 1 is standard Bayes).")
    check_positive_int("num_particles", num_particles)
    check_positive("augmentation_factor", augmentation_factor, fix="Pass ρ > 0, e.g. 1.0.")
    if isinstance(damping, bool) or not math.isfinite(float(damping)) or damping < 0:
        raise ValueError(f"damping must be a finite number >= 0; got {damping!r}.")
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    if reduce_fn is not None and not callable(reduce_fn):
        raise TypeError(f"reduce_fn must be callable or None; got {type(reduce_fn).__name__}.")


def check_hyperparameters(
    optimizer: torch.optim.Optimizer, step: int, method: str = "VOGN"
) -> None:
    """Refuse a learning rate or betas in ``optimizer.param_groups[0]`` that the update cannot
    use (set there by a scheduler or by hand): lr must be finite and >= 0 (a schedule may end at
    0), each beta in [0, 1)."""
    group = optimizer.param_groups[0]
    where = f"{method} step {step}: {method.lower()}.optimizer.param_groups[0]"
    lr = _as_float(group.get("lr"))
    if lr is None or not math.isfinite(lr) or lr < 0:
        raise ValueError(
            f"{where}['lr'] must be a finite number >= 0; got {group.get('lr')!r}. A "
            "learning-rate scheduler or an assignment set it; nothing was updated. Set a finite "
            f"lr, for example {method.lower()}.optimizer.param_groups[0]['lr'] = 1e-3."
        )
    betas = group.get("betas")
    pair = [_as_float(b) for b in betas] if isinstance(betas, (tuple, list)) else []
    if len(pair) != 2 or any(b is None or not 0.0 <= b < 1.0 for b in pair):
        raise ValueError(
            f"{where}['betas'] must be a pair (beta1, beta2), each in [0, 1); got {betas!r}. "
            "Nothing was updated; set for example (0.9, 0.999)."
        )


def read_temperature(value: object, step: int) -> float:
    """The temperature a schedule returned for ``step``, refused unless finite and > 0."""
    tau = _as_float(value)
    if tau is None or not math.isfinite(tau) or tau <= 0:
        raise ValueError(
            f"VOGN step {step}: the temperature schedule returned {value!r}; it must return a "
            "finite number > 0 (τ = 1 is standard Bayes). Nothing was updated."
        )
    return tau


def check_loss(step: int, likelihood: float, kl: float, method: str = "VOGN") -> None:
    """Refuse a non-finite loss, naming its term (each site's likelihood is checked earlier, so a
    non-finite total here is an overflow of the sum, or the KL)."""
    for term, value in (("likelihood (the sum over the data sites)", likelihood), ("KL", kl)):
        if not math.isfinite(value):
            raise ValueError(
                f"{method} step {step}: the {term} term of the loss is not finite ({value}); "
                "nothing was updated. Lower the learning rate, check the data, or check the prior."
            )
