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

A :class:`NoiseFamily` says how the standardised noise :math:`\xi` is drawn and scored (Gaussian
for mean-field, uniform direction times a Gaussian radius for Radial). Every estimator returns
:class:`KLTerms`, the two M-sample means summed over the event dims. The registry
:data:`KL_ESTIMATORS` is keyed by (posterior noise family, prior family); add your own with
:func:`register_kl_estimator`.

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import pyro.distributions as dist
import torch
from pyro.distributions.util import sum_rightmost
from torch.distributions import Chi2, Distribution, Laplace, Normal

from pyro_bdl._grad_mode import differentiates
from pyro_bdl._validation import check_positive_int
from pyro_bdl.curvature.jacobian import exact
from pyro_bdl.distributions.radial import Radial, radial_log_density, radial_noise
from pyro_bdl.distributions.scale_mixture import ScaleMixtureNormal

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


# ---------------------------------------------------------------------------------------------
# Noise families and the two halves of an estimate

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
#: Default number of noise numbers generated per chunk (≈ 32 MB in float64).
_CHUNK_NUMEL = 1 << 22


class KLTerms(NamedTuple):
    r"""The two halves of the M-sample KL estimate, each summed over the event dims.

    :ivar log_q: :math:`\frac1M\sum_j\log q(w_j)` (minus the entropy), shape = batch shape.
    :ivar log_p: :math:`\frac1M\sum_j\log p(w_j)` (minus the cross-entropy), same shape.
    """

    log_q: torch.Tensor
    log_p: torch.Tensor

    @property
    def kl(self) -> torch.Tensor:
        return self.log_q - self.log_p


@dataclass(frozen=True)
class NoiseFamily:
    r"""How the posterior's standardised noise :math:`\xi = (w-\mu)/\sigma` is drawn and scored.

    :ivar str name: the registry key (``"normal"``, ``"radial"``).
    :ivar sample: ``(num, shape, event_dim, dtype, device) -> xi`` of shape ``(num, *shape)``.
    :ivar log_density: ``(xi, event_dim) -> log p_ξ(xi)`` summed over the event dims.
    :ivar distribution: ``(loc, scale, event_dim) -> q``, the posterior (for :func:`kl_direct`).
    :ivar sample_statistics: optional ``(num, shape, event_dim, dtype, device) -> (T1, T2, S)``
        drawing :math:`T_1, T_2` and :math:`S=\sum_j\log p_\xi(\xi_j)` directly, exactly in
        distribution; ``None`` when the noise has no such shortcut.
    """

    name: str
    sample: Callable[..., torch.Tensor]
    log_density: Callable[[torch.Tensor, int], torch.Tensor]
    distribution: Callable[[torch.Tensor, torch.Tensor, int], Distribution]
    sample_statistics: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    log_density_sum_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def log_density_sum(self, xi: torch.Tensor, event_dim: int) -> torch.Tensor:
        r""":math:`\sum_j \log p_\xi(\xi_j)` over the leading (sample) dim of ``xi``."""
        if self.log_density_sum_fn is not None:
            return self.log_density_sum_fn(xi, event_dim)
        return self.log_density(xi, event_dim).sum(0)


def _gaussian_sample(num, shape, event_dim, dtype, device):
    return torch.randn((num, *shape), dtype=dtype, device=device)


def _gaussian_log_density(xi, event_dim):
    return sum_rightmost(-0.5 * xi * xi - _HALF_LOG_2PI, event_dim)


def _gaussian_log_density_sum(xi, event_dim):
    # Σⱼ log φ(ξⱼ) needs only Σⱼ ξⱼ²: one pass instead of a full-size log-density (a dot
    # product when there are no batch dims).
    numel = math.prod(xi.shape[xi.dim() - event_dim :])
    if event_dim == xi.dim() - 1 and xi.is_contiguous():
        flat = xi.reshape(-1)
        sq = torch.dot(flat, flat)
    else:
        sq = sum_rightmost((xi * xi).sum(0), event_dim)
    return -0.5 * sq - xi.shape[0] * numel * _HALF_LOG_2PI


