"""The checks of a :class:`~pyro_bdl.app.compare.problem.Problem`'s settings, run when it is built
(and again by ``dataclasses.replace``), so that a bad setting fails with its name before any
method trains instead of as a NaN deep inside the first one."""

from __future__ import annotations

from numbers import Integral
from typing import Any, Protocol

import torch

from pyro_bdl._validation import check_choice, check_positive
from pyro_bdl.app.compare.networks import NETWORKS

__all__ = ["SIGMA_RULES", "ProblemSettings", "check_problem"]

#: ``Problem.sigma``: every method takes σ as known, each learns it its own way, or the network
#: gives σ(x) (a second output, the log-variance; regression only).
SIGMA_RULES = ("fixed", "own", "heteroscedastic")

#: Seeds numpy accepts (``pyro.set_rng_seed`` seeds numpy too).
MAX_SEED = 2**32 - 1


class ProblemSettings(Protocol):
    """The settings :func:`check_problem` reads: the fields of
    :class:`~pyro_bdl.app.compare.problem.Problem`, named here so that this module need not
    import the one that calls it."""

    dataset: Any
    network: Any
    epochs: int
    batch_size: int
    lr: float
    lr_decay: float | None
    seed: int
    device: str
    num_samples: int
    num_kl_samples: int
    noise: float | None
    sigma: str
    ood_x: torch.Tensor | None


def _whole(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    ok = isinstance(value, Integral) and not isinstance(value, bool)
    if ok:
        number = int(value)  # type: ignore[call-overload]
        ok = number >= minimum and (maximum is None or number <= maximum)
    if not ok:
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"Problem.{name} must be an int {bounds}; got {value!r}.")


def _device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"Problem.device must name a torch device such as 'cpu' or 'cuda:0'; got {device!r}."
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"Problem.device is {device!r}, but CUDA is not available on this machine "
            "(torch.cuda.is_available() is False); use device='cpu'."
        )


def check_problem(problem: ProblemSettings) -> None:
    """Refuse a setting that no method can train with, naming the field, the value and a fix."""
    for name in ("epochs", "batch_size", "num_samples", "num_kl_samples"):
        _whole(name, getattr(problem, name), 1)
    _whole("seed", problem.seed, 0, MAX_SEED)
    check_positive("Problem.lr", problem.lr, fix="Use a learning rate such as 1e-3.")
    if problem.lr_decay is not None:
        check_positive("Problem.lr_decay", problem.lr_decay, fix="Use e.g. 0.1, or None.")
    if problem.noise is not None:
        check_positive("Problem.noise", problem.noise, fix="Pass the observation noise σ > 0.")
    check_choice("Problem.sigma", problem.sigma, SIGMA_RULES)
    if isinstance(problem.network, str):
        if problem.network not in NETWORKS:
            raise ValueError(
                f"Problem.network must be one of {', '.join(map(repr, NETWORKS))} or a builder "
                f"(input_shape, num_outputs) -> nn.Module; got {problem.network!r}."
            )
    elif not callable(problem.network):
        raise TypeError(
            f"Problem.network must be a name or a builder (input_shape, num_outputs) -> "
            f"nn.Module; got {type(problem.network).__name__}."
        )
    _device(problem.device)
    if problem.ood_x is not None:
        x = problem.ood_x
        shape = problem.dataset.input_shape
        if not isinstance(x, torch.Tensor) or tuple(x.shape[1:]) != tuple(shape):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"Problem.ood_x must be a tensor of shape (n, {', '.join(map(str, shape))}) like "
                f"the training inputs; got {got}."
            )
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ValueError("Problem.ood_x contains NaN or inf; clean the OOD inputs first.")
