r"""“Did it work?” — Pareto k̂ of a variational guide, and PSIS-LOO on exported data.

For draws θ_s ~ q, the importance ratios r_s = p(θ_s, y) / q(θ_s) have a right tail that a
generalized Pareto distribution fits; its shape k̂ says how far q is from the posterior in the
direction that matters for importance sampling (Yao et al. 2018): k̂ < 0.5 good, 0.5–0.7
questionable, > 0.7 the approximation is not trustworthy. :func:`pareto_khat` is the plain core
(log ratios → k̂, via ArviZ's PSIS); :func:`psis_khat` draws the ratios from a model and guide.

How many draws: PSIS fits the largest M = 3√S ratios, and the standard error of k̂ is about
(1 + k)/√M (maximum likelihood for the generalized Pareto shape), so S = 10⁴ draws give ±0.1 at
k ≈ 0.7 and S = 10⁶ give ±0.03. The default of 1,000 draws separates “good” from “bad” but not
the band edges; raise ``num_samples`` for a sharper figure.

Usage::

    result = psis_khat(model, guide, x, y, num_samples=2000)
    print(result.khat, result.band)           # e.g. 0.31 good
    loo(to_inference_data(model, guide, x, y))

References:
    Yao, Vehtari, Simpson & Gelman, "Yes, but Did It Work?: Evaluating Variational Inference",
    ICML 2018.
    Vehtari, Simpson, Gelman, Yao & Gabry, "Pareto Smoothed Importance Sampling", JMLR 2024.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from pyro import poutine
from pyro.infer.importance import vectorized_importance_weights

from pyro_bdl._caller import user_stacklevel
from pyro_bdl._validation import check_positive_int
from pyro_bdl.diagnostics import arviz_compat
from pyro_bdl.diagnostics.metrics import as_tensor

__all__ = ["BANDS", "PsisResult", "khat_band", "loo", "pareto_khat", "psis_khat"]

#: (upper bound of k̂, band, meaning), in order (Yao et al. 2018, section 3).
BANDS = (
    (0.5, "good", "the guide is close to the posterior; importance sampling is reliable"),
    (0.7, "questionable", "usable, but the guide misses part of the posterior"),
    (
        math.inf,
        "bad",
        "not a trustworthy approximation of the posterior (too narrow, or misses mass)",
    ),
)


def khat_band(khat: float) -> tuple[str, str]:
    """The ``(band, meaning)`` of a k̂ value (NaN counts as ``"bad"``)."""
    for upper, band, meaning in BANDS:
        if khat < upper:
            return band, meaning
    return BANDS[-1][1], BANDS[-1][2]


@dataclass(frozen=True)
class PsisResult:
    """The Pareto k̂ diagnostic of a guide.

    :ivar float khat: the estimated tail shape (``-inf`` when the ratios are constant up to
        rounding: the guide is the posterior).
    :ivar str band: ``"good"`` (k̂ < 0.5), ``"questionable"`` (0.5–0.7) or ``"bad"`` (> 0.7).
    :ivar str meaning: what the band says, in words.
    :ivar torch.Tensor log_weights: the raw log importance ratios log p(θ, y) − log q(θ).
    :ivar float ess: effective sample size of the Pareto-smoothed weights.
    """

    khat: float
    band: str
    meaning: str
    log_weights: torch.Tensor
    ess: float

    @property
    def ok(self) -> bool:
        """Whether k̂ < 0.7, the threshold above which the guide should not be trusted."""
        return self.khat < 0.7

    def __str__(self) -> str:
        return f"k̂ = {self.khat:.3f} ({self.band}: {self.meaning}); ESS {self.ess:.0f}"


def pareto_khat(log_ratios, *, rtol: float | None = None) -> tuple[float, float]:
    """``(k̂, ess)`` of log importance ratios, shape (S,), by ArviZ's PSIS (``az.psislw`` on
    ArviZ 0.x, ``arviz_stats``' on ArviZ ≥ 1, through :mod:`~pyro_bdl.diagnostics.arviz_compat`).

    Two or more ratios that are equal up to rounding (spread below ``rtol`` times their
    magnitude; default 1000 machine epsilons of their dtype) mean the guide *is* the posterior
    where the model has mass: the generalized Pareto fit is undefined there (ArviZ returns +inf
    for exactly equal ratios), so k̂ = −inf (a bounded tail) and the ESS is the number of those
    ratios. A single draw is too few to say anything: k̂ = inf, as for any sample too short for
    the tail fit.

    A ratio of −inf is a draw of zero weight (the model gives it zero density) and is allowed;
    when *every* ratio is −inf there is no importance weight to fit, and :class:`ValueError` says
    so (no k̂ value would be honest: the guide has no mass where the posterior has any).
    """
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float))):
        raise TypeError(
            f"rtol must be a finite number >= 0 (or None for 1000 machine epsilons); got "
            f"{type(rtol).__name__} {rtol!r}. Pass a Python float, or None."
        )
    if rtol is not None and not 0 <= rtol < math.inf:
        raise ValueError(
            f"rtol must be a finite number >= 0 (or None for 1000 machine epsilons); got {rtol!r}. "
            "Pass a number >= 0, or None."
        )
    t = as_tensor("log_ratios", log_ratios)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(
            f"log_ratios must have shape (num_samples,) with at least one draw; got "
            f"{tuple(t.shape)}. Pass one log p(θ, data) - log q(θ) per guide draw θ."
        )
    if not t.is_floating_point():
        raise TypeError(
            f"log_ratios must be floating point; got dtype {t.dtype}. Use log_ratios.double()."
        )
    if torch.isnan(t).any() or torch.isposinf(t).any():
        raise ValueError(
            "log_ratios contain NaN or +inf: the model or guide density is not finite at some "
            "draw. Check the guide's support against the model's."
        )
    if torch.isneginf(t).all():
        raise ValueError(
            f"every one of the {t.numel()} log_ratios is -inf: every draw has zero weight (the "
            "model's density is 0 wherever the guide draws), so k̂ is undefined. Check that the "
            "guide's support lies inside the model's (e.g. a constrained site) and that the "
            "likelihood of the data is finite at the guide's draws."
        )
    if rtol is None:
        rtol = 1000 * torch.finfo(t.dtype).eps
    a = t.detach().double().cpu().numpy()
    finite = a[np.isfinite(a)]  # draws of zero weight (-inf) leave the others' tail as it is
    if finite.size > 1 and np.ptp(finite) <= rtol * max(1.0, float(np.abs(finite).max())):
        return -math.inf, float(finite.size)
    smoothed, khat = arviz_compat.psislw(a)
    w = np.exp(smoothed)
    return float(khat), float(1.0 / np.sum(w**2))


def _sampled(guide_trace) -> list[dict]:
    """The sites a guide draws (its sample sites that are not observed)."""
    return [s for s in guide_trace.nodes.values() if s["type"] == "sample" and not s["is_observed"]]


def _particle_values(guide_trace, max_plate_nesting: int, first: bool) -> list[torch.Tensor]:
    """The values a vectorized guide trace drew, or (``first``) those of its first particle (the
    particle plate is the dim left of the model's ``max_plate_nesting`` plates), which broadcast
    against every particle's."""
    out = []
    for site in _sampled(guide_trace):
        value = site["value"]
        dim = value.dim() - site["fn"].event_dim - max_plate_nesting - 1
        out.append(value.narrow(dim, 0, 1) if first and dim >= 0 else value)
    return out


def _warn_if_subsampled(model_trace) -> None:
    """Warn when an observed site carries a scale: a subsampled plate (``N/B``, a minibatch of
    the data) or ``poutine.scale`` makes ``log p(θ, y)`` an estimate, and k̂ then measures it."""
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or not site["is_observed"]:
            continue
        scale = site["scale"]
        scale = float(scale.max()) if isinstance(scale, torch.Tensor) else float(scale)
        if scale != 1.0:
            warnings.warn(
                f"psis_khat: the model scales observed site {name!r} by {scale:.4g} (a "
                "subsampled plate, pyro.plate(..., subsample_size=B), or poutine.scale), so "
                "p(θ, y) and k̂ are estimates. Pass the full training data, with the model's "
                "dataset_size equal to the rows passed.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            return


def _sequential_log_ratios(model, guide, num_samples, args, kwargs) -> tuple[torch.Tensor, bool]:
    """The log ratios of ``num_samples`` draws, and whether any two draws differ."""
    out = torch.empty(num_samples, dtype=torch.float64)
    first: list[torch.Tensor] = []
    differ = False
    for s in range(num_samples):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
        out[s] = float(model_trace.log_prob_sum() - guide_trace.log_prob_sum())
        values = [site["value"] for site in _sampled(guide_trace)]
        if s == 0:
            _warn_if_subsampled(model_trace)
            first = values
        elif not differ:
            differ = any(not torch.equal(a, b) for a, b in zip(first, values))
    return out, differ


def psis_khat(
    model,
    guide,
    *args,
    num_samples: int = 1000,
    vectorize: bool = False,
    max_plate_nesting: int | None = None,
    batch_size: int = 100_000,
    **kwargs,
) -> PsisResult:
    """Pareto k̂ of the importance ratios log p(θ, y) − log q(θ) over ``num_samples`` guide
    draws, with its interpretation band.

    :param model: the Pyro model, called as ``model(*args, **kwargs)`` with the full data (a
        subsampled likelihood makes p(θ, y) an estimate and k̂ meaningless).
    :param guide: any Pyro guide for ``model``.
    :param int num_samples: number of draws (see the module notes for how many are enough).
    :param bool vectorize: draw ``batch_size`` particles at once with a vectorizing plate
        (Pyro's ``vectorized_importance_weights``); only for models that broadcast over a
        leading particle dim — networks generally do not, so the default draws one at a time.
    :param int max_plate_nesting: needed with ``vectorize=True``.
    :param int batch_size: particles per vectorized pass.
    :raises ValueError: when every draw is the same θ (a point-mass guide has no density).
    """
    check_positive_int("num_samples", num_samples)
    check_positive_int("batch_size", batch_size)
    if vectorize:
        if (
            max_plate_nesting is None
            or isinstance(max_plate_nesting, bool)
            or not isinstance(max_plate_nesting, int)
            or max_plate_nesting < 0
        ):
            raise ValueError(
                f"vectorize=True needs max_plate_nesting, an int >= 0 (the number of nested "
                f"plates in the model); got {max_plate_nesting!r}. Pass it, for example "
                "max_plate_nesting=1 for one data plate, or vectorize=False."
            )
        chunks = []
        first: list[torch.Tensor] | None = None  # the first draw, which every other is compared to
        differ = False
        with torch.no_grad():
            for start in range(0, num_samples, batch_size):
                n = min(batch_size, num_samples - start)
                lw, model_trace, guide_trace = vectorized_importance_weights(
                    model,
                    guide,
                    *args,
                    num_samples=n,
                    max_plate_nesting=max_plate_nesting,
                    normalized=False,
                    **kwargs,
                )
                chunks.append(lw.detach().double().reshape(-1).cpu())
                if first is None:
                    _warn_if_subsampled(model_trace)
                    first = _particle_values(guide_trace, max_plate_nesting, first=True)
                if not differ:
                    values = _particle_values(guide_trace, max_plate_nesting, first=False)
                    differ = any(not bool((a == b).all()) for a, b in zip(first, values))
        log_ratios = torch.cat(chunks)
    else:
        with torch.no_grad():
            log_ratios, differ = _sequential_log_ratios(model, guide, num_samples, args, kwargs)
    if num_samples > 1 and not differ:
        # Equal draws give equal ratios, which pareto_khat reads as a perfect guide (k̂ = -inf).
        raise ValueError(
            f"all {num_samples} guide draws are the same θ: the guide is a point mass (AutoDelta, "
            "a MAP, or AutoSWAG outside its sampling mode), which has no density, so importance "
            "ratios and k̂ say nothing about it. Diagnose a guide with a spread; for AutoSWAG "
            "call psis_khat inside `with guide.sampling():`."
        )
    khat, ess = pareto_khat(log_ratios)
    band, meaning = khat_band(khat)
    return PsisResult(khat, band, meaning, log_ratios, ess)


def loo(data, *, var_name: str | None = None, pointwise: bool = True):
    """PSIS leave-one-out cross-validation through ArviZ on exported data (the
    ``log_likelihood`` group of :func:`~pyro_bdl.diagnostics.to_inference_data`).

    :returns: the installed ArviZ's ``ELPDData``, for its own functions (``plot_khat``,
        ``compare``); its fields are named differently on ArviZ 0.x (``elpd_loo``, ``p_loo``,
        ``loo_i``) and ≥ 1 (``elpd``, ``p``, ``elpd_i``), so read them with
        :func:`~pyro_bdl.diagnostics.arviz_compat.loo_summary`.
    """
    if not arviz_compat.is_data(data):
        raise TypeError(
            f"data must be arviz.InferenceData or xarray.DataTree; got {type(data).__name__}. "
            "Create it with to_inference_data(model, guide, x, y)."
        )
    if "log_likelihood" not in arviz_compat.group_names(data):
        raise ValueError(
            "data has no log_likelihood group; export with observed data, e.g. "
            "to_inference_data(model, guide, x, y)."
        )
    draws = arviz_compat.num_draws(arviz_compat.group(data, "log_likelihood"))
    if draws < 2:
        raise ValueError(
            f"data holds {draws} draw(s); leave-one-out needs at least 2 (PSIS fits the tail of "
            "many). Export more, e.g. to_inference_data(model, guide, x, y, num_samples=200)."
        )
    return arviz_compat.loo(data, var_name=var_name, pointwise=pointwise)
