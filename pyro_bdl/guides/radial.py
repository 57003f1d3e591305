r"""Radial guide: one :class:`~pyro_bdl.distributions.Radial` per weight site, on the site."""

from __future__ import annotations

import math

import torch
from pyro.distributions.util import sum_rightmost
from torch.distributions import Distribution, Independent, Normal, register_kl

from pyro_bdl.distributions.radial import Radial, radial_entropy_constant, radial_marginal_icdf
from pyro_bdl.guides.base import AutoLocScaleGuide

__all__ = ["AutoRadial"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _norms(parts, dtype) -> torch.Tensor:
    """Norms of the sites' noise in one fused pass (no squared temporary), kept above zero (an
    all-zero draw has probability zero, but a one-weight site in low precision could meet it)."""
    norms = torch.stack(torch._foreach_norm(parts))
    return norms.clamp_min_(torch.finfo(dtype).tiny)


class _SiteRadial(Radial):
    """The guide's :class:`Radial` on one site, optionally carrying a draw made beforehand (its
    first ``rsample()`` returns it; see :class:`~pyro_bdl.guides.meanfield._SiteNormal`)."""

    def __init__(self, loc, scale, value=None, *, event_dim):
        # loc and scale are same-shape views of the guide's flat parameters: skip Radial's
        # broadcast and argument checks (a per-site cost paid on every step).
        self.loc, self.scale = loc, scale
        self._value = value
        split = loc.dim() - event_dim
        Distribution.__init__(self, loc.shape[:split], loc.shape[split:], validate_args=False)

    def rsample(self, sample_shape=torch.Size()):
        value, self._value = self._value, None
        if value is not None and not sample_shape:
            return value
        return super().rsample(sample_shape)

    def expand(self, batch_shape, _instance=None):
        plain = Radial(self.loc, self.scale, event_dim=len(self.event_shape), validate_args=False)
        return plain.expand(batch_shape)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A parameter expanded from a scalar (all strides 0) as a one-element view."""
    if t.dim() and not any(t.stride()):
        return t.as_strided((1,) * t.dim(), (0,) * t.dim())
    return t


def _prior_terms(p: Normal, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, 1/(2s²), ½ log 2π + log s − H_D/D) of a Normal prior, compacted, for a site of D =
    ``numel`` weights (the Radial's entropy constant H_D spread over the weights, so the KL needs
    no separate subtraction). Kept on a prior whose parameters are constants (the same object on
    every step); recomputed for a learned one."""
    cached = p.__dict__.get("_bdl_radial_kl_terms")
    if cached is not None and cached[0] is p.loc and cached[1] is p.scale and cached[2] == numel:
        return cached[3]
    m, s = _compact(p.loc), _compact(p.scale)
    log_norm = s.log() + (_HALF_LOG_2PI - radial_entropy_constant(numel) / numel)
    terms = (m, (2 * s.square()).reciprocal(), log_norm)
    if not (p.loc.requires_grad or p.scale.requires_grad):
        p.__dict__["_bdl_radial_kl_terms"] = (p.loc, p.scale, numel, terms)
    return terms


@register_kl(_SiteRadial, Independent)
def _kl_site_radial_independent(q: _SiteRadial, p: Independent) -> torch.Tensor:
    r"""KL(Radial(μ, σ) ‖ ∏ N(m, s²)) = Σᵢ [−log σᵢ + ((μᵢ−mᵢ)² + σᵢ²/D)/(2sᵢ²)
    + ½ log(2π sᵢ²)] − H_D (docs/design/variational.md), as the library's
    ``kl_divergence(Radial, Normal)`` but with the prior's terms computed once (the guide's step
    pays this per site)."""
    base, dims = p.base_dist, p.reinterpreted_batch_ndims
    while isinstance(base, Independent):
        dims += base.reinterpreted_batch_ndims
        base = base.base_dist
    event_dim = len(q.event_shape)
    if not isinstance(base, Normal) or dims != event_dim:
        raise NotImplementedError
    numel = q.event_shape.numel()  # a number also under torch.jit.trace (JIT ELBOs)
    m, half_precision, log_norm = _prior_terms(base, numel)
    diff = q.loc - m
    spread = torch.addcmul(diff.square(), q.scale, q.scale, value=1.0 / numel)
    terms = torch.addcmul(log_norm - q.scale.log(), spread, half_precision)
    return sum_rightmost(terms, event_dim)


class AutoRadial(AutoLocScaleGuide):
    r"""Radial posterior per site: :math:`w = \mu + \sigma\odot r\,\varepsilon/\lVert\varepsilon
    \rVert` with one direction per weight tensor per sample (docs/design/variational.md).

    The ``Radial`` is the distribution of the weight site itself, so
    :class:`~pyro.infer.TraceMeanField_ELBO` uses the exact ``kl_divergence(Radial, Normal)``.
    Sites inside plates get one direction per plate element.

    Usage::

        guide = bdl.guides.AutoRadial(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())

    :param callable model: the Pyro model.
    :param float init_scale: initial σ of every weight (> 0); the default 0.018 is the paper's
        ρ = −4.
    :param callable init_loc_fn: initial locations (default: the network's own weights).
    :param callable create_plates: optional, as in :class:`~pyro.infer.autoguide.AutoGuide`.

    References:
        Farquhar, Osborne & Gal, "Radial Bayesian Neural Networks: Beyond Discrete Support in
        Large-Scale Bayesian Deep Learning" (AISTATS 2020).
    """

    def __init__(self, model, *, init_scale: float = math.log1p(math.exp(-4.0)), **kwargs):
        super().__init__(model, init_scale=init_scale, **kwargs)

    def site_posterior(self, loc, scale, event_dim, *, value=None):
        return _SiteRadial(loc, scale, value, event_dim=event_dim)

    def flat_noise(self, loc, sizes):
        # One direction per site for all sites of the block at once: ε and the radii in one
        # randn call, the per-site norms in one fused foreach pass, and ε scaled by r/‖ε‖ in
        # place by one foreach multiply over the sites' views (no further temporaries).
        with torch.no_grad():
            numel, num_sites = loc.numel(), len(sizes)
            noise = torch.randn(numel + num_sites, dtype=loc.dtype, device=loc.device)
            eps, radius = noise[:numel], noise[numel:]
            parts = eps.split(sizes)
            factor = radius.div_(_norms(parts, eps.dtype))
            torch._foreach_mul_(parts, list(factor.unbind()))
        return eps

    def site_quantiles(self, loc, scale, event_dim, q):
        numel = math.prod(loc.shape[loc.dim() - event_dim :])
        return loc + scale * radial_marginal_icdf(q, numel)
