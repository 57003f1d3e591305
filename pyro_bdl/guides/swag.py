r"""SWAG: a Gaussian posterior from the SGD trajectory (Maddox et al., NeurIPS 2019), as a guide.

:class:`AutoSWAG` is a thin :class:`~pyro.infer.autoguide.AutoContinuous` around
:class:`SWAGNormal`, the distribution over the packed vector; the numerical core (collection,
Σ_diag, sampling) is plain functions of tensors (:func:`swag_collect_`, :func:`swag_variance`,
:func:`swag_std`, :func:`swag_sample`). Where each site sits in the packed vector is the model's
:class:`~pyro_bdl.layout.SiteLayout`; per-site access (``median``, ``quantiles``,
``locs_and_scales``) is :class:`~pyro_bdl.guides.access.SiteAccess`. The method and its
conventions: docs/design/swag.md.

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
relative error ≲ T·κ·u with κ = |θ̄|/σ, against T·κ²·u for the difference of moments, u the
unit round-off of the mean's dtype). So the running mean θ̄ (buffer ``swag_mean``) is kept in
float64 whatever the weights' dtype: a float32 mean of weights near 10⁴ that move by 10⁻³ (κ ≈
10⁷ ≈ 1/u) is off by up to half its spacing there, 5·10⁻⁴, and the deviations measured from it
by as much as they are large; in float64 κ·u ≈ 10⁻⁹. M2 and the deviations D̂ stay in the
weights' dtype, which holds their small values to its relative precision; the Gaussian is
formed in the weights' dtype (:meth:`AutoSWAG.get_posterior` casts θ̄).

A checkpoint that stores the running second moment θ̄₂ (key ``swag_sq_mean``) instead of M2 is
converted on load (:func:`convert_second_moment`).

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistribution, TorchDistributionMixin
from pyro.infer.autoguide import AutoContinuous
from torch import nn

from pyro_bdl._grad_mode import sets_up
from pyro_bdl._validation import check_choice, check_positive, check_positive_int
from pyro_bdl.guides.access import SiteAccess, check_same_sites
from pyro_bdl.guides.flat_sites import PointMass, sample_sites, split_latent
from pyro_bdl.guides.state_checks import CheckedLoad
from pyro_bdl.layout import SiteLayout
from pyro_bdl.nn import init_to_network

__all__ = [
    "AutoSWAG",
    "NotCollectedError",
    "SWAGNormal",
    "convert_second_moment",
    "swag_collect_",
    "swag_sample",
    "swag_std",
    "swag_variance",
    "sync_counter",
]


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
    # The mean's own precision bounds that of δ' (see the module docstring): θ joins it in the
    # mean's dtype (a no-op when they agree), and δ' is taken in that dtype too.
    theta = theta.to(mean.dtype)
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
                f"deviations must have shape (K, {mean.shape[-1]}), K rows of mean's length; got "
                f"{tuple(deviations.shape)}. Stack one deviation θ - θ̄ per row."
            )
        if deviations.shape[0] == 1:
            raise ValueError(
                "deviations must have 0 rows (SWAG-diag) or at least 2; got 1. Collect at least "
                "one more deviation, or pass 0 rows for SWAG-diag."
            )
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


# --------------------------------------------------------------------------- state dicts

OLD_KEY, NEW_KEY = "swag_sq_mean", "swag_m2"


def convert_second_moment(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """Load-state-dict pre-hook: replace ``prefix + "swag_sq_mean"`` by the equivalent
    ``prefix + "swag_m2"`` in ``state_dict`` (in place; :meth:`torch.nn.Module.load_state_dict`
    hands its pre-hooks its own copy of the user's dict). Does nothing without the old key.

    :raises ValueError: when the old key comes with the new one, or without the mean and the
        counter it is converted with; nothing has been loaded then.
    """
    old = prefix + OLD_KEY
    if old not in state_dict:
        return
    needed = {prefix + "swag_mean", prefix + "swag_num_collected"}
    missing = sorted(needed - set(state_dict))
    if prefix + NEW_KEY in state_dict or missing:
        problem = (
            f"it also has {prefix + NEW_KEY!r}"
            if prefix + NEW_KEY in state_dict
            else f"it lacks {missing}, which the conversion needs"
        )
        raise ValueError(
            f"cannot load this AutoSWAG state dict: {old!r} (the second moment θ̄₂ of an older "
            f"version) is converted to the sum of squared deviations {prefix + NEW_KEY!r}, but "
            f"{problem}. Nothing was loaded. Pass the checkpoint as it was saved, or collect "
            "the SWAG statistics again."
        )
    sq_mean, mean = state_dict[old], state_dict[prefix + "swag_mean"]
    if sq_mean.shape != mean.shape:
        raise ValueError(
            f"cannot load this AutoSWAG state dict: {old!r} has shape {tuple(sq_mean.shape)} "
            f"but 'swag_mean' has {tuple(mean.shape)}. Nothing was loaded. The checkpoint is "
            "corrupt or comes from another model."
        )
    count = int(state_dict[prefix + "swag_num_collected"])
    variance = (sq_mean.double() - mean.double().square()).clamp_min_(0.0)
    state_dict[prefix + NEW_KEY] = variance.mul_(count).to(sq_mean.dtype)
    del state_dict[old]


def sync_counter(module: nn.Module, incompatible_keys) -> None:
    """Post-hook: the Python mirror of the counter buffer follows a loaded state dict."""
    counter = getattr(module, "swag_num_collected", None)
    if isinstance(counter, torch.Tensor):
        module._num_collected = int(counter)  # type: ignore[assignment]


# --------------------------------------------------------------------------- the guide

MODES = ("auto", "point", "swag")


class NotCollectedError(RuntimeError):
    """SWAG was asked for its posterior before two snapshots were collected."""


class AutoSWAG(CheckedLoad, SiteAccess, AutoContinuous):
    r"""SWAG (SWA-Gaussian) as a Pyro guide over every continuous latent site, packed.

    **Two roles.** Wherever its density is scored — every ELBO: ``SVI.step``,
    ``SVI.evaluate_loss`` and ``loss``, with gradients or under ``torch.no_grad()`` — and in a
    plain PyTorch loop, the guide is a point estimate, the parameter ``loc``, so SGD keeps
    training it and a validation loss scores the point being trained. It draws from the SWAG
    Gaussian when it runs for its draws alone: under :class:`~pyro.infer.Predictive`, which runs
    a guide with its densities masked out (``poutine.mask(mask=False)``), once at least two
    snapshots have been collected (before that it returns the point estimate, so validation
    during pre-training works). Grad mode plays no part. Choose a role explicitly with
    ``guide.mode = "point"`` or ``"swag"`` (default ``"auto"``, the rule above), or for a block
    with ``with guide.sampling():`` (SWAG draws, for instance around
    :func:`~pyro_bdl.predictive.sample_outputs`); :meth:`get_posterior`, :meth:`sample_weights`,
    :meth:`marginal_variances` and ``"swag"`` mode raise :class:`NotCollectedError` before two
    collections.

    :meth:`collect` adds the current ``loc`` to the running mean, the running sum of squared
    deviations (Welford's M2, stable in float32) and a ring buffer of the last ``rank``
    deviations: O(D) work into preallocated buffers. The statistics are registered buffers, so
    ``state_dict``/``load_state_dict`` round-trip them (call the guide once first, as for every
    Pyro autoguide; checkpoints of the older second moment are converted by
    :func:`convert_second_moment`). Memory: (rank + 2)·D numbers beyond ``loc`` (2·D for
    SWAG-diag; θ̄ is float64 whatever the weights' dtype) plus one integer counter, and D more
    with ``cache_std=True`` (2·D for weights in another dtype than float64).

    A sample costs one normal draw of D + K numbers, one read of the K × D deviations and two
    passes over D-vectors (three more to form Σ_diag^{1/2}, which ``cache_std=True`` keeps between
    collections); it never reads a value back to the host.

    Usage::

        guide = AutoSWAG(model, rank=20)
        svi = SVI(model, guide, pyro.optim.SGD({"lr": lr, "momentum": 0.9}), Trace_ELBO())
        for epoch in range(epochs):
            for x, y in loader:
                svi.step(x, y)
            if epoch >= swag_start:
                guide.collect()
        predictive = Predictive(model, guide=guide, num_samples=30, return_sites=["_RETURN"])
        probs = predictive(x_test)["_RETURN"].softmax(-1).mean(0)

    A plain PyTorch loop trains ``guide.parameters()`` (one ``guide(x, y)`` call creates them)::

        with pyro.poutine.condition(data=guide(x, y)):
            loss = torch.nn.functional.cross_entropy(bnn(x), y)

    :param callable model: a Pyro model, for example :func:`pyro_bdl.models.classifier`.
    :param int rank: K, how many recent deviations define the low-rank part (≥ 2).
    :param bool diag_only: SWAG-diag: keep no deviations, sample with Σ_diag only.
    :param float scale: multiplies the covariance when sampling: SWAG draws from
        N(θ̄, scale · (Σ_diag + D̂ᵀD̂/(K−1))), SWAG-diag from N(θ̄, scale · Σ_diag). The default 0.5
        is exactly the paper's sample θ̄ + (1/√2) Σ_diag^{1/2} z₁ + (1/√(2(K−1))) D̂ z₂.
    :param callable init_loc_fn: initial point estimate per site (default: the network's
        weights, :func:`~pyro_bdl.nn.init_to_network`).
    :param float var_clamp: ε of Σ_diag = max(M2 / T, ε) after T collections.
    :param bool cache_std: keep Σ_diag^{1/2} and θ̄ in the weights' dtype (not part of the
        state) from one sample to the next until the statistics change: about 20% cheaper
        samples for D more memory (2·D for weights in another dtype than float64).

    References:

    [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`,
        Wesley Maddox, Timur Garipov, Pavel Izmailov, Dmitry Vetrov, Andrew Gordon Wilson
        (NeurIPS 2019)
    [2] `Averaging Weights Leads to Wider Optima and Better Generalization`,
        Pavel Izmailov, Dmitrii Podoprikhin, Timur Garipov, Dmitry Vetrov, Andrew Gordon Wilson
        (UAI 2018)
    """

    loc: nn.Parameter
    swag_mean: torch.Tensor
    swag_m2: torch.Tensor
    swag_deviations: torch.Tensor
    swag_num_collected: torch.Tensor

    def __init__(
        self,
        model: Callable,
        *,
        rank: int = 20,
        diag_only: bool = False,
        scale: float = 0.5,
        init_loc_fn: Callable = init_to_network,
        var_clamp: float = 1e-30,
        cache_std: bool = False,
    ):
        check_positive_int("rank", rank)
        for name, flag in (("diag_only", diag_only), ("cache_std", cache_std)):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{name} must be a bool; got {type(flag).__name__} {flag!r}. Pass True or "
                    "False."
                )
        if not diag_only and rank < 2:
            raise ValueError(
                f"rank must be >= 2 for SWAG (the low-rank term divides by K − 1); got {rank}. "
                "Use rank >= 2, or diag_only=True for SWAG-diag."
            )
        check_positive("scale", scale, fix="Pass scale > 0 (0.5 is common).")
        check_positive("var_clamp", var_clamp, fix="Pass a tiny positive ε such as 1e-30.")
        self.rank = rank
        self.diag_only = diag_only
        self.scale = float(scale)
        self.var_clamp = float(var_clamp)
        self.cache_std = cache_std
        # (key of the statistics, θ̄ in the weights' dtype, σ)
        self._std: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._mode = "auto"
        # A Python mirror of the counter buffer: deciding whether to sample must not read a
        # device tensor (that would be a host–device synchronisation per sample).
        self._num_collected = 0
        super().__init__(model, init_loc_fn=init_loc_fn)
        self.register_load_state_dict_post_hook(sync_counter)

    # ------------------------------------------------------------------ set-up and state

    @sets_up
    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        # The sites at the prototype's shapes, as AutoContinuous packs them.
        layout, init = SiteLayout.from_trace(self.prototype_trace, full_plates=False)
        # A ``loc`` left in Pyro's param store under this guide's name (a model that has grown
        # a site since) would be picked up in place of ``init``: refuse before anything is set.
        store = pyro.get_param_store()
        try:
            name: str | None = self._pyro_get_fullname("loc")
        except AssertionError:  # a member inside another guide: no store name of its own yet
            name = None
        if name is not None and name in store:
            stored = store[name]
            try:
                check_same_sites(
                    type(self).__name__,
                    set_up=None,
                    now=layout.names,
                    set_up_size=stored.shape[-1],
                    now_size=layout.size,
                )
            except Exception:
                self.prototype_trace = None
                raise
        self.layout = layout
        self.loc = nn.Parameter(init)
        like = self.loc.detach()
        rows = 0 if self.diag_only else self.rank
        # float64 whatever the weights' dtype: the module docstring says why.
        self.register_buffer("swag_mean", torch.zeros_like(like, dtype=torch.float64))
        self.register_buffer("swag_m2", torch.zeros_like(like))
        self.register_buffer("swag_deviations", like.new_zeros(rows, like.shape[0]))
        self.register_buffer(
            "swag_num_collected", torch.zeros((), dtype=torch.long, device=like.device)
        )
        self._num_collected = 0
        # Plates (and the random subsample indices pyro.plate draws when it is built) are needed
        # only for latent sites inside a plate; weight sites of a lifted network never are.
        self._in_plates = any(site.frames for site in self.layout)

    def _split(self, latent: torch.Tensor) -> list[torch.Tensor]:
        return split_latent(self.layout, latent)

    def _unpack_latent(self, latent):
        """``(prototype site, unconstrained value)`` pairs, as
        :meth:`AutoContinuous._unpack_latent` yields them."""
        nodes = self.prototype_trace.nodes
        for site, value in zip(self.layout, self._split(latent)):
            yield nodes[site.name], value

    def _constrain(self, latent: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            site.name: site.constrain(value)
            for site, value in zip(self.layout, self._split(latent))
        }

    def _apply(self, fn, recurse: bool = True):
        # A cast of the guide (guide.float(), .to(device, dtype)) moves θ̄ but keeps it float64,
        # which the variances of weights far from zero need (module docstring).
        mean = self._buffers.get("swag_mean")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("swag_mean")
        if mean is not None and moved is not None and moved.dtype != mean.dtype:
            self._buffers["swag_mean"] = mean.to(moved.device)
        return out

    def _upgrade_state(self, state_dict, prefix):
        convert_second_moment(self, state_dict, prefix)  # the older second moment → M2

    def _state_errors(self, state_dict, prefix) -> list[str]:
        """Statistics that :meth:`collect` never gives (a corrupt state): a negative counter,
        NaN or inf moments, a negative M2 (which Σ_diag's floor would hide)."""
        errors = []
        count = state_dict.get(prefix + "swag_num_collected")
        if isinstance(count, torch.Tensor) and not count.is_meta and int(count) < 0:
            errors.append(f"{prefix + 'swag_num_collected'!r}: must be >= 0; got {int(count)}")
        for name in ("swag_mean", "swag_m2", "swag_deviations"):
            value = state_dict.get(prefix + name)
            if not isinstance(value, torch.Tensor) or value.is_meta:
                continue
            if not bool(torch.isfinite(value).all()):
                errors.append(f"{prefix + name!r}: contains NaN or inf, which collect never gives")
            elif name == "swag_m2" and value.numel() and float(value.min()) < 0:
                errors.append(
                    f"{prefix + name!r}: the sum of squared deviations must be >= 0; got min "
                    f"{float(value.min()):g}"
                )
        return errors

    @property
    def mode(self) -> str:
        """``"auto"`` (the point estimate wherever the guide's density is scored, SWAG draws once
        two snapshots exist when it runs with its densities masked out, as under ``Predictive``),
        ``"point"`` or ``"swag"``."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        self._mode = check_choice("mode", value, MODES)

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """Draw from the SWAG Gaussian inside the block (``mode = "swag"``), whatever runs the
        guide; the previous mode comes back afterwards.

        :raises NotCollectedError: on entry, before two snapshots (nothing changed then).
        """
        self.require_collected("sample its posterior")
        previous = self._mode
        self._mode = "swag"
        try:
            yield
        finally:
            self._mode = previous

    @property
    def num_collected(self) -> int:
        """How many snapshots :meth:`collect` has recorded."""
        return self._num_collected

    def _ensure_setup(self) -> None:
        self._require_setup("use its sites")

    def _require_setup(self, action: str) -> None:
        if self.prototype_trace is None:
            raise NotCollectedError(
                f"AutoSWAG cannot {action} before it has been set up; run the guide once "
                "(svi.step(x, y) or guide(x)) so it knows the model's sites."
            )

    def require_collected(self, action: str) -> None:
        """Raise :class:`NotCollectedError` naming ``action`` unless the guide is set up and has
        collected at least two snapshots (what sampling needs)."""
        self._require_setup(action)
        if self._num_collected < 2:
            raise NotCollectedError(
                f"AutoSWAG cannot {action} after {self._num_collected} collection(s); it needs "
                "at least 2. Call guide.collect() during the SWAG phase (once per epoch or every "
                "c steps) before sampling."
            )

    # ------------------------------------------------------------------ collection

    @torch.no_grad()
    def collect(self) -> None:
        """Record the current point estimate ``loc`` as one SWAG snapshot (O(D), in place)."""
        self._require_setup("collect")
        theta = self.loc.detach()
        if not bool(torch.isfinite(theta).all()):
            bad = int((~torch.isfinite(theta)).nonzero()[0, 0])
            raise ValueError(
                f"collect(): the weights contain NaN or inf (site {self._site_at(bad)!r}, "
                f"packed index {bad}); SWAG statistics were left unchanged. Lower the learning "
                "rate or check the data."
            )
        swag_collect_(
            theta, self.swag_mean, self.swag_m2, self.swag_deviations, self._num_collected
        )
        self._num_collected += 1
        self.swag_num_collected.fill_(self._num_collected)

    def _site_at(self, index: int) -> str:
        return next(site.name for site in self.layout if index < site.stop)

    def _stored_deviations(self) -> torch.Tensor:
        """The filled rows of the ring buffer (a view, no copy); none for SWAG-diag."""
        # Buffers straight from _buffers: PyroModule's attribute lookup costs ~10 µs each, which
        # adds up per sample on small networks.
        deviations = self._buffers["swag_deviations"]
        assert deviations is not None
        if self.diag_only:
            return deviations[:0]
        if deviations.shape[0] == 0:
            raise ValueError(
                "this guide was built with diag_only=True and kept no deviations; it can only "
                "sample SWAG-diag. Set guide.diag_only = True."
            )
        return deviations[: min(self._num_collected, deviations.shape[0])]

    # ------------------------------------------------------------------ posterior

    def _use_point_estimate(self) -> bool:
        if self._mode == "auto":
            # Predictive masks the guide's densities out: it wants draws, not a density. Every
            # ELBO scores the guide's density, so it gets the point being trained.
            return self._num_collected < 2 or poutine.get_mask() is not False
        return self._mode == "point"

    def get_posterior(self, *args, **kwargs) -> SWAGNormal:
        """The SWAG Gaussian over the packed latent vector (SWAG-diag if ``diag_only``)."""
        self.require_collected("build its posterior")
        mean, m2 = self._buffers["swag_mean"], self._buffers["swag_m2"]
        assert mean is not None and m2 is not None
        std = None
        if self.cache_std:
            mean, std = self._cached_moments(mean, m2)
        else:
            self._std = None  # cache_std switched off: give the memory back
            mean = _in_dtype(mean, m2.dtype)  # the float64 θ̄ in the weights' dtype (m2's)
        return SWAGNormal.from_moments(
            mean,
            m2,
            self._stored_deviations(),
            num_collected=self._num_collected,
            scale=self.scale,
            clamp=self.var_clamp,
            std=std,
        )

    def _cached_moments(
        self, mean: torch.Tensor, m2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """θ̄ in the weights' dtype and Σ_diag^{1/2}, recomputed only when the statistics
        changed: in-place writes (collect, load_state_dict) bump the tensors' version counters,
        and moving the guide replaces them, so the key needs no read of their values."""
        count = self._num_collected
        try:
            versions = (mean._version, m2._version)
        except RuntimeError:  # buffers created under torch.inference_mode keep no version
            return _in_dtype(mean, m2.dtype), swag_std(m2, count, clamp=self.var_clamp)
        key = (*versions, mean.data_ptr(), m2.data_ptr(), count, self.var_clamp)
        if self._std is None or self._std[0] != key:
            self._std = None  # free the stale copies before allocating the new ones
            std = swag_std(m2, count, clamp=self.var_clamp)
            self._std = (key, _in_dtype(mean, m2.dtype), std)
        return self._std[1], self._std[2]

    def sample_latent(self, *args, **kwargs) -> torch.Tensor:
        posterior: dist.Distribution
        if self._use_point_estimate():
            # validate_args=False: checking the constant log-density is a device→host sync.
            posterior = PointMass(self.loc, event_dim=1, validate_args=False)
        else:
            posterior = self.get_posterior()
        return pyro.sample(f"_{self._pyro_name}_latent", posterior, infer={"is_auxiliary": True})

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """One draw (or the point estimate) of every latent site, ``{site name: value}``.

        :meth:`AutoContinuous.forward` without its per-site overheads
        (:func:`~pyro_bdl.guides.flat_sites.sample_sites`); plates are built only if a site
        lives in one.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        latent = self.sample_latent(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs) if self._in_plates else {}
        return sample_sites(self.layout, latent, plates)

    @torch.no_grad()
    def sample_weights(self) -> dict[str, torch.Tensor]:
        """One SWAG draw of every latent site, ``{site name: value}`` (for conditioning a network
        with ``poutine.condition``, as :func:`~pyro_bdl.guides.batchnorm.predict_with_bn_refresh`
        does)."""
        return self._constrain(self.get_posterior().sample())

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The SWAG marginals: mean θ̄ and standard deviation of every unconstrained number."""
        posterior = self.get_posterior()
        return posterior.mean, posterior.variance.sqrt()

    def flat_median(self) -> torch.Tensor:
        """The SWA mean θ̄ once two snapshots exist; the point estimate ``loc`` before."""
        self._ensure_setup()
        if self._num_collected < 2:
            return self.loc.detach()
        return _in_dtype(self.swag_mean, self.loc.dtype)

    @torch.no_grad()
    def marginal_variances(self) -> dict[str, torch.Tensor]:
        """SWAG-diag marginal variances, ``scale · Σ_diag``, as ``{site name: tensor of the
        site's (unconstrained) shape}`` — what subnetwork selection ranks weights by. Defined
        for SWAG guides too (the diagonal statistics are always kept), where it is the diagonal
        part of the SWAG covariance, without the low-rank term."""
        self.require_collected("give marginal variances")
        variance = swag_variance(self.swag_m2, self._num_collected, clamp=self.var_clamp)
        variance.mul_(self.scale)
        return self.layout.unpack(variance)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself if it is already, else a copy on its device (``copy_``, which
    never reads a value back to the host)."""
    return t if t.dtype == dtype else torch.empty_like(t, dtype=dtype).copy_(t)
