r"""The posterior structures of the Laplace guide family over a subnetwork S: one interface, three
shapes of the precision :math:`H = cG + \mathrm{diag}\,\lambda` (docs/design/laplace.md).

``G`` is the GGN over S (computed at the model's noise σ₀ for a Gaussian likelihood; ``c`` =
σ₀²/σ² rescales it to another σ), λ one prior precision per subnetwork weight. A structure
:math:`H^{-1} = LL^\top` offers

- ``apply_scale(J)``: :math:`JL` for rows ``J`` (..., S), what the linearised predictive needs
  (:func:`~pyro_bdl.guides.laplace_predictive.predictive`), never an S × S matrix for ``diag`` or
  ``kron``;
- ``sample(z)``: :math:`Lz` for standard normal ``z`` (..., S);
- ``variances()``: the marginal variances, diag :math:`H^{-1}`;
- ``logdet(lam, c)``: :math:`\log\det(cG + \mathrm{diag}\,\lambda)`, differentiable in
  ``lam`` and ``c`` (the marginal likelihood, :mod:`~pyro_bdl.guides.laplace_marglik`);
- ``quadratic(d)``: :math:`d^\top H d` (the density);
- ``with_prior(lam, c)``: the same curvature under another prior and σ.

:class:`FullPosterior` (dense, Cholesky), :class:`DiagPosterior` (here) and
:class:`~pyro_bdl.guides.laplace_kron.KronPosterior` implement it.
"""

from __future__ import annotations

import math

import torch
from pyro.distributions.torch_distribution import TorchDistribution

from pyro_bdl.guides.laplace_posterior import SubnetNormal, posterior_factor

__all__ = ["DiagPosterior", "FullPosterior", "StructuredNormal"]


class DiagPosterior:
    r"""Diagonal Laplace: :math:`H = c\,\mathrm{diag}(h) + \mathrm{diag}\,\lambda` with ``h`` the
    diagonal of the GGN (exact, from per-example output gradients)."""

    name = "diag"

    def __init__(self, diag: torch.Tensor, lam: torch.Tensor, c: float | torch.Tensor = 1.0):
        self.diag, self.lam, self.c = diag, lam, c
        self.precision = c * diag + lam

    def with_prior(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> DiagPosterior:
        return DiagPosterior(self.diag, lam, c)

    def apply_scale(self, jac: torch.Tensor) -> torch.Tensor:
        return jac.to(self.precision) * self.precision.rsqrt()

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        return z.to(self.precision) * self.precision.rsqrt()

    def variances(self) -> torch.Tensor:
        return self.precision.reciprocal()

    def logdet(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> torch.Tensor:
        return torch.log(c * self.diag + lam).sum()

    def quadratic(self, d: torch.Tensor) -> torch.Tensor:
        return (d.to(self.precision).square() * self.precision).sum(-1)


class FullPosterior:
    r"""Dense Laplace: :math:`H = cG + \mathrm{diag}\,\lambda`, factorised by
    :func:`~pyro_bdl.guides.laplace_posterior.posterior_factor` (``scale_tril`` when known)."""

    name = "full"

    def __init__(
        self,
        ggn: torch.Tensor,
        lam: torch.Tensor,
        c: float | torch.Tensor = 1.0,
        scale_tril: torch.Tensor | None = None,
    ):
        self.ggn, self.lam, self.c = ggn, lam, c
        if scale_tril is None:
            lam_d = lam.detach().to(ggn) if isinstance(lam, torch.Tensor) else lam
            scale_tril = posterior_factor(float(c) * ggn, lam_d)
        self.scale_tril = scale_tril

    def with_prior(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> FullPosterior:
        return FullPosterior(self.ggn, lam, c)

    def apply_scale(self, jac: torch.Tensor) -> torch.Tensor:
        return jac.to(self.scale_tril) @ self.scale_tril

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        return z.to(self.scale_tril) @ self.scale_tril.T

    def variances(self) -> torch.Tensor:
        return self.scale_tril.square().sum(-1)

    def logdet(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> torch.Tensor:
        precision = c * self.ggn + torch.diag_embed(lam.expand(self.ggn.shape[0]))
        return 2 * torch.linalg.cholesky(precision).diagonal().log().sum()

    def quadratic(self, d: torch.Tensor) -> torch.Tensor:
        white = torch.linalg.solve_triangular(
            self.scale_tril, d.to(self.scale_tril).unsqueeze(-1), upper=False
        )
        return white.squeeze(-1).square().sum(-1)


class StructuredNormal(SubnetNormal):
    r"""A Gaussian over the subnetwork coordinates ``index`` of a packed vector, a point mass at
    ``loc`` on all others: :math:`\theta = \mathrm{loc} + \mathrm{scatter}_S(Lz)` with ``L``
    from a posterior structure (:class:`DiagPosterior`, :class:`FullPosterior`,
    :class:`~pyro_bdl.guides.laplace_kron.KronPosterior`). ``log_prob`` is the Gaussian density
    of the subnetwork coordinates."""

    def __init__(self, loc: torch.Tensor, index: torch.Tensor, structure):
        self.loc, self.index, self.structure = loc, index, structure
        TorchDistribution.__init__(self, torch.Size(), loc.shape[-1:], validate_args=False)

    def _draw(self, z: torch.Tensor) -> torch.Tensor:
        return self.structure.sample(z)

    def log_prob(self, value):
        d = (value - self.loc)[..., self.index]
        s = self.index.numel()
        logdet = self.structure.logdet(self.structure.lam, self.structure.c)
        return -0.5 * (self.structure.quadratic(d) - logdet + s * math.log(2 * math.pi))
