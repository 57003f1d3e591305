r"""Noise families and the plumbing shared by the KL estimators of :mod:`pyro_bdl.infer.kl`.

A location-scale posterior draws :math:`w = \mu + \sigma\odot\xi`; a :class:`NoiseFamily` says how
the standardised noise :math:`\xi` is drawn and scored (Gaussian for mean-field, uniform direction
times a Gaussian radius for Radial), and :class:`KLTerms` holds the two M-sample halves of a KL
estimate.

Usage::

    family = noise_family("radial")
    xi = family.sample(1000, (300, 100), 2, torch.float32, "cpu")

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
from torch.distributions import Chi2, Distribution, Normal

from pyro_bdl._validation import check_positive_int
from pyro_bdl.distributions.radial import Radial, radial_log_density, radial_noise

__all__ = [
    "GAUSSIAN_NOISE",
    "NOISE_FAMILIES",
    "RADIAL_NOISE",
    "KLTerms",
    "NoiseFamily",
    "noise_family",
    "sample_gaussian_statistics",
]

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
# Shared plumbing


def _prepare(loc, scale, event_dim, xi, num_samples):
    loc, scale = torch.broadcast_tensors(loc, scale)
    event_dim = loc.dim() if event_dim is None else event_dim
    if not 0 <= event_dim <= loc.dim():
        raise ValueError(
            f"event_dim must lie in [0, loc.dim()] = [0, {loc.dim()}]; got {event_dim}."
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
