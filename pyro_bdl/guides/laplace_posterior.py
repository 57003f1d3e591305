r"""The model-free numerics of :class:`~pyro_bdl.guides.AutoSubnetLaplace`: the subnetwork
Gaussian, its factor from the GGN, the memory check before ``fit``, and the prior-precision
scores in the GGN's eigenbasis.

With :math:`G = U\,\mathrm{diag}(e)\,U^\top` the subnetwork GGN, the posterior covariance at a
prior precision :math:`\lambda_S` is :math:`\Sigma_S = U\,\mathrm{diag}(1/(e+\lambda_S))U^\top`,
so the variance of a linearized output :math:`J_S\Sigma_S J_S^\top` is
:math:`\sum_k (J_S U)_k^2 / (e_k + \lambda_S)`: one eigendecomposition makes every grid value of
λ cost O(n·C·S) for a validation set of n points, and the marginal likelihood O(S).

Usage::

    evals, evecs = torch.linalg.eigh(ggn)
    score = val_ll_score(parts, "categorical", None, evals, evecs, ratio=S / D)
    best = tune_grid(score, torch.logspace(-4, 4, 17, dtype=torch.float64))

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
    Immer et al., "Scalable Marginal Likelihood Estimation for Model Selection in Deep
    Learning", ICML 2021.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints

from pyro_bdl.curvature.subnet import cholesky_jitter, log_marginal

__all__ = [
    "SubnetNormal",
    "check_memory",
    "marglik_score",
    "posterior_factor",
    "val_ll_score",
]


class SubnetNormal(TorchDistribution):
    r"""A Gaussian over the subnetwork coordinates ``index`` of a packed vector, a point mass at
    ``loc`` on all others: :math:`\theta = \mathrm{loc} + \mathrm{scatter}_S(L z)`.
    ``log_prob`` is the Gaussian density of the subnetwork coordinates."""

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: torch.Tensor, index: torch.Tensor, scale_tril: torch.Tensor):
        self.loc, self.index, self.scale_tril = loc, index, scale_tril
        super().__init__(torch.Size(), loc.shape[-1:], validate_args=False)

    def rsample(self, sample_shape=torch.Size()):
        shape = torch.Size(sample_shape)
        z = torch.randn(shape + self.index.shape, dtype=self.loc.dtype, device=self.loc.device)
        out = self.loc.expand(shape + self.loc.shape).clone()
        out[..., self.index] += (z.to(self.scale_tril.dtype) @ self.scale_tril.T).to(out.dtype)
        return out

    def log_prob(self, value):
        d = (value - self.loc)[..., self.index].to(self.scale_tril.dtype)
        zero = torch.zeros_like(d)
        return dist.MultivariateNormal(zero, scale_tril=self.scale_tril).log_prob(d)


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 62


def check_memory(
    count: int, outputs: int, batch_size: int, dtype: torch.dtype, device, budget: int | None
) -> None:
    """Raise a ``ValueError`` stating the bytes needed when three S × S matrices and one
    ``batch_size × C × S`` Jacobian chunk exceed ``budget`` (default: the device's free
    memory)."""
    item = torch.finfo(dtype).bits // 8
    needed = 3 * count * count * item + 4 * batch_size * outputs * count * item
    budget = budget or _available_bytes(torch.device(device))
    if needed > budget:
        raise ValueError(
            f"a subnetwork of S = {count} weights needs about {needed:,} bytes "
            f"({needed / 2**30:.2f} GiB: three S × S matrices in {dtype} and one Jacobian "
            f"chunk) but only {budget:,} bytes are available; choose a smaller size, "
            "a smaller batch_size, or raise max_memory."
        )


def posterior_factor(ggn: torch.Tensor, prior_s: float) -> torch.Tensor:
    """Lower factor of Σ_S = (GGN + λ_S I)⁻¹, with at most three S × S matrices alive
    besides ``ggn``."""
    precision = ggn.clone()
    precision.diagonal().add_(prior_s)
    chol = cholesky_jitter(precision, what="H_S = GGN + λ_S I")
    del precision
    cov = torch.cholesky_inverse(chol)
    del chol
    return cholesky_jitter(cov, what="the covariance Σ_S")


def marglik_score(
    evals: torch.Tensor, theta: torch.Tensor, ratio: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """λ ↦ the λ-dependent Laplace log marginal likelihood with λ_S = ``ratio`` · λ."""
    return lambda lam: log_marginal(evals, theta, lam * ratio)


def val_ll_score(
    parts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    likelihood: str,
    noise: float | None,
    evals: torch.Tensor,
    evecs: torch.Tensor,
    ratio: float,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """λ ↦ the validation log-likelihood of the linearized predictive (probit for
    classification, closed form with the noise σ for regression), from chunks
    ``(outputs (b, C), J_S (b, C, S), targets (b,))`` at the MAP values."""
    fs, qs, ys = [], [], []
    for out, jac, y in parts:
        if likelihood == "categorical":
            # Mean variance of the pairwise logit differences, as in linearized_predictive.
            jac = jac - jac.mean(1, keepdim=True)
        scale = 2.0 / max(out.shape[1] - 1, 1) if likelihood == "categorical" else 1.0
        fs.append(out.double())
        qs.append(scale * (jac.double() @ evecs).square().sum(1))
        ys.append(y)
    f, q, y = torch.cat(fs), torch.cat(qs), torch.cat(ys)

    def score(lam: torch.Tensor) -> torch.Tensor:
        var = q @ (1.0 / (evals + lam * ratio))
        if likelihood == "gaussian":
            assert noise is not None
            return dist.Normal(f.squeeze(-1), (var + noise**2).sqrt()).log_prob(y).sum()
        kappa = (1 + math.pi / 8 * var).rsqrt().unsqueeze(-1)
        if likelihood == "bernoulli":
            return dist.Bernoulli(logits=(f * kappa).squeeze(-1)).log_prob(y.to(f)).sum()
        return dist.Categorical(logits=f * kappa).log_prob(y).sum()

    return score
