r"""The equal-weight mixture of M distributions over one packed vector: the posterior of a deep
ensemble (M point masses) and of MultiSWAG (M SWAG Gaussians).

.. math::

    q(\theta) = \frac{1}{M} \sum_{m=1}^{M} q_m(\theta)

A draw picks a member uniformly and draws from it; with :attr:`MemberMixture.member` set, every
draw comes from that member (how :meth:`~pyro_bdl.guides.ensemble.MemberGuide.member_outputs`
enumerates the members exactly). The method: docs/design/ensemble.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pyro.distributions import TorchDistribution, constraints
from torch.distributions import Distribution

__all__ = ["MemberMixture"]


class MemberMixture(TorchDistribution):
    r"""Equal-weight mixture of ``members``, each a distribution with event shape ``(D,)`` and no
    batch shape.

    Sampling draws the member indices of all ``n`` draws at once and each member only for the
    draws that picked it (``n`` draws in all, not ``M · n``).

    :param members: the M component distributions (point masses, SWAG Gaussians, ...).
    :param int member: draw from this member only (``None``: pick uniformly per draw).
    """

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = False

    def __init__(
        self,
        members: Sequence[Distribution],
        *,
        member: int | None = None,
        batch_shape: torch.Size | tuple[int, ...] = (),
    ):
        self.members = tuple(members)
        if not self.members:
            raise ValueError("MemberMixture needs at least one member distribution; got none.")
        if member is not None and not 0 <= member < len(self.members):
            raise ValueError(f"member must be in [0, {len(self.members)}); got {member}.")
        self.member = member
        event_shape = self.members[0].event_shape
        super().__init__(torch.Size(batch_shape), event_shape, validate_args=False)

    def expand(self, batch_shape, _instance=None):
        # Pyro's plates (Predictive(parallel=True), sample_outputs) expand the distribution:
        # a draw of the expanded mixture is one independent mixture draw per batch element.
        return MemberMixture(self.members, member=self.member, batch_shape=batch_shape)

    def _stacked(self, attr: str) -> torch.Tensor:
        return torch.stack([getattr(m, attr) for m in self.members])

    @property
    def mean(self) -> torch.Tensor:
        """The average of the members' means."""
        return self._stacked("mean").mean(0).expand(self.batch_shape + self.event_shape)

    @property
    def variance(self) -> torch.Tensor:
        r"""Law of total variance: :math:`\frac1M\sum_m \sigma_m^2 + \frac1M\sum_m (\mu_m -
        \bar\mu)^2`, coordinate by coordinate."""
        means = self._stacked("mean")
        spread = (means - means.mean(0)).square().mean(0)
        total = self._stacked("variance").mean(0) + spread
        return total.expand(self.batch_shape + self.event_shape)

    def sample(self, sample_shape=torch.Size()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.batch_shape
        with torch.no_grad():
            if self.member is not None:
                return self.members[self.member].sample(shape)
            n = shape.numel()
            device = self.members[0].mean.device
            index = torch.randint(len(self.members), (n,), device=device)
            out: torch.Tensor | None = None
            for k, member in enumerate(self.members):
                rows = (index == k).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                draw = member.sample(torch.Size([rows.numel()]))
                if out is None:
                    out = draw.new_empty((n, *self.event_shape))
                out[rows] = draw
            assert out is not None  # n >= 1, so some member was picked
            return out.reshape(shape + self.event_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """:math:`\\log \\frac1M \\sum_m q_m(\\theta)`; for one fixed member, that member's."""
        if self.member is not None:
            return self.members[self.member].log_prob(value)
        parts = torch.stack([m.log_prob(value) for m in self.members], -1)
        return parts.logsumexp(-1) - math.log(len(self.members))
