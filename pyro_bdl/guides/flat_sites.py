"""The sites of a guide over one flat latent vector, sampled without per-site overheads.

:class:`~pyro_bdl.guides.AutoSWAG` and :class:`~pyro_bdl.guides.AutoSubnetLaplace` pack every
latent site into one unconstrained vector, as :class:`~pyro.infer.autoguide.AutoContinuous` does,
and run once per training step. :func:`sample_sites` is ``AutoContinuous.forward`` after the
latent draw, without what that costs per site on every step: one ``torch.split`` for all sites
(the backward pass then writes the whole gradient once, not a zero-filled D-vector per site),
real-valued sites skip the identity transform and its all-zeros log-Jacobian (two passes over
every weight), the site Deltas (:class:`PointMass`) skip argument validation (a device→host
synchronisation per site) and the elementwise test of their own draw, and plates are entered only
for a site that lives in one.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.distributions.util import sum_rightmost

from pyro_bdl.layout import SiteLayout

__all__ = ["PointMass", "sample_sites", "split_latent"]


class PointMass(dist.Delta):
    """A ``Delta`` that knows its own draw: ``rsample()`` returns ``v`` itself, and the density
    of that draw is ``log_density`` without the elementwise test ``x == v`` and its logarithm
    (two passes over every weight per training step whose result is always 0). Build it with
    ``validate_args=False``: validating the constant log-density is a device→host sync.

    Built with the number 0 as ``log_density``, it makes the zero tensor only when something
    reads ``log_density`` (an ELBO that knows the density is 0 never does): one fill kernel per
    site and step fewer.

    :ivar bool zero_density: built with the number 0 as ``log_density`` (no Jacobian): the
        density of its own draw is exactly 0, which an ELBO may use without evaluating it.
    """

    def __init__(self, v, log_density=0.0, event_dim=0, validate_args=None):
        self.zero_density = isinstance(log_density, (int, float)) and log_density == 0
        if not self.zero_density or event_dim > v.dim():
            super().__init__(v, log_density, event_dim, validate_args)
            return
        batch_dim = v.dim() - event_dim
        self.v = v
        self._log_density: torch.Tensor | None = None
        TorchDistribution.__init__(
            self, v.shape[:batch_dim], v.shape[batch_dim:], validate_args=validate_args
        )

    @property
    def log_density(self) -> torch.Tensor:
        value = self.__dict__.get("_log_density")
        if value is None:
            value = self.v.new_zeros(self.batch_shape)
            self._log_density = value
        return value

    @log_density.setter
    def log_density(self, value: torch.Tensor) -> None:
        self._log_density = value

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(PointMass, _instance)
        new = super().expand(batch_shape, _instance=new)
        new.zero_density = self.zero_density
        return new

    def rsample(self, sample_shape=torch.Size()):
        return self.v if not sample_shape else super().rsample(sample_shape)

    def log_prob(self, x):
        if x is self.v:
            return self.log_density
        return super().log_prob(x)


def split_latent(layout: SiteLayout, latent: torch.Tensor) -> list[torch.Tensor]:
    """Every site's unconstrained block of ``latent`` (last dim D), shaped as
    :meth:`AutoContinuous._unpack_latent` shapes it: the batch dims of ``latent`` (vectorized
    particles) broadcast against the site's plate dims instead of being prepended to them."""
    parts = layout.split(latent)
    batch = latent.shape[:-1]
    if not batch:
        return parts
    return [
        part.reshape(torch.broadcast_shapes(site.shape, batch + (1,) * site.event_dim))
        for part, site in zip(parts, layout)
    ]


def sample_sites(
    layout: SiteLayout, latent: torch.Tensor, plates: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """One ``pyro.sample`` per site of ``layout`` at its block of ``latent``, ``{name: value}``.

    :param latent: the unconstrained latent vector (leading batch dims allowed).
    :param plates: the guide's plates by name (``AutoGuide._create_plates``); only read for a
        site inside a plate, so a layout without plated sites may pass ``{}``.
    """
    no_jacobian = poutine.get_mask() is False
    result = {}
    for site, unconstrained in zip(layout, split_latent(layout, latent)):
        # The constrained value may have other dims than the unconstrained one.
        value, event_dim, log_density = unconstrained, site.event_dim, 0.0
        if site.transform is not None:
            value = site.transform(unconstrained)
            event_dim += value.dim() - unconstrained.dim()
            if not no_jacobian:
                ladj = site.transform.inv.log_abs_det_jacobian(value, unconstrained)
                log_density = sum_rightmost(ladj, ladj.dim() - value.dim() + event_dim)
        delta = PointMass(value, log_density=log_density, event_dim=event_dim, validate_args=False)
        if not site.frames:
            result[site.name] = pyro.sample(site.name, delta)
            continue
        with ExitStack() as stack:
            for plate_name, _ in site.frames:
                stack.enter_context(plates[plate_name])
            result[site.name] = pyro.sample(site.name, delta)
    return result
