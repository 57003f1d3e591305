"""Scenarios with exact answers, shared by the tests of every inference method.

``BayesianLinearRegression``: y = X w + ε, ε ~ N(0, σ²), prior w ~ N(0, s² I), σ known. The
posterior is Gaussian with precision Λ = I/s² + XᵀX/σ² and mean Λ⁻¹Xᵀy/σ²; the mean-field
optimum (closest fully factorised Gaussian in KL(q‖p)) has the exact mean and variances 1/Λᵢᵢ;
the evidence is y ~ N(0, σ²I + s² XXᵀ).

``NormalNormal``: μ ~ N(m₀, s₀²), yᵢ ~ N(μ, σ²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from torch import nn

from pyro_bdl import bayesianize, models, priors


@dataclass
class BayesianLinearRegression:
    n: int = 50
    d: int = 3
    noise: float = 0.5
    prior_scale: float = 1.0
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.x = torch.randn(self.n, self.d, generator=g, dtype=self.dtype)
        self.true_w = torch.randn(self.d, generator=g, dtype=self.dtype)
        noise = self.noise * torch.randn(self.n, generator=g, dtype=self.dtype)
        self.y = self.x @ self.true_w + noise

    @property
    def precision(self) -> torch.Tensor:
        eye = torch.eye(self.d, dtype=self.dtype)
        return eye / self.prior_scale**2 + self.x.T @ self.x / self.noise**2

    @property
    def covariance(self) -> torch.Tensor:
        return torch.linalg.inv(self.precision)

    @property
    def mean(self) -> torch.Tensor:
        return torch.linalg.solve(self.precision, self.x.T @ self.y / self.noise**2)

    @property
    def meanfield_mean(self) -> torch.Tensor:
        return self.mean

    @property
    def meanfield_std(self) -> torch.Tensor:
        return self.precision.diagonal().rsqrt()

    @property
    def log_evidence(self) -> float:
        cov = self.noise**2 * torch.eye(self.n, dtype=self.dtype)
        cov = cov + self.prior_scale**2 * self.x @ self.x.T
        zero = torch.zeros(self.n, dtype=self.dtype)
        return float(dist.MultivariateNormal(zero, cov).log_prob(self.y))

    def network(self) -> nn.Module:
        """A lifted ``Linear(d, 1, bias=False)`` whose only site ``"weight"`` has shape (1, d)."""
        torch.manual_seed(self.seed)
        net = nn.Linear(self.d, 1, bias=False).to(self.dtype)
        return bayesianize(net, priors.Normal(0.0, self.prior_scale))

    def model(self, net: nn.Module | None = None):
        """The Pyro model over the lifted network: call as ``model(x, y)``."""
        return models.regressor(net or self.network(), self.n, self.noise)


@dataclass
class NormalNormal:
    n: int = 20
    prior_loc: float = 0.0
    prior_scale: float = 2.0
    noise: float = 1.0
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.y = 1.5 + self.noise * torch.randn(self.n, generator=g, dtype=self.dtype)

    @property
    def posterior_precision(self) -> float:
        return 1 / self.prior_scale**2 + self.n / self.noise**2

    @property
    def posterior_loc(self) -> float:
        num = self.prior_loc / self.prior_scale**2 + float(self.y.sum()) / self.noise**2
        return num / self.posterior_precision

    @property
    def posterior_scale(self) -> float:
        return 1 / math.sqrt(self.posterior_precision)

    @property
    def log_evidence(self) -> float:
        cov = self.noise**2 * torch.eye(self.n, dtype=self.dtype) + self.prior_scale**2
        loc = torch.full((self.n,), self.prior_loc, dtype=self.dtype)
        return float(dist.MultivariateNormal(loc, cov).log_prob(self.y))

    def model(self, y: torch.Tensor | None = None):
        loc = torch.tensor(self.prior_loc, dtype=self.dtype)
        mu = pyro.sample("mu", dist.Normal(loc, self.prior_scale))
        with pyro.plate("data", self.n):
            pyro.sample("y", dist.Normal(mu, self.noise), obs=self.y if y is None else y)
        return mu
