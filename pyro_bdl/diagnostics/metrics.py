"""Metrics on predictive probabilities: plain functions of tensors with clear errors."""

from __future__ import annotations

import torch

__all__ = ["accuracy", "check_probs", "nll"]


def check_probs(probs: torch.Tensor, y: torch.Tensor, *, atol: float = 1e-4) -> None:
    """Require ``probs`` of shape (n, C) with rows summing to 1 and labels ``y`` of shape (n,)."""
    probs, y = torch.as_tensor(probs), torch.as_tensor(y)
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape (n, C); got {tuple(probs.shape)}.")
    if probs.shape[0] == 0:
        raise ValueError("probs has zero rows; evaluate on at least one example.")
    if y.shape != probs.shape[:1]:
        raise ValueError(
            f"labels must have shape ({probs.shape[0]},) to match probs {tuple(probs.shape)}; "
            f"got {tuple(y.shape)}."
        )
    sums = probs.sum(-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=atol) or (probs < 0).any():
        worst = int((sums - 1).abs().argmax())
        raise ValueError(
            f"each row of probs must be a probability vector; row {worst} sums to "
            f"{float(sums[worst]):.6g}. Pass softmax(logits), not logits."
        )
    if y.numel() and (y.min() < 0 or y.max() >= probs.shape[1]):
        raise ValueError(f"labels must lie in [0, {probs.shape[1]}); got max {int(y.max())}.")


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of examples whose most probable class is the label."""
    check_probs(probs, y)
    return float((torch.as_tensor(probs).argmax(-1) == torch.as_tensor(y)).double().mean())


def nll(probs: torch.Tensor, y: torch.Tensor, *, eps: float = 1e-12) -> float:
    """Mean negative log predictive probability of the labels."""
    check_probs(probs, y)
    probs, y = torch.as_tensor(probs), torch.as_tensor(y)
    p = probs.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
    return float(-(p.double().clamp_min(eps)).log().mean())
