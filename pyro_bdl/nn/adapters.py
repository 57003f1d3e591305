"""PEFT's methods that read a lifted network's adapter weights directly, refused until
:func:`~pyro_bdl.nn.unlift` makes the weights ordinary parameters again.

A lifted LoRA matrix is a sample site: its value lives in the guide, and reading the layer's
attribute outside a model run draws from the prior. So ``save_pretrained`` would write an adapter
file without the LoRA matrices (the lifted network's ``state_dict`` has none), and
``merge_and_unload``/``merge_adapter`` would merge one prior draw into the base weights, both
silently. :func:`~pyro_bdl.bayesianize` therefore replaces these methods on the PEFT objects it
lifts with a refusal naming the way out, and :func:`~pyro_bdl.nn.unlift` restores them.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

__all__ = ["GUARDED", "guard", "unguard"]

#: The methods refused on a lifted PEFT model (``push_to_hub`` calls ``save_pretrained``).
GUARDED = ("save_pretrained", "merge_and_unload", "merge_adapter")


def _peft_classes() -> tuple[type, ...]:
    # Only a network built by PEFT can hold its classes, and then PEFT is imported already.
    peft = sys.modules.get("peft")
    if peft is None:
        return ()
    from peft.tuners.tuners_utils import BaseTuner

    return (peft.PeftModel, BaseTuner)


def _refuse(method: str, *args: Any, **kwargs: Any) -> Any:
    effect = (
        "write an adapter file without them (the lifted network's state_dict holds none)"
        if method == "save_pretrained"
        else "merge one draw from the prior into the base weights"
    )
    raise RuntimeError(
        f"{method} on a network lifted by bayesianize: its adapter weights are random sites "
        f"whose values live in the guide, so {method} would {effect}. First make them ordinary "
        f"parameters holding the values to keep, then call it: bdl.nn.unlift(net, "
        f"guide.median()); net.{method}(...)."
    )


def guard(module: nn.Module) -> None:
    """Refuse :data:`GUARDED` on every PEFT model and tuner in ``module``."""
    classes = _peft_classes()
    for sub in module.modules():
        if classes and isinstance(sub, classes):
            for method in GUARDED:
                if hasattr(type(sub), method):
                    object.__setattr__(sub, method, functools.partial(_refuse, method))


def unguard(module: nn.Module) -> None:
    """Undo :func:`guard`: PEFT's own methods again."""
    for sub in module.modules():
        for method in GUARDED:
            entry = sub.__dict__.get(method)
            if isinstance(entry, functools.partial) and entry.func is _refuse:
                del sub.__dict__[method]
