r"""Metrics of binary and multilabel predictions: the probability :math:`p = P(y = 1)` of each
label against 0/1 labels (docs/design/evaluation.md).

For a multilabel prediction ``(N, K)`` every metric is the mean over the N·K labels, each label a
binary problem (scikit-learn's convention for ``log_loss`` and ``brier_score_loss`` applied to
the flattened arrays).

Usage::

    p = guide.predict(x_test)                     # binary_classifier: P(y = 1), shape (N,)
    binary_nll(p, y_test), binary_brier(p, y_test), binary_ece(p, y_test)
"""

from __future__ import annotations

import torch

from pyro_bdl._validation import check_positive_int
from pyro_bdl.models.checks import check_binary_labels

__all__ = ["binary_brier", "binary_ece", "binary_nll"]


def _checked(p, y) -> tuple[torch.Tensor, torch.Tensor]:
    # Detached: a metric is a number, and p straight from a network still carries its graph.
    p, y = torch.as_tensor(p).detach(), torch.as_tensor(y).detach()
    if not p.is_floating_point():
        raise TypeError(
            f"p must hold probabilities P(y = 1) (floating point); got {p.dtype}. Pass "
            "torch.sigmoid(logits), or p.float() for 0/1 probabilities."
        )
    if p.shape != y.shape or p.numel() == 0:
        fix = "Pass one probability P(y = 1) per label."
        if p.dim() == 2 and p.shape[0] == y.numel() and y.dim() == 1:
            if p.shape[1] == 2:
                fix = "For the two columns of class probabilities pass p[:, 1], P(y = 1)."
            elif p.shape[1] == 1:
                fix = "Drop the column of size 1: p.squeeze(-1)."
        raise ValueError(
            f"p and y must have the same non-empty shape, (N,) or (N, K); got p "
            f"{tuple(p.shape)} and y {tuple(y.shape)}. {fix}"
        )
    if not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError(
            f"p must hold probabilities in [0, 1] (NaN refused); got min {float(p.min()):.6g}, "
            f"max {float(p.max()):.6g}. Apply torch.sigmoid to logits."
        )
    check_binary_labels(y)
    return p.double().reshape(-1), y.double().reshape(-1)


def binary_nll(p, y, *, eps: float = torch.finfo(torch.float64).eps) -> float:
    """Mean negative log-likelihood :math:`-[y\\log p + (1-y)\\log(1-p)]`, with ``p`` clipped to
    ``[eps, 1 - eps]`` (scikit-learn's ``log_loss``, whose default ``eps`` is float64's machine
    epsilon); ``eps`` must lie in (0, 0.5)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 0.5:
        raise ValueError(
            f"eps must be a number in (0, 0.5) (p is clipped to [eps, 1 - eps]); got {eps!r}. "
            "Use the default, float64's machine epsilon."
        )
    p, y = _checked(p, y)
    p = p.clamp(eps, 1 - eps)
    # xlogy: a term of weight 0 is 0 even where 1 - eps rounds to 1 (eps below 1.1e-16), where
    # y·log p + (1 - y)·log(1 - p) would read 0·log 0 = NaN.
    return float(-(torch.xlogy(y, p) + torch.xlogy(1 - y, 1 - p)).mean())


def binary_brier(p, y) -> float:
    """Mean squared difference :math:`(p - y)^2` (scikit-learn's ``brier_score_loss``)."""
    p, y = _checked(p, y)
    return float((p - y).square().mean())


def binary_ece(p, y, *, num_bins: int = 10) -> float:
    r"""Expected calibration error of :math:`P(y = 1)`: with ``num_bins`` equal-width bins of p,
    :math:`\sum_b \frac{n_b}{N} |\bar y_b - \bar p_b|` (the gaps that scikit-learn's
    ``calibration_curve(strategy="uniform")`` draws, weighted by the bins' counts)."""
    p, y = _checked(p, y)
    check_positive_int("num_bins", num_bins)
    # The bin of p as calibration_curve finds it: a left search over the inner edges.
    edges = torch.linspace(0, 1, num_bins + 1, dtype=torch.float64)[1:-1]
    bins = torch.searchsorted(edges, p)
    sum_p = torch.bincount(bins, weights=p, minlength=num_bins)
    sum_y = torch.bincount(bins, weights=y, minlength=num_bins)
    return float((sum_y - sum_p).abs().sum() / p.numel())
