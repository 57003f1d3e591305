r"""Metrics on predictive probabilities: plain functions of tensors (or arrays) with clear errors.

Classification figures take the mean predictive probabilities ``probs`` of shape (n, C) (already
averaged over posterior draws, or from a linearized predictive) and integer labels ``y`` of
shape (n,); regression figures take predictive means (and noise scales) in standardized units and
report them in the original units of the targets (docs/design/evaluation.md).

Usage::

    probs = predictor(x_test)                      # (n, C), rows sum to 1
    metrics.accuracy(probs, y_test), metrics.nll(probs, y_test), metrics.ece(probs, y_test)
    table = metrics.reliability(probs, y_test)     # the reliability-diagram data

References:
    Guo, Pleiss, Sun & Weinberger, "On Calibration of Modern Neural Networks", ICML 2017.
    Brier, "Verification of forecasts expressed in terms of probability", 1950.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pyro_bdl._validation import check_positive, check_positive_int

__all__ = [
    "Reliability",
    "accuracy",
    "as_tensor",
    "bin_sums",
    "brier",
    "brier_terms",
    "check_finite_values",
    "check_probs",
    "ece",
    "gaussian_log_likelihood",
    "nll",
    "nll_terms",
    "reliability",
    "reliability_from_sums",
    "rmse",
]


def as_tensor(name: str, value) -> torch.Tensor:
    """``value`` as a tensor (numpy arrays and lists are accepted); refuse anything else."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        return torch.as_tensor(np.asarray(value))
    raise TypeError(
        f"{name} must be a torch.Tensor or numpy array; got {type(value).__name__}. Convert it "
        "with torch.as_tensor or np.asarray."
    )


#: The fix for non-finite predictions: they come from the predictor, not from the data.
PREDICTION_FIX = (
    "The predictor produced them (training diverged, or a guide scale overflowed); check its "
    "training (e.g. a smaller learning rate) before scoring it."
)


def check_finite_values(name: str, tensor: torch.Tensor, fix: str) -> None:
    """Refuse NaN/inf in ``tensor``, naming it, the count, the first offending index and
    ``fix`` (what to do about it, which depends on where the values came from)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return
    bad = ~torch.isfinite(tensor.detach())
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} contains {int(bad.sum())} non-finite value(s) (NaN or inf); the first is "
            f"at index {first}. {fix}"
        )


def check_probs(probs, y=None, *, atol: float = 1e-4, name: str = "probs") -> None:
    """Require ``probs`` of shape (n, C), n ≥ 1, with rows that are probability vectors (summing
    to 1 within ``atol`` plus the machine epsilon of their dtype), and (if given) integer labels
    ``y`` of shape (n,) in [0, C); errors call the probabilities ``name``."""
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not 0 <= atol < 1:
        raise ValueError(f"atol must be a number in [0, 1); got {atol!r}. Use the default 1e-4.")
    probs = as_tensor(name, probs)
    if probs.dim() != 2:
        raise ValueError(
            f"{name} must have shape (n, C); got {tuple(probs.shape)}. For one example use "
            "probs.unsqueeze(0); for posterior draws (S, n, C) average first: probs.mean(0)."
        )
    if probs.shape[0] == 0:
        raise ValueError(f"{name} has zero rows; evaluate on at least one example.")
    if not probs.is_floating_point():
        raise TypeError(
            f"{name} must be floating point; got dtype {probs.dtype}. Pass class probabilities "
            f"(logits.softmax(-1)), or {name}.float()."
        )
    check_finite_values(name, probs, PREDICTION_FIX)
    # Each entry of a softmax rounded to the dtype is off by at most half an ulp, so a row's
    # exact sum is off by about half the machine epsilon: 5e-4 in float16 and 4e-3 in bfloat16,
    # beyond the default atol. The sum is taken in float64, which adds no rounding of its own.
    sums = probs.double().sum(-1)
    tol = atol + torch.finfo(probs.dtype).eps
    if bool(((sums - 1).abs() > tol).any()) or (probs < 0).any():
        worst = (
            int((sums - 1).abs().argmax())
            if (probs >= 0).all()
            else int((probs < 0).any(-1).nonzero()[0, 0])
        )
        raise ValueError(
            f"each row of {name} must be a probability vector (non-negative, summing to 1 within "
            f"{tol:.3g}); row {worst} sums to {float(sums[worst]):.6g} with minimum "
            f"{float(probs[worst].min()):.6g}. Pass softmax(logits), not logits."
        )
    if y is None:
        return
    y = as_tensor("y", y)
    if y.shape != probs.shape[:1]:
        raise ValueError(
            f"labels y must have shape ({probs.shape[0]},) to match probs {tuple(probs.shape)}; "
            f"got {tuple(y.shape)}. Pass one label per row of probs."
        )
    if y.is_floating_point() or y.dtype == torch.bool:
        raise TypeError(f"labels y must be integers; got dtype {y.dtype}. Use y.long().")
    if y.min() < 0 or y.max() >= probs.shape[1]:
        raise ValueError(
            f"labels y must lie in [0, {probs.shape[1]}); got min {int(y.min())}, max "
            f"{int(y.max())}. Check the label encoding or the number of classes."
        )


def _checked(probs, y) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` (float64) and ``y`` (long) checked, detached: a metric is a number, and
    predictions straight from a network still carry its graph (which numpy refuses)."""
    check_probs(probs, y)
    probs = as_tensor("probs", probs).detach()
    return probs.double(), as_tensor("y", y).detach().long().to(probs.device)


