r"""Mean-field Gaussian guide (Bayes by Backprop) with the Normal on each weight site itself."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from pyro_bdl.guides.base import AutoLocScaleGuide

__all__ = ["AutoMeanField"]


class _PresampledNormal(dist.Normal):
    """A ``Normal`` whose first ``rsample()`` returns a draw made beforehand.

    The guide draws the noise of all sites in one flat operation and hands each site its view;
    the distribution is an ordinary ``Normal`` in every other respect (log_prob, KL, expand).
    """

    def __init__(self, loc, scale, value):
        super().__init__(loc, scale, validate_args=False)
        self._value = value

    def rsample(self, sample_shape=torch.Size()):
        value, self._value = self._value, None  # one use: later calls draw fresh noise
        if value is not None and not sample_shape:
            return value
        return super().rsample(sample_shape)

    def expand(self, batch_shape, _instance=None):
        return dist.Normal(self.loc, self.scale, validate_args=False).expand(batch_shape)


class AutoMeanField(AutoLocScaleGuide):
    r"""Fully factorised Gaussian posterior :math:`q(w) = \prod_i \mathcal N(\mu_i, \sigma_i^2)`
    with :math:`\sigma = \mathrm{softplus}(\rho)` (DESIGN.md 4.2).

    Unlike :class:`~pyro.infer.autoguide.AutoNormal`, the ``Normal`` is the distribution of the
    weight site itself (no auxiliary site plus ``Delta``), so
    :class:`~pyro.infer.TraceMeanField_ELBO` computes the KL to a Normal prior exactly.

    Usage::

        guide = bdl.guides.AutoMeanField(model, init_scale=1e-2)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())

    :param callable model: the Pyro model (for example ``bdl.models.classifier(bnn, N)``).
    :param float init_scale: initial posterior standard deviation of every weight (> 0).
    :param callable init_loc_fn: initial locations (default: the network's own weights).
    :param callable create_plates: optional, as in :class:`~pyro.infer.autoguide.AutoGuide`.

    References:
        Blundell, Cornebise, Kavukcuoglu & Wierstra, "Weight Uncertainty in Neural Networks"
        (ICML 2015).
    """

    def site_posterior(self, loc, scale, event_dim, *, value=None):
        # The scale is a softplus output and the loc a free parameter, so they are valid by
        # construction; skipping torch's argument checks saves a constraint pass per site.
        if value is None:
            base = dist.Normal(loc, scale, validate_args=False)
        else:
            base = _PresampledNormal(loc, scale, value)
        return base.to_event(event_dim)

    def flat_sample(self, loc, scale):
        return torch.addcmul(loc, scale, torch.randn_like(loc))

    def site_quantiles(self, loc, scale, event_dim, q):
        return loc + scale * (2**0.5) * torch.erfinv(2 * q - 1)
