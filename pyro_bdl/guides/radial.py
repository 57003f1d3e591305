r"""Radial guide: one :class:`~pyro_bdl.distributions.Radial` per weight site, on the site."""

from __future__ import annotations

from pyro_bdl.distributions.radial import Radial, radial_marginal_icdf
from pyro_bdl.guides.base import AutoLocScaleGuide

__all__ = ["AutoRadial"]


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

    def __init__(self, model, *, init_scale: float = 0.018149927917910062, **kwargs):
        super().__init__(model, init_scale=init_scale, **kwargs)

    def site_posterior(self, loc, scale, event_dim):
        return Radial(loc, scale, event_dim=event_dim, validate_args=False)

    def site_quantiles(self, loc, scale, event_dim, q):
        numel = 1
        for s in loc.shape[loc.dim() - event_dim :]:
            numel *= s
        return loc + scale * radial_marginal_icdf(q, numel)
