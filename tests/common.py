"""Helpers the suite shares: the one assertion for tensors, a forward-call recorder, a tied-weight
network."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def assert_close(
    actual, expected, *, rtol: float | None = None, atol: float = 0.0, msg: str = ""
) -> None:
    """``torch.testing.assert_close`` on tensors or numbers, with dtype/device of ``actual``.

    A Python number (or list of them) is compared in float64: ``torch.as_tensor`` would make it
    float32, where two values 1e-8 apart round to the same number and an ``rtol`` below float32's
    epsilon (1.2e-7) checks nothing.

    Without ``rtol``, the round-off of the same arithmetic done another way: 1e-10 in float64
    (sums of up to ~1e4 terms reordered err by ≲ 1e4 · 1.1e-16 ≈ 1e-12; every float64 use of the
    default measured ≤ 1e-11) and 1e-6 otherwise (float32: ~8 ulps of ε = 1.2e-7). A comparison
    whose reference is computed less precisely passes its own ``rtol`` and says why."""
    if not isinstance(actual, torch.Tensor) and not hasattr(actual, "dtype"):
        actual = torch.as_tensor(actual, dtype=torch.float64)
    actual = torch.as_tensor(actual)
    if rtol is None:
        rtol = 1e-10 if actual.dtype == torch.float64 else 1e-6
    expected = torch.as_tensor(expected, dtype=actual.dtype, device=actual.device)
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=(lambda m: f"{msg}\n{m}") if msg else None
    )


def rows_per_forward(net: nn.Module):
    """``(rows, handle)``: a forward pre-hook on ``net`` appends the rows of each call's batch (its
    first positional input, else its first keyword input, as a Hugging Face model's
    ``input_ids``); ``handle.remove()`` takes it off."""
    rows: list[int] = []

    def hook(_module, inputs, kwargs):
        first = next(iter(inputs), None)
        first = next(iter(kwargs.values())) if first is None else first
        rows.append(first.shape[0])

    return rows, net.register_forward_pre_hook(hook, with_kwargs=True)


class TiedLinear(nn.Module):
    """Two distinct Linear layers holding one weight tensor (a tied weight), then a head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


def assert_float32_or_wider(named: dict) -> None:
    """Every floating tensor among ``named``'s values is float32 or wider: no accumulator,
    parameter or optimizer state is ever bfloat16 or float16."""
    wrong = {
        k: v.dtype
        for k, v in named.items()
        if isinstance(v, torch.Tensor)
        and v.is_floating_point()
        and v.dtype not in (torch.float32, torch.float64)
    }
    assert not wrong, f"narrower than float32: {wrong}"


def assert_moved_alike(start, fp32, amp, relative: float) -> None:
    """A mixed-precision run's movement from ``start`` is within ``relative`` of the float32
    run's (which must have moved)."""
    moved = (fp32 - start).norm()
    assert moved > 0
    assert (amp - fp32).norm() <= relative * moved, float((amp - fp32).norm() / moved)


def data_root() -> Path:
    """The real-data folder: ``$PYRO_BDL_DATA``, else ``../shared/data`` beside the project."""
    env = os.environ.get("PYRO_BDL_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
