"""What a model passes to its network and what it reads back, for networks that take more than
one tensor or return more than one.

A batch ``x`` is a tensor (``net(x)``), a mapping of tensors passed as keyword arguments
(``net(**x)``: a tokenizer's ``input_ids`` and ``attention_mask``) or a tuple of tensors passed
as positional arguments (``net(*x)``). Every tensor of a structured batch has the examples along
dim 0.

The network may return a tensor, a Hugging Face ``ModelOutput``, a dict or a tuple; the
likelihood reads one tensor of it, chosen by ``output=``: by default the tensor itself,
``.logits`` / ``"logits"``, or the first element of a tuple. An index selects an element of a
tuple, or a field of a ``ModelOutput`` or dict in order, as Hugging Face indexes its outputs
(``out[0]``: the first field that is set).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Batch", "Output", "call_network", "check_output", "rows_of", "select_output"]

#: A batch of inputs: one tensor, a mapping of tensors (keyword arguments) or a tuple of tensors.
Batch = torch.Tensor | Mapping[str, torch.Tensor] | tuple[torch.Tensor, ...]
#: Which tensor of the network's output the likelihood reads: ``None`` (the default rule), a
#: key or attribute name, a tuple index, or a callable ``out -> tensor``.
Output = str | int | Callable[[Any], torch.Tensor] | None


def check_output(output: Any) -> Output:
    """Refuse an ``output=`` selector of the wrong type."""
    if output is None or isinstance(output, str) or callable(output):
        return output
    if isinstance(output, int) and not isinstance(output, bool):
        return output
    raise TypeError(
        f"output must be None, a key or attribute name ('logits'), a tuple index or a callable "
        f"out -> tensor; got {type(output).__name__} {output!r}."
    )


def call_network(net: nn.Module, x: Batch) -> Any:
    """``net(x)``, ``net(**x)`` or ``net(*x)`` by the batch's structure."""
    if isinstance(x, Mapping):
        return net(**x)
    if isinstance(x, (tuple, list)):
        return net(*x)
    return net(x)


def rows_of(item: Any, rows: slice | torch.Tensor) -> Any:
    """``item`` with every tensor in it (inside mappings and tuples too) indexed along dim 0 by
    ``rows`` (a slice, or a tensor of row indices)."""
    if isinstance(item, torch.Tensor):
        return item[rows]
    if isinstance(item, Mapping):
        return {k: rows_of(v, rows) for k, v in item.items()}
    if isinstance(item, (tuple, list)):
        return type(item)(rows_of(v, rows) for v in item)
    return item


def _describe(out: Any) -> str:
    if isinstance(out, Mapping):
        return f"{type(out).__name__} with keys {list(out.keys())}"
    if isinstance(out, (tuple, list)):
        return f"{type(out).__name__} of {len(out)}"
    return type(out).__name__


def select_output(out: Any, output: Output) -> torch.Tensor:
    """The tensor of the network's output ``out`` that the likelihood reads (see this module's
    docstring); raises naming what the network returned and the ``output=`` to pass."""
    if output is None:
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, Mapping):
            picked = out.get("logits")
        elif isinstance(out, (tuple, list)) and out:
            picked = out[0]
        else:
            picked = getattr(out, "logits", None)
    elif callable(output):
        picked = output(out)
    elif isinstance(output, str):
        picked = out.get(output) if isinstance(out, Mapping) else getattr(out, output, None)
    else:
        # A ModelOutput indexes its fields that are set, in order (out[0] is the first).
        fields = list(out.values()) if isinstance(out, Mapping) else out
        indexable = isinstance(fields, (tuple, list)) and -len(fields) <= output < len(fields)
        picked = fields[output] if indexable else None
    if not isinstance(picked, torch.Tensor):
        raise TypeError(
            f"the model reads one tensor of the network's output, chosen by output="
            f"{output!r}, but the network returned {_describe(out)} and that gives "
            f"{type(picked).__name__}. Pass output= naming the tensor (a key such as 'logits', "
            "a tuple index, or a callable out -> tensor)."
        )
    return picked
