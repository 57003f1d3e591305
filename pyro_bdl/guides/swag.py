r"""SWAG: a Gaussian posterior from the SGD trajectory (Maddox et al., NeurIPS 2019), as a guide.

:class:`AutoSWAG` is a thin :class:`~pyro.infer.autoguide.AutoContinuous` around
:class:`~pyro_bdl.guides.swag_gaussian.SWAGNormal`; the numerical core (collection, Σ_diag,
sampling) is plain functions in :mod:`pyro_bdl.guides.swag_gaussian`, re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoContinuous
from torch import nn
from torch.distributions import biject_to

from pyro_bdl._validation import check_choice, check_positive, check_positive_int
from pyro_bdl.guides.swag_gaussian import (
    SWAGNormal,
    swag_collect_,
    swag_sample,
    swag_std,
    swag_variance,
)
from pyro_bdl.nn import init_to_network

__all__ = [
    "AutoSWAG",
    "NotCollectedError",
    "SWAGNormal",
    "swag_collect_",
    "swag_sample",
    "swag_std",
    "swag_variance",
]

MODES = ("auto", "point", "swag")


class NotCollectedError(RuntimeError):
    """SWAG was asked for its posterior before two snapshots were collected."""


# --------------------------------------------------------------------------- guide


class AutoSWAG(AutoContinuous):
    r"""SWAG (SWA-Gaussian) as a Pyro guide over every continuous latent site, packed.

    **Two roles.** While gradients are recorded (``SVI.step`` with any ELBO, or a plain PyTorch
    loop) the guide is a point estimate, the parameter ``loc``, so SGD keeps training it. Under
    ``torch.no_grad()`` — which is how :class:`~pyro.infer.Predictive` runs a guide — it draws
    from the SWAG Gaussian once at least two snapshots have been collected (before that it still
    returns the point estimate, so validation during pre-training works). Force either role with
    ``guide.mode = "point"`` or ``"swag"`` (default ``"auto"``); :meth:`get_posterior`,
    :meth:`sample_weights`, :meth:`marginal_variances` and ``"swag"`` mode raise
    :class:`NotCollectedError` before two collections.

    :meth:`collect` adds the current ``loc`` to the running mean, the running second moment and a
    ring buffer of the last ``rank`` deviations: O(D) work into preallocated buffers. The
    statistics are registered buffers, so ``state_dict``/``load_state_dict`` round-trip them (call
    the guide once first, as for every Pyro autoguide). Memory: (rank + 2)·D numbers beyond
    ``loc`` (2·D for SWAG-diag) plus one integer counter, and D more with ``cache_std=True``.

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
    :param float var_clamp: ε of Σ_diag = max(θ̄₂ − θ̄², ε).
    :param bool cache_std: keep Σ_diag^{1/2} (D numbers, not part of the state) from one sample
        to the next until the statistics change: about 20% cheaper samples for D more memory.

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
    swag_sq_mean: torch.Tensor
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
                raise TypeError(f"{name} must be a bool; got {type(flag).__name__}.")
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
        self._std: tuple[tuple, torch.Tensor] | None = None  # (key of the statistics, σ)
        self._mode = "auto"
        # A Python mirror of the counter buffer: deciding whether to sample must not read a
        # device tensor (that would be a host–device synchronisation per sample).
        self._num_collected = 0
        super().__init__(model, init_loc_fn=init_loc_fn)
        self.register_load_state_dict_post_hook(_sync_counter)

    # ------------------------------------------------------------------ set-up and state

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        self.loc = nn.Parameter(self._init_loc())
        like = self.loc.detach()
        rows = 0 if self.diag_only else self.rank
        self.register_buffer("swag_mean", torch.zeros_like(like))
        self.register_buffer("swag_sq_mean", torch.zeros_like(like))
        self.register_buffer("swag_deviations", like.new_zeros(rows, like.shape[0]))
        self.register_buffer(
            "swag_num_collected", torch.zeros((), dtype=torch.long, device=like.device)
        )
        self._num_collected = 0
        # Per-site slicing of the packed vector, computed once: Pyro's generic unpacking walks
        # the trace and re-derives shapes on every call (≈ 40 µs per site), which would dominate
        # the cost of one SWAG sample for small networks.
        self._packing = []
        pos = 0
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            shape = self._unconstrained_shapes[name]
            size = math.prod(shape)
            event_dim = site["fn"].event_dim + len(shape) - site["value"].dim()
            support = site["fn"].support
            transform = None if _is_real(support) else biject_to(support)
            self._packing.append((site, torch.Size(shape), pos, size, event_dim, transform))
            pos += size
        # Plates (and the random subsample indices pyro.plate draws when it is built) are needed
        # only for latent sites inside a plate; weight sites of a lifted network never are.
        self._in_plates = any(self._cond_indep_stacks[site["name"]] for site, *_ in self._packing)

    def _unpack_latent(self, latent):
        """Like :meth:`AutoContinuous._unpack_latent` (``(site, unconstrained value)`` pairs), from
        the slicing cached at set-up."""
        batch_shape = latent.shape[:-1]
        for site, shape, pos, size, event_dim, _ in self._packing:
            if batch_shape:
                shape = torch.broadcast_shapes(shape, batch_shape + (1,) * event_dim)
            yield site, latent[..., pos : pos + size].view(shape)

    def _constrain(self, latent: torch.Tensor) -> dict[str, torch.Tensor]:
        values = {}
        for (site, value), packing in zip(self._unpack_latent(latent), self._packing):
            transform = packing[-1]
            values[site["name"]] = value if transform is None else transform(value)
        return values

    @property
    def mode(self) -> str:
        """``"auto"`` (point estimate while gradients are recorded, SWAG under ``no_grad`` once
        two snapshots exist), ``"point"`` or ``"swag"``."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        self._mode = check_choice("mode", value, MODES)

    @property
    def num_collected(self) -> int:
        """How many snapshots :meth:`collect` has recorded."""
        return self._num_collected

    def _require_setup(self, action: str) -> None:
        if self.prototype_trace is None:
            raise NotCollectedError(
                f"AutoSWAG cannot {action} before it has been set up; run the guide once "
                "(svi.step(x, y) or guide(x)) so it knows the model's sites."
            )

    def _require_collected(self, action: str) -> None:
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
                f"collect(): the weights contain NaN or inf (site {self._site_of(bad)!r}, "
                f"packed index {bad}); SWAG statistics were left unchanged. Lower the learning "
                "rate or check the data."
            )
        swag_collect_(
            theta, self.swag_mean, self.swag_sq_mean, self.swag_deviations, self._num_collected
        )
        self._num_collected += 1
        self.swag_num_collected.fill_(self._num_collected)

    def _site_of(self, index: int) -> str:
        pos = 0
        for name, shape in self._unconstrained_shapes.items():
            pos += math.prod(shape)
            if index < pos:
                return name
        return "?"

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
            return torch.is_grad_enabled() or self._num_collected < 2
        return self._mode == "point"

    def get_posterior(self, *args, **kwargs) -> SWAGNormal:
        """The SWAG Gaussian over the packed latent vector (SWAG-diag if ``diag_only``)."""
        self._require_collected("build its posterior")
        mean, sq_mean = self._buffers["swag_mean"], self._buffers["swag_sq_mean"]
        assert mean is not None and sq_mean is not None
        if not self.cache_std:
            self._std = None  # cache_std switched off: give the memory back
        return SWAGNormal.from_moments(
            mean,
            sq_mean,
            self._stored_deviations(),
            scale=self.scale,
            clamp=self.var_clamp,
            std=self._cached_std(mean, sq_mean) if self.cache_std else None,
        )

    def _cached_std(self, mean: torch.Tensor, sq_mean: torch.Tensor) -> torch.Tensor:
        """Σ_diag^{1/2}, recomputed only when the statistics changed: in-place writes (collect,
        load_state_dict) bump the tensors' version counters, and moving the guide replaces them,
        so the key needs no read of their values."""
        try:
            versions = (mean._version, sq_mean._version)
        except RuntimeError:  # buffers created under torch.inference_mode keep no version
            return swag_std(mean, sq_mean, clamp=self.var_clamp)
        key = (*versions, mean.data_ptr(), sq_mean.data_ptr(), self.var_clamp)
        if self._std is None or self._std[0] != key:
            self._std = None  # free the stale copy before allocating the new one
            self._std = (key, swag_std(mean, sq_mean, clamp=self.var_clamp))
        return self._std[1]

    def sample_latent(self, *args, **kwargs) -> torch.Tensor:
        posterior: dist.Distribution
        if self._use_point_estimate():
            # validate_args=False: checking the constant log-density is a device→host sync.
            posterior = dist.Delta(self.loc, event_dim=1, validate_args=False)
        else:
            posterior = self.get_posterior()
        return pyro.sample(f"_{self._pyro_name}_latent", posterior, infer={"is_auxiliary": True})

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """One draw (or the point estimate) of every latent site, ``{site name: value}``.

        :meth:`AutoContinuous.forward` with the per-site work that is wasted here removed: the
        slicing is cached, real-valued sites skip the identity transform and its all-zeros
        log-Jacobian (two passes over every weight), the site Deltas skip argument validation
        (a device→host sync per site), and plates are built only if a site lives in one.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        latent = self.sample_latent(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs) if self._in_plates else {}
        no_jacobian = poutine.get_mask() is False
        result = {}
        for (site, value), packing in zip(self._unpack_latent(latent), self._packing):
            name, event_dim, transform = site["name"], site["fn"].event_dim, packing[-1]
            log_density: float | torch.Tensor = 0.0
            if transform is not None:
                unconstrained, value = value, transform(value)
                if not no_jacobian:
                    ladj = transform.inv.log_abs_det_jacobian(value, unconstrained)
                    log_density = sum_rightmost(ladj, ladj.dim() - value.dim() + event_dim)
            delta = dist.Delta(
                value, log_density=log_density, event_dim=event_dim, validate_args=False
            )
            with ExitStack() as stack:
                for frame in self._cond_indep_stacks[name]:
                    stack.enter_context(plates[frame.name])
                result[name] = pyro.sample(name, delta)
        return result

    @torch.no_grad()
    def sample_weights(self) -> dict[str, torch.Tensor]:
        """One SWAG draw of every latent site, ``{site name: value}`` (for conditioning a network
        with ``poutine.condition``, as :func:`~pyro_bdl.guides.batchnorm.predict_with_bn_refresh`
        does)."""
        return self._constrain(self.get_posterior().sample())

    def _loc_scale(self, *args, **kwargs):
        posterior = self.get_posterior()
        return posterior.mean, posterior.variance.sqrt()

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The SWA mean θ̄ once two snapshots exist; the point estimate ``loc`` before."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        loc = self.loc.detach() if self._num_collected < 2 else self.swag_mean
        return self._constrain(loc)

    @torch.no_grad()
    def marginal_variances(self) -> dict[str, torch.Tensor]:
        """SWAG-diag marginal variances, ``scale · Σ_diag``, as ``{site name: tensor of the
        site's (unconstrained) shape}`` — what subnetwork selection ranks weights by. Defined
        for SWAG guides too (the diagonal statistics are always kept), where it is the diagonal
        part of the SWAG covariance, without the low-rank term."""
        self._require_collected("give marginal variances")
        variance = swag_variance(self.swag_mean, self.swag_sq_mean, clamp=self.var_clamp)
        variance.mul_(self.scale)
        return {site["name"]: value for site, value in self._unpack_latent(variance)}


def _is_real(support) -> bool:
    """Whether ``support`` is the real line (possibly with event dims): no transform needed."""
    while hasattr(support, "base_constraint"):
        support = support.base_constraint
    return support is constraints.real


def _sync_counter(module: nn.Module, incompatible_keys) -> None:
    counter = getattr(module, "swag_num_collected", None)
    if isinstance(counter, torch.Tensor):
        module._num_collected = int(counter)  # type: ignore[assignment]
