"""The Bayes-by-Backprop scale-mixture prior π N(0, s₁²) + (1 − π) N(0, s₂²), element-wise."""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution, constraints
from torch.distributions.utils import broadcast_all


class ScaleMixtureNormal(TorchDistribution):
    r"""Element-wise two-component zero-mean Gaussian scale mixture.

    .. math:: p(w) = \pi\,\mathcal N(w; 0, s_1^2) + (1 - \pi)\,\mathcal N(w; 0, s_2^2)

    :param pi: weight of the first component, in (0, 1).
    :param scale1: standard deviation of the first component.
    :param scale2: standard deviation of the second component.

    References:
        Blundell et al., "Weight Uncertainty in Neural Networks" (ICML 2015).
    """

    arg_constraints = {
        "pi": constraints.unit_interval,
        "scale1": constraints.positive,
        "scale2": constraints.positive,
    }
    support = constraints.real
    has_rsample = False

    def __init__(self, pi, scale1, scale2, validate_args=None):
        self.pi, self.scale1, self.scale2 = broadcast_all(pi, scale1, scale2)
        super().__init__(self.pi.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(ScaleMixtureNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new.pi = self.pi.expand(batch_shape)
        new.scale1 = self.scale1.expand(batch_shape)
        new.scale2 = self.scale2.expand(batch_shape)
        super(ScaleMixtureNormal, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        half_log_2pi = 0.5 * math.log(2 * math.pi)
        lp1 = -0.5 * (value / self.scale1) ** 2 - self.scale1.log() - half_log_2pi
        lp2 = -0.5 * (value / self.scale2) ** 2 - self.scale2.log() - half_log_2pi
        return torch.logaddexp(lp1 + self.pi.log(), lp2 + torch.log1p(-self.pi))

    def sample(self, sample_shape=torch.Size()):
        shape = self._extended_shape(sample_shape)
        with torch.no_grad():
            first = torch.rand(shape, dtype=self.pi.dtype, device=self.pi.device) < self.pi
            scale = torch.where(first, self.scale1.expand(shape), self.scale2.expand(shape))
            return scale * torch.randn(shape, dtype=self.pi.dtype, device=self.pi.device)

    @property
    def mean(self):
        return torch.zeros_like(self.pi)

    @property
    def variance(self):
        return self.pi * self.scale1**2 + (1 - self.pi) * self.scale2**2
