r"""The SWAG Gaussian (Maddox et al., NeurIPS 2019): its numerical core and its distribution.

Plain functions of tensors (:func:`swag_collect_`, :func:`swag_variance`, :func:`swag_std`,
:func:`swag_sample`) and :class:`SWAGNormal`, the distribution over a packed vector that
:class:`~pyro_bdl.guides.AutoSWAG` samples from.

With T snapshots θ_1..θ_T collected, the running mean θ̄, the running sum of squared deviations
M2 = Σ_t (θ_t − θ̄)² (Welford's update), the diagonal Σ_diag = max(M2 / T, ε) and the last
K ≤ rank deviations D̂ (rows θ_t − θ̄_t), a sample is

    θ = θ̄ + √scale · [ Σ_diag^{1/2} ⊙ z₁ + (1/√(K−1)) D̂ᵀ z₂ ],
    z₁ ~ N(0, I_D), z₂ ~ N(0, I_K),

so the covariance is scale · (Σ_diag + D̂ᵀD̂/(K−1)); SWAG-diag draws θ̄ + √scale Σ_diag^{1/2} ⊙ z₁
(covariance scale · Σ_diag). The default scale = 0.5 is exactly the paper's sample
θ̄ + (1/√2) Σ_diag^{1/2} z₁ + (1/√(2(K−1))) D̂ᵀ z₂ (its covariance (Σ_diag + D̂ᵀD̂/(K−1))/2), and
SWAG and SWAG-diag share one convention: the same ``scale`` gives SWAG-diag the diagonal part
of SWAG's covariance.

Σ_diag is the population variance of the snapshots, as in the paper, but never formed as
θ̄₂ − θ̄² (the mean of the squares minus the squared mean): that difference cancels
catastrophically in float32 once the weights are ~10⁴ times larger than their movement, while
Welford's update loses accuracy only linearly in that ratio (Chan, Golub and LeVeque's bound:
relative error ≲ T·κ·u with κ = |θ̄|/σ, against T·κ²·u for the difference of moments). No
float32 statistic helps once κ nears 1/u ≈ 10⁷ (weights near 10³ that move by 10⁻⁴, below
float32's spacing of 6·10⁻⁵ there, which the float32 mean cannot follow): train such weights in
float64.

References:

[1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov,
    Pavel Izmailov, Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019)
[2] `Note on a Method for Calculating Corrected Sums of Squares and Products`, B. P. Welford
    (Technometrics, 1962)
[3] `Algorithms for Computing the Sample Variance: Analysis and Recommendations`, Tony F. Chan,
    Gene H. Golub, Randall J. LeVeque (The American Statistician, 1983)
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistribution, TorchDistributionMixin

__all__ = ["SWAGNormal", "swag_collect_", "swag_sample", "swag_std", "swag_variance"]


# --------------------------------------------------------------------------- numerical core


@torch.no_grad()
def swag_collect_(
    theta: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    deviations: torch.Tensor,
    num_collected: int,
) -> None:
    """Add snapshot ``theta`` (shape (D,)) to the SWAG statistics **in place**.

    ``num_collected`` is the number of snapshots already in ``mean``/``m2`` (0 restarts them).
    Welford's update: with n = ``num_collected`` + 1 and the deviation δ' = θ − θ̄_n from the
    *updated* mean, M2 += δ'² · n / (n − 1), which is the textbook (θ − θ̄_{n−1})(θ − θ̄_n) since
    δ' = (θ − θ̄_{n−1})(n − 1)/n. δ' also goes to row ``num_collected % K`` of ``deviations``
    (K, D), a ring buffer holding the last K deviations (K = 0 keeps none: SWAG-diag). Every
    update writes into the existing storage (``lerp_``/``addcmul_``/``out=``): O(D) work and no
    allocation that grows with K; SWAG-diag, with no ring row to write δ' into, allocates one
    transient D-vector.
    """
    n = num_collected + 1
    # lerp_ computes mean + w (θ − mean): the running average, exact for the first snapshot.
    mean.lerp_(theta, 1.0 / n)
    rank = deviations.shape[0]
    if rank:
        delta = torch.sub(theta, mean, out=deviations[num_collected % rank])
    else:
        delta = theta - mean
    if n == 1:
        m2.zero_()
    else:
        m2.addcmul_(delta, delta, value=n / (n - 1))


def swag_variance(m2: torch.Tensor, num_collected: int, *, clamp: float) -> torch.Tensor:
    """Σ_diag = max(M2 / T, ``clamp``) from T = ``num_collected`` snapshots: weights that never
    moved have M2 = 0 and get the floor ``clamp`` (M2 itself is never negative)."""
    return torch.div(m2, max(num_collected, 1)).clamp_min_(clamp)


def swag_std(m2: torch.Tensor, num_collected: int, *, clamp: float) -> torch.Tensor:
    """Σ_diag^{1/2}: :func:`swag_variance` followed by an in-place square root (one allocation)."""
    return swag_variance(m2, num_collected, clamp=clamp).sqrt_()


def swag_sample(
    mean: torch.Tensor,
    std: torch.Tensor,
    deviations: torch.Tensor,
    *,
    scale: float,
    sample_shape: torch.Size = torch.Size(),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw ``sample_shape`` samples of the SWAG Gaussian, ``std`` = Σ_diag^{1/2}; ``deviations``
    (K, D) with K = 0 gives SWAG-diag, K ≥ 2 full SWAG.

    For S draws the cost is the floor of the method: one normal draw of S·(D + K) numbers, one
    fused pass θ = θ̄ + c₁ σ ⊙ z₁ written over z₁'s own storage, and one GEMV (S = 1) or GEMM
    reading D̂ once, row by row and contiguously (it is row-major), that accumulates c₂ D̂ᵀ z₂ into
    θ in place. The only allocation is the returned sample, everything stays on ``mean``'s device,
    and nothing is read back to the host.
    """
    d, k = mean.shape[-1], deviations.shape[0]
    if k == 1:
        raise ValueError("the low-rank SWAG term needs at least 2 deviations (K − 1 ≥ 1).")
    sample_shape = torch.Size(sample_shape)
    s = sample_shape.numel()
    # z₁ and z₂ in one call (one pass of the generator); θ is then built in z₁'s storage.
    noise = torch.randn(s * (d + k), dtype=mean.dtype, device=mean.device, generator=generator)
    theta = noise[: s * d].view(*sample_shape, d)
    torch.addcmul(mean, theta, std, value=math.sqrt(scale), out=theta)
    if k:
        alpha = math.sqrt(scale / (k - 1))
        z2 = noise[s * d :]
        if sample_shape:
            theta.view(s, d).addmm_(z2.view(s, k), deviations, alpha=alpha)
        else:
            theta.addmv_(deviations.T, z2, alpha=alpha)
    return theta