def sample_gaussian_statistics(
    num_samples: int,
    shape: torch.Size | tuple[int, ...],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Draw :math:`T_1=\sum_j\xi_j` and :math:`T_2=\sum_j\xi_j^2` of M standard Normal draws
    directly: :math:`T_1=\sqrt M z` and :math:`T_2 = T_1^2/M + \chi^2_{M-1}`, independent.

    Exact in distribution (Cochran: the sample mean and the sum of squared deviations of Gaussian
    draws are independent, the latter :math:`\chi^2_{M-1}`), at the cost of one draw whatever M.

    Usage::

        t1, t2 = sample_gaussian_statistics(10**6, (300, 100))

    :returns: ``(T1, T2)``, each of ``shape``; no gradient.
    """
    num_samples = check_positive_int("num_samples", num_samples)
    with torch.no_grad():
        z = torch.randn(tuple(shape), dtype=dtype, device=device)
        t1 = math.sqrt(num_samples) * z
        t2 = z * z  # = T1² / M
        if num_samples > 1:
            df = torch.tensor(float(num_samples - 1), dtype=z.dtype, device=z.device)
            t2 = t2 + Chi2(df).sample(z.shape)
    return t1, t2


def _gaussian_statistics(num, shape, event_dim, dtype, device):
    t1, t2 = sample_gaussian_statistics(num, shape, dtype=dtype, device=device)
    s = sum_rightmost(-0.5 * t2 - num * _HALF_LOG_2PI, event_dim)
    return t1, t2, s


def _radial_sample(num, shape, event_dim, dtype, device):
    # One direction per draw over the event dims; leading (batch) dims draw independently.
    split = len(shape) - event_dim
    return radial_noise(shape[split:], (num, *shape[:split]), dtype=dtype, device=device)


GAUSSIAN_NOISE = NoiseFamily(
    name="normal",
    sample=_gaussian_sample,
    log_density=_gaussian_log_density,
    distribution=lambda loc, scale, event_dim: dist.Normal(loc, scale).to_event(event_dim),
    sample_statistics=_gaussian_statistics,
    log_density_sum_fn=_gaussian_log_density_sum,
)
RADIAL_NOISE = NoiseFamily(
    name="radial",
    sample=_radial_sample,
    log_density=lambda xi, event_dim: radial_log_density(xi, event_dim=event_dim),
    distribution=lambda loc, scale, event_dim: Radial(loc, scale, event_dim=event_dim),
)

#: Posterior distribution type -> its noise family (looked up along the type's MRO).
NOISE_FAMILIES: dict[type, NoiseFamily] = {Normal: GAUSSIAN_NOISE, Radial: RADIAL_NOISE}


def noise_family(noise: str | NoiseFamily) -> NoiseFamily:
    """The :class:`NoiseFamily` named ``noise`` (``"normal"`` or ``"radial"``), or ``noise``."""
    if isinstance(noise, NoiseFamily):
        return noise
    for family in NOISE_FAMILIES.values():
        if family.name == noise:
            return family
    names = sorted({f.name for f in NOISE_FAMILIES.values()})
    raise ValueError(f"unknown noise family {noise!r}; expected one of {', '.join(names)}.")


# ---------------------------------------------------------------------------------------------
# Plumbing shared by the estimators


def _prepare(loc, scale, event_dim, xi, num_samples):
    loc, scale = torch.broadcast_tensors(loc, scale)
    event_dim = loc.dim() if event_dim is None else event_dim
    if not 0 <= event_dim <= loc.dim():
        raise ValueError(
            f"event_dim must lie in [0, loc.dim()] = [0, {loc.dim()}]; got {event_dim}. Pass the "
            "number of trailing dims of loc that form one KL, or None for all of them."
        )
    if xi is not None:
        if xi.shape[1:] != loc.shape:
            raise ValueError(
                f"xi must have shape (M, *{tuple(loc.shape)}); got {tuple(xi.shape)}. Stack M "
                "noise draws of the site's shape along a new first dim."
            )
        num_samples = xi.shape[0]
    num_samples = check_positive_int("num_samples", num_samples)
    return loc, scale, event_dim, num_samples


def _chunks(noise, xi, num_samples, shape, event_dim, like, chunk_size):
    """Yield noise chunks of shape (n, *shape): slices of ``xi`` or fresh draws."""
    numel = max(1, math.prod(shape))
    chunk = chunk_size or max(1, _CHUNK_NUMEL // numel)
    for start in range(0, num_samples, chunk):
        n = min(chunk, num_samples - start)
        if xi is not None:
            yield xi[start : start + n].to(like)
        else:
            yield noise.sample(n, shape, event_dim, like.dtype, like.device)


def _sum_event(x: torch.Tensor, shape: torch.Size, event_dim: int) -> torch.Tensor:
    """Broadcast ``x`` to the site's ``shape`` (priors may have scalar parameters), sum events."""
    return sum_rightmost(x.expand(shape) if x.shape != shape else x, event_dim)


def _log_q(noise_sum, scale, event_dim, num_samples):
    # (1/M) Σⱼ log q(wⱼ) = (1/M) Σⱼ log p_ξ(ξⱼ) − Σᵢ log σᵢ: the gradient is −1/σ only, because
    # ξ = (w − μ)/σ does not depend on (μ, σ) along the reparameterised path.
    return noise_sum / num_samples - sum_rightmost(scale.log(), event_dim)


# ---------------------------------------------------------------------------------------------
# Sufficient statistics and the direct reference


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
            f"sufficient statistics need a Normal prior; got {type(prior).__name__}. Use "
            "kl_streaming (an element-wise prior) or kl_direct (any prior) instead."
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
# Streaming over chunks of samples (any element-wise prior)

LogProbAndScore = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: ``(xi, loc, scale) -> (Σⱼ f(wⱼ), Σⱼ f′(wⱼ), Σⱼ ξⱼ f′(wⱼ))`` with wⱼ = loc + scale ξⱼ, summed
#: over the leading (sample) dim of a chunk of noise.
ChunkSums = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


def autograd_score(prior: Distribution) -> LogProbAndScore:
    r"""``w -> (log p(w), ∂ log p / ∂w)`` for any element-wise prior, by autograd per chunk."""

    @differentiates  # also under no_grad/inference_mode, from a normal copy of an inference w
    def fn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.detach().requires_grad_(True)
        lp = prior.log_prob(w)
        (score,) = torch.autograd.grad(lp.sum(), w)
        return lp.detach(), score

    return fn


def _sums_from_score(log_prob_and_score: LogProbAndScore) -> ChunkSums:
    def sums(xi, loc, scale):
        lp, score = log_prob_and_score(torch.addcmul(loc, scale, xi))
        return lp.sum(0), score.sum(0), torch.linalg.vecdot(xi, score, dim=0)

    return sums


def laplace_chunk_sums(prior: Laplace) -> ChunkSums:
    r"""Closed-form chunk sums of a Laplace prior, :math:`f = -\log 2b - |w-m|/b`,
    :math:`f' = -\operatorname{sign}(w-m)/b`. The chunk is memory-bound, so it is read few times:
    with :math:`s_j = \operatorname{sign}(w_j - m)`,
    :math:`\sum_j|w_j-m| = (\mu-m)\sum_j s_j + \sigma\sum_j\xi_j s_j` reuses the two score sums."""

    def sums(xi, loc, scale):
        offset = loc - prior.loc
        sign = torch.addcmul(offset, scale, xi).sign_()
        s_sum = sign.sum(0)
        xs_sum = torch.linalg.vecdot(xi, sign, dim=0)
        abs_sum = offset * s_sum + scale * xs_sum
        total = -xi.shape[0] * torch.log(2 * prior.scale) - abs_sum / prior.scale
        return total, -s_sum / prior.scale, -xs_sum / prior.scale

    return sums


def scale_mixture_chunk_sums(prior: ScaleMixtureNormal) -> ChunkSums:
    r"""Closed-form chunk sums of the two-component scale mixture: with
    :math:`a, b` the two components' log-weights-plus-densities,
    :math:`f = b + \operatorname{softplus}(a - b)` and
    :math:`f' = -w\,(1/s_2^2 + \sigma(a-b)(1/s_1^2 - 1/s_2^2))`."""

    def sums(xi, loc, scale):
        w = torch.addcmul(loc, scale, xi)
        p1, p2 = 1 / (prior.scale1 * prior.scale1), 1 / (prior.scale2 * prior.scale2)
        c1 = prior.pi.log() - prior.scale1.log()
        c2 = torch.log1p(-prior.pi) - prior.scale2.log()
        half_sq = 0.5 * w * w
        diff = half_sq * (p2 - p1) + (c1 - c2)  # a − b
        n = xi.shape[0]
        total = (
            n * (c2 - _HALF_LOG_2PI)
            - (half_sq.sum(0) * p2)
            + torch.nn.functional.softplus(diff).sum(0)
        )
        score = diff.sigmoid_().mul_(p1 - p2).add_(p2).mul_(w).neg_()
        return total, score.sum(0), torch.linalg.vecdot(xi, score, dim=0)

    return sums


class _StreamingLogPrior(torch.autograd.Function):
    """Σⱼ Σᵢ f(μᵢ + σᵢ ξⱼᵢ) evaluated in chunks; backward from G_μ = Σⱼ f′(wⱼ), G_σ = Σⱼ ξⱼ f′(wⱼ).

    The second output, Σⱼ log p_ξ(ξⱼ), reuses the same noise and has no gradient.
    """

    @staticmethod
    def forward(ctx, loc, scale, chunks, chunk_sums, noise_sum_fn, event_dim):
        total = torch.zeros_like(loc)
        g_loc = torch.zeros_like(loc)
        g_scale = torch.zeros_like(loc)
        noise_sum = loc.new_zeros(loc.shape[: loc.dim() - event_dim])
        # The chunk sums run over M samples: under autocast their dot products (vecdot) would
        # round each sum to 16 bits, so they run in the guide's float32 whatever the context.
        with exact(loc.device):
            for xi in chunks:
                f, g_mu, g_sigma = chunk_sums(xi, loc, scale)
                total += f
                g_loc += g_mu
                g_scale += g_sigma
                noise_sum += noise_sum_fn(xi, event_dim)
        ctx.event_dim = event_dim
        ctx.save_for_backward(g_loc, g_scale)
        ctx.mark_non_differentiable(noise_sum)
        return sum_rightmost(total, event_dim), noise_sum

    @staticmethod
    def backward(ctx, grad_total, grad_noise):
        g_loc, g_scale = ctx.saved_tensors
        grad = grad_total.reshape(grad_total.shape + (1,) * ctx.event_dim)
        return grad * g_loc, grad * g_scale, None, None, None, None


def kl_streaming(
    loc: torch.Tensor,
    scale: torch.Tensor,
    prior: Distribution,
    *,
    noise: str | NoiseFamily = "normal",
    num_samples: int = 1000,
    event_dim: int | None = None,
    xi: torch.Tensor | None = None,
    chunk_size: int | None = None,
    log_prob_and_score: LogProbAndScore | None = None,
    chunk_sums: ChunkSums | None = None,
) -> KLTerms:
    r"""M-sample KL against any element-wise prior, streaming over chunks of samples.

    Memory O(D) for any M: the backward keeps :math:`G_\mu` and :math:`G_\sigma` only, and the
    value equals :func:`kl_direct` given the same noise. The prior's own parameters are treated as
    constants (no gradient flows to them).

    Usage::

        terms = kl_streaming(loc, scale, dist.Laplace(0.0, 1.0), noise="radial", num_samples=1000)

    :param log_prob_and_score: ``w -> (log p(w), ∂log p/∂w)`` element-wise (default: autograd
        on ``prior.log_prob`` per chunk).
    :param chunk_sums: instead, ``(xi, loc, scale) -> (Σⱼ f(wⱼ), Σⱼ f′(wⱼ), Σⱼ ξⱼ f′(wⱼ))``
        over a chunk's leading dim; faster when written in closed form.
        Other parameters as in :func:`kl_sufficient_statistics`.
    """
    if prior.event_shape != torch.Size():
        raise NotImplementedError(
            f"the streaming estimator needs an element-wise prior; {type(prior).__name__} has "
            f"event shape {tuple(prior.event_shape)}. Use kl_direct for this prior."
        )
    if torch.is_grad_enabled():
        for key in prior.arg_constraints:
            value = getattr(prior, key, None)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise NotImplementedError(
                    f"the streaming estimator treats the prior as fixed, but its parameter "
                    f"{key!r} requires grad; use kl='direct' (memory linear in M) or a Normal "
                    "prior (sufficient statistics carry prior gradients)."
                )
    family = noise_family(noise)
    loc, scale, event_dim, m = _prepare(loc, scale, event_dim, xi, num_samples)
    if chunk_sums is None:
        chunk_sums = _sums_from_score(log_prob_and_score or autograd_score(prior))
    chunks = _chunks(family, xi, m, loc.shape, event_dim, loc, chunk_size)
    total, noise_sum = _StreamingLogPrior.apply(
        loc, scale, chunks, chunk_sums, family.log_density_sum, event_dim
    )
    return KLTerms(_log_q(noise_sum, scale, event_dim, m), total / m)


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
            f"({noise!r}, {prior_type!r}). Write for example "
            "@register_kl_estimator('normal', dist.StudentT)."
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
