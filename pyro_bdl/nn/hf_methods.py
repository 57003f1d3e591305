"""The Hugging Face and PEFT methods that a lifted network refuses, each with the way out.

- ``save_pretrained``, ``merge_and_unload`` and ``merge_adapter`` (PEFT) read the adapter
  weights directly. A lifted LoRA matrix is a sample site: its value lives in the guide, and
  reading the layer's attribute outside a model run draws from the prior. So ``save_pretrained``
  would write an adapter file without the LoRA matrices (the lifted network's ``state_dict`` has
  none), and the merges would add one prior draw to the base weights, both silently.
  :func:`~pyro_bdl.nn.unlift` makes the sites ordinary parameters again and restores them.
- ``set_adapter`` (PEFT): the sites are the matrices of the adapters active when the network was
  lifted (:data:`~pyro_bdl.nn.lora`); after a switch the forward would read another adapter's
  fixed weights and none of the sites.
- ``activation_checkpointing_enable`` and ``gradient_checkpointing_enable`` (transformers): the
  checkpointed forward runs again during the backward pass, outside the Pyro trace, where it
  draws fresh weights; :func:`~pyro_bdl.bayesianize` refuses a network with checkpointing on,
  and this refuses turning it on afterwards (PyTorch's own error would not say why).

:func:`~pyro_bdl.bayesianize` replaces these methods on the instances it lifts (the class is
untouched), and :func:`~pyro_bdl.nn.unlift` puts them back.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

__all__ = ["ADAPTER_METHODS", "CHECKPOINTING_METHODS", "guard", "unguard"]

#: PEFT's methods refused on a lifted model (``push_to_hub`` calls ``save_pretrained``).
ADAPTER_METHODS = ("save_pretrained", "merge_and_unload", "merge_adapter", "set_adapter")
#: transformers' methods that turn on gradient checkpointing (the second, its old name).
CHECKPOINTING_METHODS = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


def _guarded(layer: nn.Module) -> tuple[str, ...]:
    # Only a network built by these libraries holds their classes, and then they are imported.
    methods: tuple[str, ...] = ()
    peft = sys.modules.get("peft")
    if peft is not None:
        from peft.tuners.tuners_utils import BaseTuner

        if isinstance(layer, (peft.PeftModel, BaseTuner)):
            methods += ADAPTER_METHODS
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(layer, transformers.PreTrainedModel):
        methods += CHECKPOINTING_METHODS
    return tuple(m for m in methods if hasattr(type(layer), m))


def _refuse(method: str, *args: Any, **kwargs: Any) -> Any:
    if method in CHECKPOINTING_METHODS:
        raise RuntimeError(
            f"{method} on a network lifted by bayesianize: the checkpointed forward pass runs "
            "again during the backward pass, outside the Pyro trace, and would read freshly "
            "drawn weights. Train the lifted network without it (smaller batches save memory "
            "instead), or call bdl.nn.unlift(net) first to train it as a point estimate."
        )
    if method == "set_adapter":
        raise RuntimeError(
            "set_adapter on a network lifted by bayesianize: its random sites are the adapters "
            "that were active when it was lifted, and after the switch the forward pass would "
            "read another adapter's fixed weights instead. Choose the adapter first: "
            "bdl.nn.unlift(net, guide.median()); net.set_adapter(name); "
            "bdl.bayesianize(net, expose=bdl.nn.lora)."
        )
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
    """Refuse the methods of this module's docstring on every layer of ``module`` having them."""
    for sub in module.modules():
        for method in _guarded(sub):
            object.__setattr__(sub, method, functools.partial(_refuse, method))


def unguard(module: nn.Module) -> None:
    """Undo :func:`guard`: the libraries' own methods again."""
    for sub in module.modules():
        for method in (*ADAPTER_METHODS, *CHECKPOINTING_METHODS):
            entry = sub.__dict__.get(method)
            if isinstance(entry, functools.partial) and entry.func is _refuse:
                del sub.__dict__[method]
