"""The one assertion helper the suite uses for tensors."""

from __future__ import annotations

import torch


def assert_close(actual, expected, *, rtol: float = 1e-6, atol: float = 0.0, msg: str = "") -> None:
    """``torch.testing.assert_close`` on tensors or numbers, with dtype/device of ``actual``."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected, dtype=actual.dtype, device=actual.device)
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=(lambda m: f"{msg}\n{m}") if msg else None
    )
