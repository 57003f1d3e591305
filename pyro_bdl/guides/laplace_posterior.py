r"""The subnetwork Laplace posterior as functions of tensors: the subnetwork Gaussian, its factor
from the GGN, the linearized predictive, the marginal likelihood and the prior-precision scores
in the GGN's eigenbasis (docs/design/laplace.md).

With the GGN :math:`G` over a subnetwork S and a prior precision :math:`\lambda_S` per
subnetwork weight, the posterior over S is :math:`N(\theta_S^*, (G + \mathrm{diag}\,
\lambda_S)^{-1})`; every other weight stays at its MAP value. The linearized network
:math:`f(x,\theta^*) + J_S(x)(\theta_S - \theta_S^*)` turns it into a Gaussian over outputs.

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
import warnings
from collections.abc import Callable, Iterable

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints

from pyro_bdl._validation import check_positive
from pyro_bdl.guides.laplace_predictive import (
    LINKS,
    laplace_bridge,
    linearized_predictive,
    predictive,
    probit_logits,
)

__all__ = [
    "LINKS",
    "RoundOffWarning",
    "SubnetNormal",
    "accumulation_dtype",
    "cholesky_jitter",
    "laplace_bridge",
    "linearized_predictive",
    "log_marginal",
    "marglik_score",
    "posterior_factor",
    "predictive",
    "predictive_log_likelihood",
    "probit_logits",
    "tune_grid",
    "tune_precision",
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
        out[..., self.index] += self._draw(z).to(out.dtype)
        return out

    def _draw(self, z: torch.Tensor) -> torch.Tensor:
        """L z for standard normal ``z`` (..., S)."""
        return z.to(self.scale_tril.dtype) @ self.scale_tril.T

    def log_prob(self, value):
        d = (value - self.loc)[..., self.index].to(self.scale_tril.dtype)
        zero = torch.zeros_like(d)
        return dist.MultivariateNormal(zero, scale_tril=self.scale_tril).log_prob(d)


class RoundOffWarning(UserWarning):
    """Round-off, not the data or the prior, sets some posterior variances: a Cholesky
    factorisation needed a material jitter, or H_S is too ill-conditioned for its dtype."""


#: A jitter j added to a symmetric matrix with smallest eigenvalue e_min scales the variance
#: along each eigenvector k by e_k / (e_k + j) (of H_S; of Σ_S, by (e_k + j) / e_k), so every
#: marginal and linearized-predictive variance moves by at most j / e_min relative. Below 1% this
#: is under the Monte Carlo error of any predictive estimated from fewer than 10⁴ draws (1/√10⁴);
#: above it the jitter, not the data or the prior, sets some variances, and that is never silent.
MATERIAL_JITTER = 1e-2


def accumulation_dtype(requested: torch.dtype | None, weights: torch.dtype) -> torch.dtype:
    """The dtype H_S and Σ_S are accumulated and factorised in: ``requested``, else float64.

    Σ_S = (GGN + λ_S)⁻¹ is as ill-conditioned as trace(GGN)/λ_S, which a small prior precision
    λ_S = λ·S/D makes far larger than 1/u₃₂ ≈ 10⁷: in float32 the posterior's small eigenvalues
    (the directions only the prior constrains) drown in round-off and the marginal variances come
    out wrong by orders of magnitude, while float64 keeps them to κ·u₆₄. The Jacobians stay in the
    network's dtype ``weights``; only their products are accumulated in float64, which made the
    fit of a 13k-weight MLP 1.5–1.9× slower than float32 on one CPU thread (S = 500–2000). Pass
    ``accumulate_dtype=torch.float32`` to trade that robustness for speed; a material jitter is
    then reported by :class:`RoundOffWarning`.
    """
    return requested if requested is not None else torch.promote_types(weights, torch.float64)


def cholesky_jitter(
    matrix: torch.Tensor, *, what: str = "matrix", retries: int = 6
) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric positive-definite ``matrix``, adding jitter
    ``10⁻¹⁰ … 10⁻⁵ × mean(diag)`` to the diagonal when the plain factorisation fails.

    :raises ValueError: naming ``what`` and its smallest eigenvalue when every retry fails.
    :warns RoundOffWarning: when the jitter that succeeded exceeds :data:`MATERIAL_JITTER` times the
        matrix's smallest eigenvalue (or that eigenvalue is not positive), with the sizes and the
        fix; the spectrum is computed (in float64) only on this path.
    """
    return _cholesky(matrix, what, retries)[0]


