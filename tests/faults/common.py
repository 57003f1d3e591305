"""What the fault tests share: the global random states, and a deep bit-for-bit comparison of
snapshots (tensors, arrays, dicts, sequences, numbers; NaN equals NaN) that names the first
difference. Each test file decides what its snapshot holds."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_states() -> dict:
    """The global random states of torch (CPU), Python and NumPy (the legacy global stream,
    which ``np.random.seed`` sets)."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (the global state is what must not move)
    }


def assert_same(before, after, path: str = "snapshot") -> None:
    """Bit-for-bit equality (NaN equal to NaN), naming the first difference."""
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), path
        assert before.shape == after.shape and before.dtype == after.dtype, path
        same = (
            torch.equal(before.isnan(), after.isnan())
            and torch.equal(before.nan_to_num(0.0), after.nan_to_num(0.0))
            if before.is_floating_point()
            else torch.equal(before, after)
        )
        assert same, f"{path} changed"
    elif isinstance(before, np.ndarray):
        assert np.array_equal(before, after), f"{path} changed"
    elif isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), f"{path} keys changed"
        for k in before:
            assert_same(before[k], after[k], f"{path}[{k!r}]")
    elif isinstance(before, (list, tuple)):
        assert isinstance(after, (list, tuple)) and len(before) == len(after), f"{path} length"
        for k, (a, b) in enumerate(zip(before, after)):
            assert_same(a, b, f"{path}[{k}]")
    elif isinstance(before, float) and before != before:
        assert isinstance(after, float) and after != after, f"{path} changed: nan -> {after!r}"
    else:
        assert before == after, f"{path} changed: {before!r} -> {after!r}"