def accuracy(probs, y) -> float:
    """Fraction of examples whose most probable class is the label."""
    probs, y = _checked(probs, y)
    return float((probs.argmax(-1) == y).double().mean())


def nll(probs, y, *, eps: float = 1e-12) -> float:
    r"""Mean negative log predictive probability of the labels, :math:`-\frac1n\sum_i\log p_{y_i}`
    (probabilities are floored at ``eps``, in (0, 1), so that a confident mistake costs at most
    :math:`-\log \epsilon` instead of infinity)."""
    return float(nll_terms(probs, y, eps=eps).mean())


def nll_terms(probs, y, *, eps: float = 1e-12) -> torch.Tensor:
    r"""The per-example terms :math:`-\log \max(p_{y_i}, \epsilon)` of :func:`nll`, float64."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(
            f"eps must be a number in (0, 1) (the floor of a probability); got {eps!r}. Use the "
            "default 1e-12."
        )
    probs, y = _checked(probs, y)
    p = probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return -(p.clamp_min(eps)).log()


def brier(probs, y) -> float:
    r"""Brier score :math:`\frac1n\sum_i\sum_c (p_{ic} - 1[y_i = c])^2`, in [0, 2]; lower is
    better."""
    return float(brier_terms(probs, y).mean())


def brier_terms(probs, y) -> torch.Tensor:
    r"""The per-example terms :math:`\sum_c (p_{ic} - 1[y_i = c])^2` of :func:`brier`, float64."""
    probs, y = _checked(probs, y)
    onehot = torch.nn.functional.one_hot(y, probs.shape[1]).double()
    return ((probs - onehot) ** 2).sum(-1)


@dataclass(frozen=True)
class Reliability:
    """The reliability-diagram data of equal-width confidence bins.

    :ivar numpy.ndarray edges: bin edges, shape (num_bins + 1,), from 0 to 1; bin b holds the
        confidences in (edges[b], edges[b+1]] (bin 0 also holds 0).
    :ivar numpy.ndarray counts: number of examples per bin.
    :ivar numpy.ndarray accuracy: fraction correct per bin (NaN for empty bins).
    :ivar numpy.ndarray confidence: mean confidence (max probability) per bin (NaN if empty).
    :ivar float ece: expected calibration error ``Σ_b |B_b|/n · |acc(B_b) − conf(B_b)|``.
    :ivar float mce: maximum calibration error over non-empty bins.
    """

    edges: np.ndarray
    counts: np.ndarray
    accuracy: np.ndarray
    confidence: np.ndarray
    ece: float
    mce: float

    def to_dict(self) -> dict:
        """Plain lists (NaN as None), for JSON."""

        def clean(a):
            return [None if math.isnan(v) else float(v) for v in np.asarray(a, dtype=float)]

        return {
            "edges": clean(self.edges),
            "counts": [int(c) for c in self.counts],
            "accuracy": clean(self.accuracy),
            "confidence": clean(self.confidence),
            "ece": self.ece,
            "mce": self.mce,
        }


def _bin_edges(num_bins: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The edges b/B, b = 0..B, of ``num_bins`` = B equal-width confidence bins, float64, each the
    float nearest to b/B (``np.linspace`` misses some by one ulp: 14/25 is 0.56, its 0.5599…)."""
    return torch.arange(num_bins + 1, dtype=torch.float64, device=device) / num_bins


