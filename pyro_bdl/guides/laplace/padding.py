"""Right-padded token batches regrouped by length, for a Laplace fit (``fit(trim_padding=True)``).

A fit's curvature, its data statistics and the mode check's gradient are sums over rows, so the
rows may be visited in any order and grouping. A tokenizer's right-padded batch (a mapping with
an ``attention_mask`` of ones then zeros in every row) computes every padding position of every
layer although no real position reads it: a masked key gets the attention weight
``exp(min - max) = 0`` exactly, and a position embedding depends on the position, not on the
batch's width. :class:`ByLength` sorts the rows of each batch by length, cuts them into groups
of similar length (:func:`plan_groups`) and trims every group to its longest row, so that a
batch whose lengths spread (a long tail of long phrases) computes about its real tokens only.

This is exact, up to the order of floating-point sums, for a network whose output for a row
does not depend on that row's trailing masked positions nor on the batch's width: BERT-style
encoders with absolute positions, and causal decoders with right padding. It is not for a
network that ignores the mask (pooling over every position), nor for left padding (refused).

KFAC (``hessian_structure="kron"``) is a sum over rows too, but its reduce form
(:mod:`~pyro_bdl.curvature.kfac`) gives a row whose gradient at a layer is exactly zero the mean
input over the batch's width, padding included: a row of one position, whose attention over
its one key has no gradient with respect to the query, would change with the width. The kron
fit refuses such rows (``min_length=2``; a tokenizer's ``[CLS] ... [SEP]`` has at least two).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from pyro_bdl.guides.laplace.batches import iter_batches
from pyro_bdl.models.structured import rows_of

__all__ = [
    "CALL_TOKENS",
    "SEQUENCE_KEYS",
    "ByLength",
    "check_trim_padding",
    "plan_groups",
    "row_lengths",
]

#: The keys of a Hugging Face text batch that hold one entry per position (B, T, ...): those
#: trimmed to a group's width. Any other entry of the mapping keeps its columns (rows are
#: selected as for every tensor of a batch).
SEQUENCE_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")

#: The fixed cost of one more forward call, in padded positions, when a batch is cut into
#: groups: a group is split further only where the positions it saves outweigh this. Measured on
#: all-MiniLM-L6-v2 with one CPU thread (256 SST-2 phrases sorted by length: groups of 16 rows
#: took 1.18 s for 3,808 positions, groups of 8 1.33 s for 3,592, about 9 ms a call against
#: 0.3 ms a position, so one call is worth about 30 positions).
CALL_TOKENS = 32


def check_trim_padding(trim_padding: object) -> None:
    """Refuse a ``trim_padding`` that is not a bool (a truthy mask or string would read as True)."""
    if not isinstance(trim_padding, bool):
        raise TypeError(
            f"trim_padding must be True or False; got {type(trim_padding).__name__} "
            f"{trim_padding!r}. Pass a bool."
        )


def row_lengths(mask: Any, min_length: int = 1, what: str = "x['attention_mask']") -> torch.Tensor:
    """The number of real positions of each row of a right-padded attention mask (B, T).

    :raises ValueError: when ``mask`` is not a (B, T) tensor of zeros and ones, when a row is not
        ones followed by zeros (left padding or holes: trimming would cut real positions), when
        a row has no real position (its output depends on the width), or fewer than
        ``min_length``.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"trim_padding=True needs {what} as a (batch, length) tensor; got {shape}. Pass the "
            "tokenizer's attention_mask, or trim_padding=False."
        )
    ones, zeros = mask == 1, mask == 0
    if not bool((ones | zeros).all()):
        raise ValueError(
            f"trim_padding=True needs {what} of zeros and ones; it holds other values (e.g. "
            f"{mask[~(ones | zeros)][:3].tolist()}). Pass a 0/1 padding mask, or "
            "trim_padding=False."
        )
    if not bool((ones[:, 1:] <= ones[:, :-1]).all()) or not bool(ones[:, 0].all()):
        bad = int(((ones[:, 1:] > ones[:, :-1]).any(1) | ~ones[:, 0]).nonzero()[0, 0])
        raise ValueError(
            f"trim_padding=True needs right padding: every row of {what} ones then zeros, with "
            f"at least one one; row {bad} is {mask[bad].tolist()}. Pad on the right "
            "(tokenizer.padding_side = 'right'), or pass trim_padding=False."
        )
    lengths = ones.sum(1)
    if min_length > 1 and bool((lengths < min_length).any()):
        bad = int((lengths < min_length).nonzero()[0, 0])
        raise ValueError(
            f"trim_padding=True with hessian_structure='kron' needs at least {min_length} real "
            f"positions a row; row {bad} of {what} has {int(lengths[bad])}. KFAC's reduce form "
            "averages the input of a row without gradient over the batch's width, so its fit "
            "would change with the padding; fit with trim_padding=False, or another structure."
        )
    return lengths