def _cholesky(matrix: torch.Tensor, what: str, retries: int = 6) -> tuple[torch.Tensor, float]:
    """:func:`cholesky_jitter`, returning ``(factor, jitter added)``."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) == 0:
        return factor, 0.0
    scale = float(matrix.diagonal().abs().mean()) or 1.0
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    for k in range(retries):
        jitter = scale * 10.0 ** (k - 10)
        factor, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if int(info) == 0:
            del eye
            _warn_if_material(matrix, jitter, what)
            return factor, jitter
    smallest = float(torch.linalg.eigvalsh(matrix.double()).min())
    raise ValueError(
        f"{what} is not positive definite (smallest eigenvalue {smallest:.3e}, still failing "
        f"with jitter {jitter:.1e}); increase prior_precision, accumulate in float64 "
        "(accumulate_dtype=torch.float64), or choose a smaller subnetwork."
    )


def _warn_if_material(matrix: torch.Tensor, jitter: float, what: str) -> None:
    evals = torch.linalg.eigvalsh(matrix.double())
    smallest, largest = float(evals[0]), float(evals[-1])
    del evals
    if smallest > 0 and jitter <= MATERIAL_JITTER * smallest:
        return
    if smallest > 0:
        size = (
            f"{jitter / smallest:.1e} × its smallest eigenvalue {smallest:.3e} (largest "
            f"{largest:.3e}): variances change by up to {100 * jitter / smallest:.3g}%"
        )
    else:
        size = (
            f"while its smallest eigenvalue is {smallest:.3e} ≤ 0 in {matrix.dtype} (largest "
            f"{largest:.3e}): round-off, not the data or the prior, set the variances along it"
        )
    fix = (
        "accumulate in float64 (accumulate_dtype=torch.float64, the default)"
        if matrix.dtype != torch.float64
        else "choose a smaller subnetwork"
    )
    warnings.warn(
        f"{what}: the Cholesky factorisation needed a jitter of {jitter:.1e} on the diagonal, "
        f"{size}. Raise prior_precision, or {fix}.",
        RoundOffWarning,
        stacklevel=3,
    )


def log_marginal(evals: torch.Tensor, theta: torch.Tensor, prior_s: torch.Tensor) -> torch.Tensor:
    r"""The λ-dependent part of the Laplace log marginal likelihood over the subnetwork,
    :math:`-\tfrac12\lambda_S\lVert\theta_S^*\rVert^2 + \tfrac S2\log\lambda_S
    - \tfrac12\sum_k\log(e_k + \lambda_S)`, with :math:`e` the GGN's eigenvalues."""
    s = theta.numel()
    return (
        -0.5 * prior_s * theta.square().sum()
        + 0.5 * s * torch.log(prior_s)
        - 0.5 * torch.log(evals + prior_s).sum()
    )


def tune_grid(
    score: Callable[[torch.Tensor], torch.Tensor], grid: torch.Tensor, *, refine: bool = True
) -> float:
    """The grid value maximising ``score``, refined on a finer log grid between its neighbours;
    warns when the best value sits at the edge of a grid of two or more values (one value just
    sets λ)."""
    values = torch.stack([score(v) for v in grid])
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, -math.inf))
    i = int(values.argmax())
    if len(grid) > 1 and i in (0, len(grid) - 1):
        meaning = (
            "the data prefer the MAP limit (almost no posterior width)"
            if i == len(grid) - 1
            else "the data prefer the widest posterior the grid allows"
        )
        warnings.warn(
            f"the best prior precision {float(grid[i]):.3g} sits at the edge of the grid "
            f"[{float(grid[0]):.3g}, {float(grid[-1]):.3g}]: {meaning}; widen the grid to "
            "look further.",
            UserWarning,
            stacklevel=3,
        )
    if not refine or len(grid) < 3:
        return float(grid[i])
    lo, hi = grid[max(i - 1, 0)].log(), grid[min(i + 1, len(grid) - 1)].log()
    fine = torch.linspace(float(lo), float(hi), 21, dtype=torch.float64).exp()
    fine_values = torch.stack([score(v) for v in fine])
    return float(fine[int(fine_values.argmax())])


