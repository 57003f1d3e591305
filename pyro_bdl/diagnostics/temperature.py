r"""Temperature scaling: one scalar T > 0 fitted on held-out data recalibrates a classifier.

The predictive is :math:`\operatorname{softmax}(z / T)` for logits :math:`z`; T is the minimiser
of the held-out negative log-likelihood. Dividing every logit by the same positive number keeps
each row's ordering, so the predicted classes (and the accuracy) do not change: only the
confidence does. It is the standard post-hoc baseline that a Bayesian predictive must beat.

With :math:`\beta = 1/T`, the mean NLL of n labelled rows and its first two derivatives are

.. math::

    L(\beta) = \frac1n \sum_i \Big[\log\sum_c e^{\beta z_{ic}} - \beta z_{i y_i}\Big],\quad
    L'(\beta) = \frac1n \sum_i \big(\mathbb E_{p_i}[z_i] - z_{i y_i}\big),\quad
    L''(\beta) = \frac1n \sum_i \operatorname{Var}_{p_i}[z_i] \ge 0,

with :math:`p_i = \operatorname{softmax}(\beta z_i)`. So L is convex in β, L' increases from
:math:`L'(0) = \frac1n\sum_i(\bar z_i - z_{iy_i})` to :math:`L'(\infty) = \frac1n\sum_i(\max_c
z_{ic} - z_{iy_i})`, and a finite optimum exists exactly when :math:`L'(0) < 0 < L'(\infty)`:
the logits beat uniform guessing on average, and at least one label is not a top-scoring class.

On a small validation set of a very accurate network that second condition fails often, and a
few mistakes with small margins drive T far below 1. ``prior_shape=a`` (a > 1) puts the prior
:math:`\beta \sim \mathrm{Gamma}(a, \text{rate } a)` (mean 1, standard deviation
:math:`1/\sqrt a`) on the inverse temperature and returns the posterior mode: the objective gains
:math:`[a\beta - (a - 1)\log\beta]/n`, which is convex too, and its slope
:math:`L'(\beta) + (a - (a-1)/\beta)/n` runs from −∞ to :math:`L'(\infty) + a/n > 0`, so a finite
T exists for any data.

Usage::

    T = fit_temperature(logits_val, y_val)          # held-out data, never the test set
    probs = temperature_scale(logits_test, T)       # (n, C), rows sum to 1

References:
    Guo, Pleiss, Sun & Weinberger, "On Calibration of Modern Neural Networks", ICML 2017.
    Platt, "Probabilistic Outputs for Support Vector Machines and Comparisons to Regularized
    Likelihood Methods", 1999 (the scaling family it generalises).
"""

from __future__ import annotations

import math

import torch

from pyro_bdl._validation import check_positive, check_positive_int
from pyro_bdl.diagnostics.metrics import as_tensor, check_finite_values

__all__ = ["fit_temperature", "temperature_scale"]

#: The search never leaves |log T| ≤ this: exp(±700) is still a normal float64.
_LOG_BETA_LIMIT = 700.0


def _check_logits(logits, *, rows: bool) -> torch.Tensor:
    logits = as_tensor("logits", logits)
    if not logits.is_floating_point():
        raise TypeError(
            f"logits must be floating point; got dtype {logits.dtype}. Use logits.double()."
        )
    if rows and logits.dim() != 2:
        raise ValueError(
            f"logits must have shape (n, C); got {tuple(logits.shape)}. For one example use "
            "logits.unsqueeze(0); temperature scaling fits one network's logits, not posterior "
            "draws (S, n, C)."
        )
    if logits.dim() == 0 or logits.numel() == 0:
        raise ValueError(
            f"logits must be non-empty with classes on the last dimension; got shape "
            f"{tuple(logits.shape)}. Pass the network's outputs for at least one example."
        )
    check_finite_values(
        "logits",
        logits,
        "The network produced them (its training diverged); check it (e.g. a smaller "
        "learning rate) before fitting a temperature.",
    )
    num_classes = logits.shape[-1]
    if num_classes >= 2 and bool(((logits >= 0) & (logits <= 1)).all()):
        # Rows in [0, 1] that sum to 1 (within check_probs' tolerance) are softmax outputs,
        # not logits: dividing them by T would not temper anything.
        sums = logits.detach().double().sum(-1)
        if bool(((sums - 1).abs() <= 1e-4 + torch.finfo(logits.dtype).eps).all()):
            raise ValueError(
                f"logits look like probabilities: every row of the {tuple(logits.shape)} "
                "tensor is non-negative and sums to 1. Pass the network's logits, or "
                "probs.log() (the same softmax at every temperature)."
            )
    return logits


