"""The data a Laplace pass reads: one batch ``(x, y)`` or an iterable of them (a DataLoader),
checked batch by batch and cut into chunks of rows.

``x`` may be a tensor or a structured batch (a mapping or tuple of tensors, as a Hugging Face
tokenizer gives), every tensor sliced by rows alike; a batch whose tensors disagree on their row
count, hold a NaN or inf, or hold no tensor at all is refused naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from pyro_bdl._validation import check_finite
from pyro_bdl.models.structured import rows_of

__all__ = ["batch_leaves", "head", "iter_batches"]


def batch_leaves(item: Any, name: str = "x") -> dict[str, torch.Tensor]:
    """The tensors of a batch or of one of its entries, by name: a tensor, a mapping of tensors
    (a structured batch, passed to the network as keyword arguments) or a tuple of them."""
    if isinstance(item, torch.Tensor):
        return {name: item}
    if isinstance(item, Mapping):
        parts = [batch_leaves(v, f"{name}[{k!r}]") for k, v in item.items()]
    elif isinstance(item, (tuple, list)):
        parts = [batch_leaves(v, f"{name}[{i}]") for i, v in enumerate(item)]
    else:
        return {}
    return {k: v for part in parts for k, v in part.items()}


def head(batch: tuple, n: int) -> tuple:
    """The first ``n`` rows of every tensor of a batch (inside mappings and tuples too)."""
    return tuple(rows_of(t, slice(0, n)) for t in batch)


def _one_batch(data: Any) -> bool:
    # One batch (x, y): tensors or mappings of tensors (a structured x); anything else
    # iterable is a sequence of batches (a DataLoader, a list of (x, y)).
    return (
        isinstance(data, (tuple, list))
        and bool(data)
        and all(isinstance(t, (torch.Tensor, Mapping)) for t in data)
    )


def iter_batches(data: Any, batch_size: int) -> Iterator[tuple]:
    """Chunks of at most ``batch_size`` rows from a tuple ``(x, y)`` or a DataLoader of them;
    ``x`` may be a tensor or a mapping (or tuple) of tensors, every tensor sliced by rows."""
    if _one_batch(data):
        batches: Iterable = [tuple(data)]
    elif isinstance(data, Iterable) and not isinstance(data, (torch.Tensor, str, Mapping)):
        batches = data
    else:
        if isinstance(data, torch.utils.data.Dataset):
            fix = " Wrap it: torch.utils.data.DataLoader(data, batch_size=...)."
        elif isinstance(data, (torch.Tensor, Mapping)):
            fix = " Pass (x, y), the inputs with their labels."
        else:
            fix = ""
        raise TypeError(
            "data must be a tuple of tensors (x, y), x possibly a dict of tensors, or a "
            f"DataLoader yielding (x, y); got {type(data).__name__}.{fix}"
        )
    empty = True
    for batch in batches:
        batch = (batch,) if isinstance(batch, (torch.Tensor, Mapping)) else tuple(batch)
        leaves: dict[str, torch.Tensor] = {}
        for i, t in enumerate(batch):
            leaves.update(batch_leaves(t, f"{i} (0: x, 1: y)"))
        if not leaves:
            raise TypeError(
                "data must be a tuple of tensors (x, y) or a DataLoader yielding (x, y); a "
                f"batch held {', '.join(type(t).__name__ for t in batch[:3])}. Pass data=(x, y) "
                "with tensors, or a DataLoader over them."
            )
        for name, t in leaves.items():
            check_finite(f"data tensor {name}", t)
        rows = {t.shape[0] if t.dim() else 0 for t in leaves.values()}
        if len(rows) != 1 or 0 in rows:
            raise ValueError(
                f"every tensor of a batch needs the same, non-zero number of rows; got "
                f"{sorted(rows)}. Pass matching (x, y)."
            )
        n = rows.pop()
        for start in range(0, n, batch_size):
            empty = False
            yield tuple(rows_of(t, slice(start, start + batch_size)) for t in batch)
    if empty:
        raise ValueError("data is empty; fit needs at least one example.")