def posterior_factor(ggn: torch.Tensor, prior_s: float | torch.Tensor) -> torch.Tensor:
    """Lower factor of Σ_S = (GGN + diag λ_S)⁻¹, with at most three S × S matrices alive
    besides ``ggn``; ``prior_s`` is one precision for every subnetwork weight or one each.

    :warns RoundOffWarning: when a factorisation needed a material jitter
        (:func:`cholesky_jitter`), or when H_S's condition number κ, bounded below by the
        ratio of its largest to smallest squared Cholesky pivot, makes the relative error of
        Σ_S, about κ·u in a dtype of unit round-off u, exceed :data:`MATERIAL_JITTER`.
    """
    precision = ggn.clone()
    precision.diagonal().add_(prior_s if isinstance(prior_s, float) else prior_s.to(precision))
    chol, jitter = _cholesky(precision, "H_S = GGN + λ_S I")
    del precision
    if not jitter:  # a jitter was judged by the spectrum already
        _warn_if_ill_conditioned(chol)
    cov = torch.cholesky_inverse(chol)
    del chol
    return cholesky_jitter(cov, what="the covariance Σ_S")


def _warn_if_ill_conditioned(chol: torch.Tensor) -> None:
    pivots = chol.diagonal().square()
    kappa = float(pivots.max() / pivots.min())
    eps = torch.finfo(chol.dtype).eps
    if kappa * eps > MATERIAL_JITTER:
        warnings.warn(
            f"H_S = GGN + λ_S I has condition number at least {kappa:.1e} in {chol.dtype}, "
            f"so round-off can change the posterior variances by about {kappa * eps:.1e} "
            "relative. Raise prior_precision, or accumulate in float64 "
            "(accumulate_dtype=torch.float64, the default).",
            RoundOffWarning,
            stacklevel=3,
        )


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
    """λ ↦ the validation log-likelihood of the linearized predictive (:func:`probit_logits`
    for classification, closed form with the noise σ for regression), from chunks
    ``(outputs (b, C), J_S (b, C, S), targets (b,))`` at the MAP values."""
    fs, qs, ys = [], [], []
    for out, jac, y in parts:
        fs.append(out.double())
        # One variance per logit (class or label), as in linearized_predictive.
        projected = (jac.double() @ evecs).square()
        qs.append(projected.sum(1, keepdim=True) if likelihood == "gaussian" else projected)
        ys.append(y)
    f, q, y = torch.cat(fs), torch.cat(qs), torch.cat(ys)

    def score(lam: torch.Tensor) -> torch.Tensor:
        var = q @ (1.0 / (evals + lam * ratio))
        return predictive_log_likelihood(f, var, y, likelihood, noise)

    return score


def predictive_log_likelihood(
    f: torch.Tensor, var: torch.Tensor, y: torch.Tensor, likelihood: str, noise: float | None
) -> torch.Tensor:
    """Log-likelihood of targets ``y`` under the linearized predictive with MAP outputs ``f``
    (n, C) and output variances ``var``: the probit (classification) or the Gaussian with the
    noise σ added (regression; ``var`` (n, 1), one output)."""
    if likelihood == "gaussian":
        assert noise is not None
        return dist.Normal(f.squeeze(-1), (var.squeeze(-1) + noise**2).sqrt()).log_prob(y).sum()
    logits = probit_logits(f, var)
    if likelihood == "bernoulli":
        return dist.Bernoulli(logits=logits.reshape(y.shape)).log_prob(y.to(f)).sum()
    return dist.Categorical(logits=logits).log_prob(y).sum()


def tune_precision(
    ggn: torch.Tensor,
    ratio: float,
    grid,
    refine: bool,
    theta: torch.Tensor | None = None,
    *,
    parts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    obs=None,
) -> float:
    """The λ of ``grid`` (default :math:`10^{-4} … 10^{4}`, 17 values; refined by
    :func:`tune_grid`) that maximises the marginal likelihood at the MAP subnetwork weights
    ``theta``, or, given validation ``parts`` and their observation ``obs``, the validation
    log-likelihood; λ_S = ``ratio`` · λ."""
    grid = torch.logspace(-4, 4, 17, dtype=torch.float64) if grid is None else grid
    grid = torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    check_positive("grid", grid)
    evals, evecs = torch.linalg.eigh(ggn.double())
    evals = evals.clamp_min(0)
    if parts is None:
        assert theta is not None
        score = marglik_score(evals, theta.double(), ratio)
    else:
        score = val_ll_score(parts, obs.likelihood, obs.noise, evals, evecs, ratio)
    return tune_grid(score, grid, refine=refine)
