"""Public calls that differentiate the network internally run with autograd on, whatever the
caller's grad mode.

Evaluation code in PyTorch runs under ``torch.no_grad()`` or ``torch.inference_mode()``, and a
Laplace predictive (a Jacobian per batch), a Laplace fit (the GGN) or a VOGN/IVON step (ĝ by a
backward pass) called there must still differentiate: as ``torch.autograd.functional.jacobian``
and Pyro's ``SVI.step`` do, :func:`differentiates` turns autograd back on for the call. Without
it the Laplace calls would raise autograd's "element 0 of tensors does not require grad", and an
IVON step would read a zero gradient without a word.

A guide's set-up (:func:`sets_up`) runs the other way round: outside inference mode, so that the
parameters it makes can be trained, and without autograd, so that its prototype trace holds no
graph and ``copy.deepcopy`` can copy it.

A tensor made under ``torch.inference_mode()`` (an *inference tensor*) cannot enter a graph at
all; one passed directly (``x``, or a tensor inside a mapping, tuple or list argument) is copied
into a normal tensor first, and one that arrives otherwise (from a DataLoader built under
inference mode) gets an error that says so and what to do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

__all__ = ["differentiates", "sets_up"]

F = TypeVar("F", bound=Callable[..., Any])


def _usable(value: Any) -> Any:
    """``value`` with every inference tensor in it (nested in mappings, tuples and lists)
    replaced by a normal copy; anything else is returned as it is, the same object."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, Mapping) and any(_holds_inference(v) for v in value.values()):
        return type(value)({k: _usable(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (tuple, list)) and any(_holds_inference(v) for v in value):
        parts = [_usable(v) for v in value]
        return type(value)(parts) if not hasattr(value, "_fields") else type(value)(*parts)
    return value


def _holds_inference(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_inference()
    if isinstance(value, Mapping):
        return any(_holds_inference(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_inference(v) for v in value)
    return False


def differentiates(method: F) -> F:
    """Run ``method`` with autograd enabled and inference mode off, its inference-tensor
    arguments copied (see the module's docstring). The caller's grad mode is restored after."""
    name = method.__qualname__

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False), torch.enable_grad():
            args = tuple(_usable(a) for a in args)
            kwargs = {k: _usable(v) for k, v in kwargs.items()}
            try:
                return method(*args, **kwargs)
            except RuntimeError as err:
                if "Inference tensors cannot be saved for backward" not in str(err):
                    raise
                raise RuntimeError(
                    f"{name} differentiates the network, but some of its data are inference "
                    "tensors (made under torch.inference_mode(), for example by a DataLoader "
                    "or preprocessing run there), which autograd cannot use. Make the data "
                    "under torch.no_grad() instead, or pass copies made outside inference "
                    "mode (tensor.clone())."
                ) from err

    return wrapper  # type: ignore[return-value]


def sets_up(method: F) -> F:
    """Run a guide's ``_setup_prototype`` outside inference mode and without autograd, whatever
    the caller's mode.

    Parameters made under ``torch.inference_mode()`` would be inference tensors, which no
    optimizer step can update ("Inference tensors do not track version counter"). Without
    autograd the prototype trace holds no graph: its values (the model's outputs among them) are
    leaves, which ``copy.deepcopy`` copies, where torch refuses to deepcopy a tensor inside a
    graph. The set-up reads only shapes, supports and initial values, never gradients."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
