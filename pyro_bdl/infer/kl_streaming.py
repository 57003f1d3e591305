r"""The streaming M-sample KL estimator: any element-wise prior, memory O(D) whatever M.

A custom :class:`torch.autograd.Function` evaluates :math:`\sum_j \log p(\mu + \sigma\xi_j)` over
chunks of noise and keeps only :math:`G_\mu = \sum_j f'(w_j)` and
:math:`G_\sigma = \sum_j \xi_j f'(w_j)` for backward (docs/design/variational.md). Closed-form
chunk sums for the Laplace and scale-mixture priors avoid autograd inside the loop.

Usage::

    terms = kl_streaming(loc, scale, dist.Laplace(0.0, 1.0), noise="radial", num_samples=1000)
    terms.kl.backward()

References:
    Nazarovs, Mehta, Lokhande & Singh, "Graph Reparameterizations for Enabling 1000+ Monte Carlo
    Iterations in Bayesian Deep Neural Networks" (UAI 2021).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pyro.distributions.util import sum_rightmost
from torch.distributions import Distribution, Laplace

from pyro_bdl.distributions.scale_mixture import ScaleMixtureNormal
from pyro_bdl.infer.kl_noise import (
    _HALF_LOG_2PI,
    KLTerms,
    NoiseFamily,
    _chunks,
    _log_q,
    _prepare,
    noise_family,
)

__all__ = [
    "ChunkSums",
    "LogProbAndScore",
    "autograd_score",
    "kl_streaming",
    "laplace_chunk_sums",
    "scale_mixture_chunk_sums",
]

LogProbAndScore = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: ``(xi, loc, scale) -> (Σⱼ f(wⱼ), Σⱼ f′(wⱼ), Σⱼ ξⱼ f′(wⱼ))`` with wⱼ = loc + scale ξⱼ, summed
#: over the leading (sample) dim of a chunk of noise.
ChunkSums = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


def autograd_score(prior: Distribution) -> LogProbAndScore:
    r"""``w -> (log p(w), ∂ log p / ∂w)`` for any element-wise prior, by autograd per chunk."""

    def fn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
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
            f"event shape {tuple(prior.event_shape)}."
        )
    if torch.is_grad_enabled():
        for key in prior.arg_constraints:
            value = getattr(prior, key, None)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise NotImplementedError(
                    f"the streaming estimator treats the prior as fixed, but its parameter "
                    f"{key!r} requires grad; use kl='direct' (memory linear in M) or a Normal "
                    "prior (sufficient statistics carry prior gradients)"
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