# --------------------------------------------------------------------------- distribution


class SWAGNormal(TorchDistribution):
    r"""The SWAG Gaussian over a packed vector: N(θ̄, scale · (Σ_diag + D̂ᵀD̂/(K−1))), or
    N(θ̄, scale · Σ_diag) when ``deviations`` has no rows (SWAG-diag).

    Sampling costs O((K + 1) D); :meth:`log_prob` uses the Woodbury identity with a K × K
    capacitance matrix, built only when a density is asked for. :meth:`from_moments` builds it
    from the running statistics without computing Σ_diag until it is needed.

    :param torch.Tensor mean: θ̄, shape (D,).
    :param torch.Tensor variance: Σ_diag, shape (D,), positive (``None`` only from
        :meth:`from_moments`, which derives it).
    :param torch.Tensor deviations: D̂, shape (K, D) with K = 0 or K ≥ 2.
    :param float scale: multiplies the covariance (0.5 gives the paper's 1/√2 factors).
    """

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = False

    def __init__(
        self,
        mean: torch.Tensor,
        variance: torch.Tensor | None,
        deviations: torch.Tensor,
        *,
        scale: float = 1.0,
        validate_args=None,
    ):
        if deviations.dim() != 2 or deviations.shape[-1] != mean.shape[-1]:
            raise ValueError(
                f"deviations must have shape (K, {mean.shape[-1]}); got {tuple(deviations.shape)}."
            )
        if deviations.shape[0] == 1:
            raise ValueError("deviations must have 0 rows (SWAG-diag) or at least 2; got 1.")
        self.loc = mean
        self._variance = variance
        self._moments: tuple[torch.Tensor, int, float] | None = None
        self._std: torch.Tensor | None = None
        self.deviations = deviations
        self.scale = float(scale)
        super().__init__(torch.Size(), mean.shape, validate_args=validate_args)

    @classmethod
    def from_moments(
        cls,
        mean: torch.Tensor,
        m2: torch.Tensor,
        deviations: torch.Tensor,
        *,
        num_collected: int,
        scale: float,
        clamp: float,
        std: torch.Tensor | None = None,
    ) -> SWAGNormal:
        """The SWAG Gaussian of the running statistics θ̄ and M2 over ``num_collected``
        snapshots: Σ_diag = max(M2 / T, ``clamp``) is derived only when used (a sample needs
        only its square root); ``std``, if given, is that square root already computed."""
        self = cls(mean, None, deviations, scale=scale)
        self._moments, self._std = (m2, num_collected, clamp), std
        return self

    @property
    def diag_variance(self) -> torch.Tensor:
        """Σ_diag, shape (D,)."""
        if self._variance is None:
            assert self._moments is not None
            m2, count, clamp = self._moments
            self._variance = swag_variance(m2, count, clamp=clamp)
        return self._variance

    def _diag_std(self) -> torch.Tensor:
        if self._std is not None:
            return self._std
        if self._variance is None and self._moments is not None:
            m2, count, clamp = self._moments
            return swag_std(m2, count, clamp=clamp)
        return self.diag_variance.sqrt()

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, W) with covariance diag(a) + W Wᵀ, W of shape (D, K)."""
        k = self.deviations.shape[0]
        a = self.scale * self.diag_variance
        if k == 0:
            return a, self.deviations.T
        return a, self.deviations.T * math.sqrt(self.scale / (k - 1))

    @property
    def variance(self) -> torch.Tensor:
        a, w = self._factors()
        return a + w.pow(2).sum(-1)

    def sample(self, sample_shape=torch.Size()) -> torch.Tensor:
        with torch.no_grad():
            return swag_sample(
                self.loc,
                self._diag_std(),
                self.deviations,
                scale=self.scale,
                sample_shape=torch.Size(sample_shape),
            )

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        a, w = self._factors()
        r = value - self.loc
        d = r.shape[-1]
        maha = (r * r / a).sum(-1)
        logdet = a.log().sum()
        if w.shape[-1]:
            aw = w / a.unsqueeze(-1)  # A⁻¹W, (D, K)
            cap = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device) + w.T @ aw
            chol = torch.linalg.cholesky(cap)
            proj = (r @ aw).unsqueeze(-1)  # WᵀA⁻¹r, (..., K, 1)
            sol = torch.cholesky_solve(proj, chol).squeeze(-1)
            maha = maha - (proj.squeeze(-1) * sol).sum(-1)
            logdet = logdet + 2.0 * chol.diagonal().log().sum()
        return -0.5 * (d * math.log(2 * math.pi) + logdet + maha)

    def expand(self, batch_shape, _instance=None):
        # Pyro's plates (Predictive(parallel=True)) expand the distribution; the generic
        # ExpandedDistribution draws iid samples through :meth:`sample`, which is what we want.
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        return TorchDistributionMixin.expand(self, batch_shape, _instance)