def _check_labels(y, logits: torch.Tensor) -> torch.Tensor:
    y = as_tensor("y", y)
    n, num_classes = logits.shape
    if y.shape != (n,):
        raise ValueError(
            f"labels y must have shape ({n},) to match logits {tuple(logits.shape)}; got "
            f"{tuple(y.shape)}. Pass one integer label per row (y.reshape(-1), or y.argmax(-1) "
            "for one-hot labels)."
        )
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(f"labels y must be integers; got dtype {y.dtype}. Use y.long().")
    lo, hi = (int(v) for v in torch.aminmax(y))
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"labels y must lie in [0, {num_classes}) for logits with {num_classes} classes; got "
            f"min {lo}, max {hi}. Check the label encoding or the network's number of outputs."
        )
    return y.long().to(logits.device)


def _slope_and_curvature(z: torch.Tensor, z_y: torch.Tensor, beta: float) -> tuple[float, float]:
    """(L'(β), L''(β)) of the module docstring, for row-max-shifted float64 logits ``z``."""
    p = torch.softmax(beta * z, dim=-1)
    mean = (p * z).sum(-1)
    var = (p * (z - mean.unsqueeze(-1)) ** 2).sum(-1)
    return float((mean - z_y).mean()), float(var.mean())


def fit_temperature(
    logits, y, *, prior_shape: float | None = None, tol: float = 1e-10, max_iter: int = 100
) -> float:
    r"""The temperature T > 0 that minimises the mean NLL of ``softmax(logits / T)`` on ``y``
    (or, with ``prior_shape``, the posterior mode of 1/T under a Gamma prior centred on T = 1).

    Fit it on held-out data (a validation split), never on the training or the test set: on
    training data a network is overconfident in a way the test data will not confirm.

    :param logits: the network's outputs on the held-out rows, shape (n, C), n ≥ 1, C ≥ 2
        (a tensor or numpy array; computed in float64 whatever its dtype).
    :param y: integer labels in [0, C), shape (n,).
    :param prior_shape: ``None`` (default) for the maximum-likelihood T; a number a > 1 for the
        mode under the prior 1/T ~ Gamma(a, rate a) (see the module docstring), which always
        exists and shrinks T toward 1 when the validation rows carry little information.
    :param float tol: stop once the step (or the bracket) in log T is at most this.
    :param int max_iter: Newton or bisection steps allowed after bracketing.
    :returns: T as a Python float; ``temperature_scale(logits, T)`` gives the probabilities.
    :raises ValueError: for bad shapes, dtypes, labels, non-finite logits or probabilities
        passed as logits, and, without a prior, when no finite T minimises the NLL: every label
        is already a top-scoring class (the NLL keeps falling as T → 0), or the logits do no
        better than uniform on these labels (it falls as T → ∞).

    Usage::

        T = fit_temperature(net(x_val), y_val)
        probs = temperature_scale(net(x_test), T)
    """
    check_positive("tol", tol)
    check_positive_int("max_iter", max_iter)
    if prior_shape is not None:
        check_positive("prior_shape", prior_shape)
        if prior_shape <= 1.0:
            raise ValueError(
                f"prior_shape must be > 1 (a Gamma(a, a) prior with a mode); got {prior_shape}. "
                "Use e.g. 2 for a weak prior, or None for the maximum-likelihood T."
            )
    logits = _check_logits(logits, rows=True)
    if logits.shape[1] < 2:
        raise ValueError(
            f"logits must have at least 2 classes; got shape {tuple(logits.shape)}. A single "
            "class has probability 1 at every temperature."
        )
    y = _check_labels(y, logits)

    # float64, each row shifted by its maximum: softmax and L' are unchanged (the shift cancels
    # in E_p[z] - z_y) and exp(β z) can only underflow, never overflow, for any β > 0.
    z = logits.detach().double()
    z = z - z.max(-1, keepdim=True).values
    z_y = z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    slope_at_0 = float((z.mean(-1) - z_y).mean())
    slope_at_inf = float(-z_y.mean())
    if prior_shape is None and slope_at_inf <= 0.0:
        raise ValueError(
            "no finite temperature minimises the NLL: every label in y is a top-scoring class "
            "of its row of logits, so the NLL keeps falling as T → 0. Fit on held-out data the "
            "network sometimes gets wrong (a larger validation split), not on training data."
        )
    if prior_shape is None and slope_at_0 >= 0.0:
        raise ValueError(
            "no finite temperature minimises the NLL: on average the logits score the labels no "
            f"higher than their mean (slope {slope_at_0:.3g} ≥ 0 at T = ∞), so uniform "
            "probabilities are best. Check that y matches the rows and classes of logits."
        )

    # Why this is exact and deterministic: L is convex in β (L'' is a mean of variances), so L'
    # has one root and its sign tells which side of it a point lies on. We search u = log β =
    # −log T, which keeps T > 0 and handles any scale: Newton on h(u) = L'(e^u), whose
    # derivative is e^u L''(e^u) > 0, safeguarded by bisection of a bracket [lo, hi] with
    # h(lo) < 0 < h(hi). Every step shrinks the bracket, so the search ends in at most about
    # log2(1400 / tol) steps even where Newton stalls, and Newton converges quadratically near
    # the root. Fixed float64 arithmetic with no random start gives the same T on every run.
    def h(u: float) -> tuple[float, float]:
        beta = math.exp(u)
        slope, curvature = _slope_and_curvature(z, z_y, beta)
        if prior_shape is not None:  # the Gamma prior's terms, per row like L
            slope += (prior_shape - (prior_shape - 1.0) / beta) / len(z)
            curvature += (prior_shape - 1.0) / (beta**2 * len(z))
        return slope, beta * curvature

    # Bracket the root by doubling steps away from T = 1 (where a trained network's T lies).
    u, (value, deriv) = 0.0, h(0.0)
    lo: float | None = None
    hi: float | None = None
    best = (math.inf, u, value, deriv)  # (|h|, u, h, h') of the point closest to the root
    step = 1.0
    while True:
        if value == 0.0:
            return math.exp(-u)
        best = min(best, (abs(value), u, value, deriv))
        if value > 0:
            hi = u
        else:
            lo = u
        if lo is not None and hi is not None:
            break
        if abs(u) >= _LOG_BETA_LIMIT:
            raise ValueError(
                f"the NLL's minimum lies at |log T| > {_LOG_BETA_LIMIT:g}; the logits are too "
                "close to a degenerate case (all labels top-scoring, or uninformative logits). "
                "Fit on held-out data the network sometimes gets wrong, and check that y "
                "matches the rows and classes of logits."
            )
        # A positive slope puts the root at smaller β (larger T), a negative one at larger β.
        u = min(max(u - step if value > 0 else u + step, -_LOG_BETA_LIMIT), _LOG_BETA_LIMIT)
        value, deriv = h(u)
        step *= 2.0
    assert lo is not None and hi is not None  # for the type checker: the loop set both

    # Newton starts from the bracket end with the smaller slope: when the root sits next to an
    # end (T = 1 optimal, say), that end's Newton step lands on it at once, whereas starting
    # from the far end would keep overshooting past it and fall back to bisection.
    _, u, value, deriv = best
    step, older_step = hi - lo, hi - lo
    for _ in range(max_iter):
        if value == 0.0 or hi - lo <= tol:
            return math.exp(-u)
        newton = u - value / deriv if deriv > 0 else math.nan
        if abs(newton - u) <= tol:  # converged (the step may be below float resolution of u)
            return math.exp(-newton)
        # Bisect when Newton leaves the bracket or does not at least halve the step before last
        # (Newton converging quadratically always does; a stalling one does not).
        if not lo < newton < hi or abs(newton - u) > 0.5 * abs(older_step):
            nxt = 0.5 * (lo + hi)
        else:
            nxt = newton
        step, older_step = nxt - u, step
        u = nxt
        value, deriv = h(u)
        if value > 0:
            hi = u
        elif value < 0:
            lo = u
        if abs(step) <= tol:
            return math.exp(-u)
    raise RuntimeError(
        f"fit_temperature did not reach tol={tol:g} in max_iter={max_iter} steps (bracket of "
        f"log T: [{-hi:.6g}, {-lo:.6g}]); raise max_iter or tol."
    )


