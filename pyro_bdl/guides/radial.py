r"""Radial guide: one :class:`~pyro_bdl.distributions.Radial` per weight site, on the site."""

from __future__ import annotations

import math

import torch

from pyro_bdl.distributions.radial import Radial, radial_marginal_icdf
from pyro_bdl.guides.base import AutoLocScaleGuide

__all__ = ["AutoRadial"]


def _norm2(eps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-site squared norms, kept above zero (an all-zero draw has probability zero, but a
    one-weight site in low precision could meet it)."""
    norm2 = torch.segment_reduce(eps * eps, "sum", lengths=lengths)
    return norm2.clamp_min_(torch.finfo(eps.dtype).tiny)


class _PresampledRadial(Radial):
    """A :class:`Radial` whose first ``rsample()`` returns a draw made beforehand (see
    :class:`~pyro_bdl.guides.meanfield._PresampledNormal`)."""

    def __init__(self, loc, scale, value, *, event_dim):
        super().__init__(loc, scale, event_dim=event_dim, validate_args=False)
        self._value = value

    def rsample(self, sample_shape=torch.Size()):
        value, self._value = self._value, None
        if value is not None and not sample_shape:
            return value
        return super().rsample(sample_shape)

    def expand(self, batch_shape, _instance=None):
        plain = Radial(self.loc, self.scale, event_dim=len(self.event_shape), validate_args=False)
        return plain.expand(batch_shape)


class AutoRadial(AutoLocScaleGuide):
    r"""Radial posterior per site: :math:`w = \mu + \sigma\odot r\,\varepsilon/\lVert\varepsilon
    \rVert` with one direction per weight tensor per sample (DESIGN.md 4.3).

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
        if value is None:
            return Radial(loc, scale, event_dim=event_dim, validate_args=False)
        return _PresampledRadial(loc, scale, value, event_dim=event_dim)

    def flat_sample(self, loc, scale):
        # One direction per site for all sites at once: ε and the radii in one randn call,
        # per-site squared norms by a segment sum, the factors r/‖ε‖ broadcast back with
        # repeat_interleave.
        with torch.no_grad():
            lengths = self._lengths(loc.device)
            numel, num_sites = loc.numel(), lengths.numel()
            noise = torch.randn(numel + num_sites, dtype=loc.dtype, device=loc.device)
            eps, radius = noise[:numel], noise[numel:]
            factor = radius.mul_(_norm2(eps, lengths).rsqrt_())
            xi = eps.mul_(torch.repeat_interleave(factor, lengths, output_size=numel))
        return torch.addcmul(loc, scale, xi)

    def _lengths(self, device) -> torch.Tensor:
        lengths = getattr(self, "_lengths_cache", None)
        if lengths is None or lengths.device != device:
            lengths = torch.tensor(self._sizes, device=device)
            self._lengths_cache = lengths
        return lengths

    def site_quantiles(self, loc, scale, event_dim, q):
        numel = math.prod(loc.shape[loc.dim() - event_dim :])
        return loc + scale * radial_marginal_icdf(q, numel)