def bin_sums(probs, y, *, num_bins: int = 15) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sufficient statistics of :func:`reliability`: per equal-width confidence bin, the
    number of examples, the sum of their confidences (top probabilities) and the number correct,
    as float64 tensors of shape (num_bins,). Sums over disjoint shards add up, so a sharded test
    set is scored by adding them (:func:`pyro_bdl.distributed.sharded_metrics`)."""
    check_positive_int("num_bins", num_bins)
    dtype = as_tensor("probs", probs).dtype
    probs, y = _checked(probs, y)
    confidence, predicted = probs.max(-1)
    correct = (predicted == y).double()
    # Right-closed bins (e_b, e_{b+1}], with the edges b/B rounded to the dtype of probs: a
    # confidence equal to an edge in that dtype (0.6 in float32 is 0.6000000238) belongs to the
    # bin that ends there, whatever the dtype. The bin is the number of inner edges below it, so
    # a confidence of exactly 1 lands in the top bin.
    edges = _bin_edges(num_bins, device=probs.device)
    index = torch.searchsorted(edges[1:-1].to(dtype).double(), confidence)
    counts = torch.bincount(index, minlength=num_bins).double()
    conf_sum = torch.zeros(num_bins, dtype=torch.float64, device=probs.device)
    acc_sum = torch.zeros_like(conf_sum)
    conf_sum.index_add_(0, index, confidence)
    acc_sum.index_add_(0, index, correct)
    return counts, conf_sum, acc_sum


def reliability_from_sums(
    counts: torch.Tensor, conf_sum: torch.Tensor, acc_sum: torch.Tensor
) -> Reliability:
    """:class:`Reliability` from the per-bin sums of :func:`bin_sums` (possibly added over
    shards); ``n`` is ``counts.sum()``."""
    num_bins = len(counts)
    filled = counts > 0
    nan = torch.full_like(conf_sum, float("nan"))
    acc = torch.where(filled, acc_sum / counts.clamp_min(1), nan)
    conf = torch.where(filled, conf_sum / counts.clamp_min(1), nan)
    gap = (acc - conf).abs()
    ece_value = float((counts[filled] / counts.sum() * gap[filled]).sum())
    mce_value = float(gap[filled].max())
    return Reliability(
        _bin_edges(num_bins).numpy(),
        counts.long().cpu().numpy(),
        acc.cpu().numpy(),
        conf.cpu().numpy(),
        ece_value,
        mce_value,
    )


def reliability(probs, y, *, num_bins: int = 15) -> Reliability:
    """Bin the examples by confidence (the top probability) into ``num_bins`` equal-width bins and
    compare each bin's accuracy with its mean confidence."""
    return reliability_from_sums(*bin_sums(probs, y, num_bins=num_bins))