def plan_groups(lengths: list[int], max_rows: int, call_tokens: int = CALL_TOKENS) -> list[int]:
    """Where to cut rows sorted by length (ascending) into groups of at most ``max_rows``: the
    group ends (exclusive), chosen to minimise the positions computed (rows × the group's
    longest length) plus ``call_tokens`` per group, by dynamic programming over the cuts."""
    n = len(lengths)
    cost = [0] + [sys.maxsize] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        width = lengths[end - 1]
        for start in range(max(0, end - max_rows), end):
            c = cost[start] + (end - start) * width + call_tokens
            if c < cost[end]:
                cost[end], cut[end] = c, start
    ends, end = [], n
    while end > 0:
        ends.append(end)
        end = cut[end]
    return ends[::-1]


def _trim(x: Mapping, rows: torch.Tensor, width: int) -> dict:
    out = {}
    for key, value in x.items():
        value = rows_of(value, rows)
        if key in SEQUENCE_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 2:
            value = value[:, :width]
        out[key] = value
    return out


class ByLength:
    """The batches of ``data`` with the rows of each regrouped by length and trimmed to each
    group's longest row (see the module docstring); iterable any number of times.

    :param data: what :meth:`AutoSubnetLaplace.fit` takes, every batch ``(x, y, ...)`` with ``x``
        a mapping holding an ``attention_mask`` (right-padded, 0/1).
    :param int max_rows: the most rows of a group.
    :param int min_length: refuse rows with fewer real positions (:func:`row_lengths`).
    """

    def __init__(self, data: Any, max_rows: int, min_length: int = 1):
        self.data, self.max_rows, self.min_length = data, max_rows, min_length

    def check(self, batch: tuple) -> torch.Tensor:
        """The row lengths of ``batch`` (``(x, y, ...)``), or the refusal of its ``x``: a fit
        checks its first batch with this before it sets anything up.

        :raises TypeError: when ``x`` is not a mapping with an ``attention_mask``.
        :raises ValueError: as :func:`row_lengths`.
        """
        x = batch[0]
        if not isinstance(x, Mapping) or "attention_mask" not in x:
            held = list(x) if isinstance(x, Mapping) else type(x).__name__
            raise TypeError(
                "trim_padding=True needs each batch's x as a mapping with an "
                f"'attention_mask' (a tokenizer's output); got {held}. Pass x as a dict "
                "of input_ids and attention_mask, or trim_padding=False."
            )
        return row_lengths(x["attention_mask"], self.min_length)

    def __iter__(self) -> Iterator[tuple]:
        for batch in iter_batches(self.data, sys.maxsize):
            x = batch[0]
            lengths = self.check(batch)
            ordered = torch.sort(lengths.cpu(), stable=True)
            order, sorted_lengths = ordered.indices, ordered.values.tolist()
            start = 0
            for end in plan_groups(sorted_lengths, self.max_rows):
                rows = order[start:end].to(lengths.device)
                width = sorted_lengths[end - 1]
                yield (_trim(x, rows, width), *(rows_of(t, rows) for t in batch[1:]))
                start = end