def temperature_scale(logits, temperature: float | torch.Tensor) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the last dimension, in the dtype of ``logits``.

    The argmax of every row (so the accuracy) is the same at every temperature.

    :param logits: shape (..., C), floating point, finite.
    :param temperature: T > 0, usually from :func:`fit_temperature`: a number, or a tensor
        holding one, through which the gradient flows (to fit T by gradient descent).
    :returns: probabilities of the same shape; each row sums to 1.

    Usage::

        probs = temperature_scale(net(x_test), fit_temperature(net(x_val), y_val))
    """
    check_positive("temperature", temperature, fix="Pass T > 0, e.g. from fit_temperature.")
    if isinstance(temperature, torch.Tensor) and temperature.numel() != 1:
        raise ValueError(
            f"temperature must be one number; got a tensor of shape {tuple(temperature.shape)}. "
            "Pass one T > 0 for all rows (temperature scaling fits a single scalar)."
        )
    logits = _check_logits(logits, rows=False)
    # Each row shifted by its maximum (softmax does not change) is at most 0, so dividing by a
    # small T cannot overflow to inf (softmax(inf) is NaN); float16 and bfloat16 are computed
    # in float32 and rounded once at the end.
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z - z.max(-1, keepdim=True).values
    # A tensor T stays a tensor: float(T) would cut it from the graph, and a T being fitted by
    # gradient descent would silently stay where it started.
    t = (
        temperature.reshape(()).to(z)
        if isinstance(temperature, torch.Tensor)
        else float(temperature)
    )
    return torch.softmax(z / t, dim=-1).to(logits.dtype)