def ece(probs, y, *, num_bins: int = 15) -> float:
    """Expected calibration error with ``num_bins`` equal-width confidence bins (15 by default);
    :func:`reliability` returns the per-bin data behind it."""
    return reliability(probs, y, num_bins=num_bins).ece


def _regression_inputs(mean, y) -> tuple[torch.Tensor, torch.Tensor]:
    mean, y = as_tensor("mean", mean).detach(), as_tensor("y", y).detach()  # as in _checked
    if y.dim() != 1 or y.shape[0] == 0:
        raise ValueError(
            f"y must have shape (n,) with n ≥ 1; got {tuple(y.shape)}. Use y.reshape(-1)."
        )
    if mean.dim() not in (1, 2) or mean.shape[-1] != y.shape[0]:
        raise ValueError(
            f"mean must have shape ({y.shape[0]},) or (num_draws, {y.shape[0]}) to match y "
            f"{tuple(y.shape)}; got {tuple(mean.shape)}. Squeeze a trailing output dim of 1."
        )
    if mean.shape[0] == 0:
        raise ValueError("mean has zero draws; pass at least one predictive draw.")
    if not (mean.is_floating_point() and y.is_floating_point()):
        raise TypeError(
            f"mean and y must be floating point; got {mean.dtype} and {y.dtype}. Use .float() "
            "(or .double())."
        )
    check_finite_values("mean", mean, PREDICTION_FIX)
    check_finite_values("y", y, "Clean or impute the targets before scoring.")
    mean = mean.double()
    return (mean if mean.dim() == 2 else mean.unsqueeze(0)), y.double().to(mean.device)


def rmse(mean, y, *, y_scale: float = 1.0) -> float:
    """Root mean squared error of the predictive mean, in original units.

    :param mean: predictive means in standardized units, shape (n,) or (num_draws, n) (averaged
        over draws first).
    :param y: standardized targets, shape (n,).
    :param float y_scale: the standard deviation used to standardize the targets; the shift
        cancels, so the error in original units is ``y_scale`` times the standardized one.
    """
    check_positive("y_scale", y_scale)
    mean, y = _regression_inputs(mean, y)
    return float(((mean.mean(0) - y) ** 2).mean().sqrt()) * float(y_scale)


def gaussian_log_likelihood(mean, scale, y, *, y_scale: float = 1.0) -> float:
    r"""Mean Gaussian predictive log-likelihood per point, in original units.

    With draws :math:`m_s` the predictive is the mixture :math:`\frac1S\sum_s N(y; m_s,
    \sigma_s^2)`; changing units by ``y_scale`` divides the density by it:
    :math:`\log p(y_{orig}) = \log p(y_{std}) - \log(\text{y\_scale})`.

    :param mean: predictive means in standardized units, shape (n,) or (num_draws, n).
    :param scale: predictive (noise) standard deviation in standardized units: a number, or a
        tensor broadcastable to ``mean``.
    :param y: standardized targets, shape (n,).
    :param float y_scale: the standard deviation used to standardize the targets.
    """
    check_positive("y_scale", y_scale)
    mean, y = _regression_inputs(mean, y)
    scale_t = (
        scale.detach() if isinstance(scale, torch.Tensor) else torch.as_tensor(np.asarray(scale))
    )
    scale_t = scale_t.to(dtype=torch.float64, device=mean.device)
    check_positive("scale", scale_t, fix="Pass the predictive standard deviation σ > 0.")
    try:
        scale_t = torch.broadcast_to(scale_t, mean.shape)
    except RuntimeError:
        raise ValueError(
            f"scale of shape {tuple(scale_t.shape)} does not broadcast to mean "
            f"{tuple(mean.shape)}; pass a number, shape (n,), or (num_draws, n)."
        ) from None
    log_p = torch.distributions.Normal(mean, scale_t).log_prob(y)
    mixture = torch.logsumexp(log_p, 0) - math.log(mean.shape[0])
    return float(mixture.mean()) - math.log(float(y_scale))
