r"""Monte Carlo KL estimators whose autograd graph does not grow with the number of samples.

For a location-scale posterior :math:`w_j = \mu + \sigma\odot\xi_j` and M noise draws
:math:`\xi_j`, the M-sample estimate

.. math:: \widehat{KL}_M = \frac1M\sum_j \log q(w_j) - \frac1M\sum_j \log p(w_j)

is computed here without building the M × D graph of the direct estimator
(docs/design/variational.md):

- **entropy side**: :math:`\sum_j \log q(w_j) = \sum_j \log p_\xi(\xi_j) - M\sum_i\log\sigma_i`;
  the first sum needs no gradient;
- **sufficient statistics** (:func:`kl_sufficient_statistics`): for a Normal prior the sum over
  samples factors through :math:`T_1 = \sum_j\xi_j` and :math:`T_2 = \sum_j\xi_j^2` (no
  gradient); for Gaussian noise :math:`T_1 = \sqrt M z` and :math:`T_2 = T_1^2/M + \chi^2_{M-1}`
  are drawn directly (:func:`sample_gaussian_statistics`), so M = 10⁶ costs what one sample does;
- **streaming** (:func:`kl_streaming`): any element-wise log-prior, evaluated in chunks of samples
  by a custom :class:`torch.autograd.Function` that keeps only
  :math:`G_\mu = \sum_j f'(w_j)` and :math:`G_\sigma = \sum_j \xi_j f'(w_j)` for backward;
- **direct** (:func:`kl_direct`): the naive graph, the reference for tests and benchmarks.

Every estimator returns :class:`KLTerms`, the two M-sample means summed over the event dims. The
registry :data:`KL_ESTIMATORS` is keyed by (posterior noise family, prior family); add your own
with :func:`register_kl_estimator`.

Usage::

    loc = torch.zeros(300, 100, requires_grad=True)
    scale = torch.full((300, 100), 0.1, requires_grad=True)
    terms = kl_sufficient_statistics(loc, scale, dist.Normal(0.0, 1.0), num_samples=1000)
    terms.kl.backward()

References:
    Nazarovs, Mehta, Lokhande & Singh, "Graph Reparameterizations for Enabling 1000+ Monte Carlo
    Iterations in Bayesian Deep Neural Networks" (UAI 2021).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributions import Distribution, Laplace, Normal

from pyro_bdl.distributions.scale_mixture import ScaleMixtureNormal
from pyro_bdl.infer.kl_noise import (
    _HALF_LOG_2PI,
    GAUSSIAN_NOISE,
    NOISE_FAMILIES,
    RADIAL_NOISE,
    KLTerms,
    NoiseFamily,
    _chunks,
    _log_q,
    _prepare,
    _sum_event,
    noise_family,
    sample_gaussian_statistics,
)
from pyro_bdl.infer.kl_streaming import (
    ChunkSums,
    LogProbAndScore,
    autograd_score,
    kl_streaming,
    laplace_chunk_sums,
    scale_mixture_chunk_sums,
)

__all__ = [
    "GAUSSIAN_NOISE",
    "KL_ESTIMATORS",
    "NOISE_FAMILIES",
    "RADIAL_NOISE",
    "ChunkSums",
    "Estimator",
    "KLTerms",
    "LogProbAndScore",
    "NoiseFamily",
    "autograd_score",
    "find_kl_estimator",
    "kl_direct",
    "kl_streaming",
    "kl_sufficient_statistics",
    "laplace_chunk_sums",
    "noise_family",
    "register_kl_estimator",
    "sample_gaussian_statistics",
    "scale_mixture_chunk_sums",
]


def kl_sufficient_statistics(
    loc: torch.Tensor,
    scale: torch.Tensor,
    prior: Distribution,
    *,
    noise: str | NoiseFamily = "normal",
    num_samples: int = 1000,
    event_dim: int | None = None,
    xi: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> KLTerms:
    r"""M-sample KL against an element-wise Normal prior through :math:`T_1, T_2`.

    .. math:: \sum_j\log p(w_j) = \sum_i\Big[-\tfrac M2\log(2\pi s_i^2)
              - \frac{M(\mu_i-m_i)^2 + 2(\mu_i-m_i)\sigma_i T_{1i} + \sigma_i^2T_{2i}}{2s_i^2}\Big]

    The graph holds μ, σ and a few element-wise nodes whatever M is. Without ``xi``, Gaussian noise
    draws the statistics directly; other noise is generated in chunks under ``no_grad``.

    Usage::

        terms = kl_sufficient_statistics(loc, scale, dist.Normal(0.0, 1.0), num_samples=1000)

    :param torch.Tensor loc: μ (the site's shape).
    :param torch.Tensor scale: σ > 0, broadcastable to ``loc``.
    :param prior: an element-wise ``Normal`` broadcastable to ``loc`` (its loc/scale may require
        grad).
    :param noise: ``"normal"``, ``"radial"`` or a :class:`NoiseFamily`.
    :param int num_samples: M (ignored when ``xi`` is given).
    :param int event_dim: trailing dims summed into one KL (default: all of ``loc``'s).
    :param torch.Tensor xi: optional explicit noise of shape ``(M, *loc.shape)``.
    :param int chunk_size: samples per chunk when noise is generated (default: ≈ 4M numbers).
    :returns: :class:`KLTerms` with the batch shape ``loc.shape[:loc.dim() - event_dim]``.
    """
    if not isinstance(prior, Normal):
        raise NotImplementedError(
            f"sufficient statistics need a Normal prior; got {type(prior).__name__}."
        )
    family = noise_family(noise)
    loc, scale, event_dim, m = _prepare(loc, scale, event_dim, xi, num_samples)
    with torch.no_grad():
        if xi is None and family.sample_statistics is not None:
            t1, t2, noise_sum = family.sample_statistics(
                m, loc.shape, event_dim, loc.dtype, loc.device
            )
        else:
            t1 = loc.new_zeros(loc.shape)
            t2 = loc.new_zeros(loc.shape)
            noise_sum = loc.new_zeros(loc.shape[: loc.dim() - event_dim])
            for chunk in _chunks(family, xi, m, loc.shape, event_dim, loc, chunk_size):
                t1 += chunk.sum(0)
                t2 += (chunk * chunk).sum(0)
                noise_sum += family.log_density_sum(chunk, event_dim)
    diff = loc - prior.loc
    var = prior.scale * prior.scale
    quad = m * diff.square() + (2 * t1) * (diff * scale) + t2 * scale.square()
    # Per element and per sample: −½ log 2π − log s − (…)/(2s²M).
    log_p = -(_HALF_LOG_2PI + prior.scale.log()) - quad / (2 * m * var)
    return KLTerms(_log_q(noise_sum, scale, event_dim, m), _sum_event(log_p, loc.shape, event_dim))


def kl_direct(
    loc: torch.Tensor,
    scale: torch.Tensor,
    prior: Distribution,
    *,
    noise: str | NoiseFamily = "normal",
    num_samples: int = 1000,
    event_dim: int | None = None,
    xi: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> KLTerms:
    r"""The naive M-sample estimate with the posterior's and the prior's own ``log_prob``.

    Builds the whole M × D graph (memory linear in M): the reference for tests and benchmarks.

    Usage::

        terms = kl_direct(loc, scale, dist.Normal(0.0, 1.0), xi=torch.randn(10, *loc.shape))
    """
    family = noise_family(noise)
    loc, scale, event_dim, m = _prepare(loc, scale, event_dim, xi, num_samples)
    if xi is None:
        with torch.no_grad():
            xi = family.sample(m, loc.shape, event_dim, loc.dtype, loc.device)
    w = loc + scale * xi
    q = family.distribution(loc, scale, event_dim)
    log_p = _sum_event(prior.log_prob(w), w.shape, event_dim)
    return KLTerms(q.log_prob(w).mean(0), log_p.mean(0))


# ---------------------------------------------------------------------------------------------
# The registry

#: ``estimator(loc, scale, prior, *, noise, num_samples, event_dim, xi, chunk_size) -> KLTerms``;
#: raise ``NotImplementedError`` to decline a pair.
Estimator = Callable[..., KLTerms]

#: (noise family name, element-wise prior type) -> estimator; looked up along the prior's MRO.
KL_ESTIMATORS: dict[tuple[str, type], Estimator] = {}


def register_kl_estimator(noise: str, prior_type: type) -> Callable[[Estimator], Estimator]:
    """Decorator registering an estimator for (posterior noise family, element-wise prior type).

    Usage::

        @register_kl_estimator("normal", dist.StudentT)
        def my_estimator(loc, scale, prior, **kwargs):
            return kl_streaming(loc, scale, prior, log_prob_and_score=..., **kwargs)
    """
    if not isinstance(noise, str) or not isinstance(prior_type, type):
        raise TypeError(
            f"register_kl_estimator expects (noise name: str, prior type); got "
            f"({noise!r}, {prior_type!r})."
        )

    def decorator(fn: Estimator) -> Estimator:
        KL_ESTIMATORS[(noise, prior_type)] = fn
        return fn

    return decorator


def find_kl_estimator(noise: str, prior_type: type) -> Estimator | None:
    """The estimator registered for ``noise`` and the closest ancestor of ``prior_type``."""
    for cls in prior_type.__mro__:
        fn = KL_ESTIMATORS.get((noise, cls))
        if fn is not None:
            return fn
    return None


def suffstat_normal(loc, scale, prior, **kwargs) -> KLTerms:
    """Registered: sufficient statistics against a Normal prior."""
    return kl_sufficient_statistics(loc, scale, prior, **kwargs)


def streaming_laplace(loc, scale, prior, **kwargs) -> KLTerms:
    """Registered: streaming with the closed-form Laplace score."""
    return kl_streaming(loc, scale, prior, chunk_sums=laplace_chunk_sums(prior), **kwargs)


def streaming_scale_mixture(loc, scale, prior, **kwargs) -> KLTerms:
    """Registered: streaming with the closed-form scale-mixture score."""
    return kl_streaming(loc, scale, prior, chunk_sums=scale_mixture_chunk_sums(prior), **kwargs)


def streaming_elementwise(loc, scale, prior, **kwargs) -> KLTerms:
    """Registered for any element-wise prior: streaming with an autograd score."""
    return kl_streaming(loc, scale, prior, **kwargs)


for _noise in ("normal", "radial"):
    register_kl_estimator(_noise, Normal)(suffstat_normal)
    register_kl_estimator(_noise, Laplace)(streaming_laplace)
    register_kl_estimator(_noise, ScaleMixtureNormal)(streaming_scale_mixture)
    register_kl_estimator(_noise, Distribution)(streaming_elementwise)
