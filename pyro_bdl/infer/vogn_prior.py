r"""VOGN's Gaussian prior N(μ₀, diag δ⁻¹), read once from the lifted sites (docs/design/vogn.md).

By default the prior is the one declared in :func:`~pyro_bdl.bayesianize`
(:meth:`~pyro_bdl.layout.SiteLayout.gaussian_prior`); an explicit ``prior_precision`` replaces it
by N(0, δ⁻¹ I). A prior that is the same on every weight is kept as one number, so that the update
and the KL take the scalar path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pyro_bdl.layout import SiteLayout

__all__ = ["VOGNPrior"]


@dataclass(frozen=True)
class VOGNPrior:
    """A diagonal Gaussian prior over the flat weight vector.

    :ivar precision: δ, a number or a ``(D,)`` tensor.
    :ivar mean: μ₀, a ``(D,)`` tensor, or ``None`` for zero.
    """

    precision: float | torch.Tensor
    mean: torch.Tensor | None = None

    @classmethod
    def read(cls, layout: SiteLayout, prior_precision: float | None, like: torch.Tensor):
        """The prior of the lifted sites of ``layout``, or N(0, δ⁻¹ I) for an explicit δ.

        :raises NonGaussianPriorError: a lifted prior is not Gaussian (and no δ was given).
        """
        if prior_precision is not None:
            return cls(float(prior_precision))
        mean, precision = layout.gaussian_prior()
        mean = mean.to(like)
        precision = precision.to(like)
        first = precision[:1]
        uniform: float | torch.Tensor = (
            float(first) if bool((precision == first).all()) else precision.contiguous()
        )
        return cls(uniform, None if not bool(mean.any()) else mean.contiguous())

    @property
    def mean_precision(self) -> float:
        """δ averaged over the weights (the δ that damps the hidden parameters' step)."""
        if isinstance(self.precision, torch.Tensor):
            return float(self.precision.mean())
        return self.precision

    def tilde(self, temperature: float, effective_size: float) -> float | torch.Tensor:
        """δ̃ = τδ/Ñ."""
        if isinstance(self.precision, torch.Tensor):
            return self.precision * (temperature / effective_size)
        return temperature * self.precision / effective_size

    @torch.no_grad()
    def variance_sums(self, scale: torch.Tensor, log_scale: torch.Tensor) -> tuple[float, float]:
        """(Σ δσ², Σ log σ²) of the KL (Σ σ² for a scalar δ), kept while σ does not change."""
        if isinstance(self.precision, torch.Tensor):
            return float(torch.dot(self.precision, scale.square())), 2.0 * float(log_scale.sum())
        return float(torch.dot(scale, scale)), 2.0 * float(log_scale.sum())

    @torch.no_grad()
    def kl(self, loc: torch.Tensor, sums: tuple[float, float]) -> float:
        r"""KL(N(μ, σ²) ‖ N(μ₀, δ⁻¹)) in closed form, given :meth:`variance_sums` of σ."""
        weighted_var, sum_log_var = sums
        dim = loc.numel()
        offset = loc if self.mean is None else loc - self.mean
        if isinstance(self.precision, torch.Tensor):
            quad = weighted_var + float(torch.dot(self.precision, offset.square()))
            log_det = float(self.precision.log().sum())
        else:
            quad = self.precision * (weighted_var + float(torch.dot(offset, offset)))
            log_det = dim * math.log(self.precision)
        return 0.5 * (quad - dim - log_det - sum_log_var)
