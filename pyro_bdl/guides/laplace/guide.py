r"""Subnetwork linearized Laplace as a Pyro guide (docs/design/laplace.md).

While the network trains, :class:`AutoSubnetLaplace` is a MAP point estimate (a ``Delta`` over
the packed weights, like Pyro's ``AutoLaplaceApproximation``). :meth:`~AutoSubnetLaplace.fit`
then computes the full-covariance GGN Laplace posterior over a subnetwork S of the weights,

.. math:: H_S = \sum_n J_S(x_n)^\top \Lambda(x_n) J_S(x_n) + \mathrm{diag}\,\lambda_S,

with λ_S the prior precision of each included weight (laplace-torch's meaning; the rule
``prior_scaling="subnetwork_fraction"`` uses λ·S/D instead), keeping every other weight at its
MAP value. λ is read from the prior declared in :func:`~pyro_bdl.bayesianize` (one precision
per weight) unless ``prior_precision=`` gives one.
The guide orchestrates: the :class:`~pyro_bdl.layout.SiteLayout` says where each weight sits,
:mod:`~pyro_bdl.guides.laplace.subnetwork` chooses S, the passes of
:mod:`~pyro_bdl.guides.laplace.model` read the model and compute the curvature with
:mod:`pyro_bdl.curvature` (:math:`J_S`, never over all D weights, within the budgets of
:mod:`~pyro_bdl.curvature.memory`), :mod:`~pyro_bdl.guides.laplace.posterior` turns it into the
posterior and the predictive, and :mod:`~pyro_bdl.guides.laplace.evidence` gives the marginal
likelihood and the search over λ and σ.

After ``fit`` the guide samples :math:`\theta = \theta^* + \mathrm{scatter}_S(L z)` so
``Predictive`` works, and :meth:`~AutoSubnetLaplace.predict` gives the linearized predictive.

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
    Immer et al., "Improving predictions of Bayesian neural nets via local linearization",
    AISTATS 2021.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pyro.infer.autoguide import AutoContinuous
from torch import nn

from pyro_bdl._grad_mode import differentiates, sets_up
from pyro_bdl._validation import check_choice, check_positive_int
from pyro_bdl.curvature.memory import check_memory
from pyro_bdl.guides.access import SiteAccess
from pyro_bdl.guides.copying import KeepsModelOnCopy, model_lost
from pyro_bdl.guides.flat_sites import PointMass, sample_sites, split_latent
from pyro_bdl.guides.laplace.batches import head, iter_batches
from pyro_bdl.guides.laplace.evidence import (
    default_grid,
    eigenbasis,
    evidence,
    layer_groups,
    marglik_score,
    optimize_marglik,
    structure_val_ll_score,
    tune_grid,
    tuning_search,
    val_ll_score,
)
from pyro_bdl.guides.laplace.model import (
    KeptObservation,
    Observation,
    check_reduce_fn,
    check_same_sites,
    check_supported,
    check_weight_dtype,
    declared_precision,
    eval_mode,
    fit_diag,
    fit_full,
    fit_kron,
    jacobians,
    leaf_slots,
    observe,
    raised_by_reduction,
    warn_if_not_at_mode,
)
from pyro_bdl.guides.laplace.padding import ByLength, check_trim_padding
from pyro_bdl.guides.laplace.posterior import (
    DiagPosterior,
    FullPosterior,
    KronPosterior,
    StructuredNormal,
    SubnetNormal,
    accumulation_dtype,
    check_accumulate_dtype,
    check_blockwise,
    posterior_factor,
)
from pyro_bdl.guides.laplace.predictive import (
    LINKS,
    heteroscedastic_mixture,
    jacobian_transform,
    output_variance,
    predictive,
    standard_draws,
)
from pyro_bdl.guides.laplace.state import (
    HESSIAN_STRUCTURES,
    NotFittedError,
    PackedState,
    one_precision,
)
from pyro_bdl.guides.laplace.subnetwork import parse_subnetwork
from pyro_bdl.guides.state_checks import CheckedLoad
from pyro_bdl.layout import SiteLayout
from pyro_bdl.nn.lift import init_to_network

__all__ = [
    "HESSIAN_STRUCTURES",
    "PRIOR_SCALINGS",
    "AutoLaplace",
    "AutoSubnetLaplace",
    "NotFittedError",
    "StructureAttributeError",
    "SubnetNormal",
]

#: Meanings of ``prior_precision`` over a subnetwork (see :class:`AutoSubnetLaplace`).
PRIOR_SCALINGS = ("per_weight", "subnetwork_fraction")


class StructureAttributeError(ValueError, AttributeError):
    """Raised by a property the guide's Hessian structure does not form (also an
    ``AttributeError``, so that ``hasattr`` probing reads it as absent)."""


class AutoSubnetLaplace(KeepsModelOnCopy, PackedState, CheckedLoad, SiteAccess, AutoContinuous):
    r"""Subnetwork linearized Laplace: a MAP guide while training, then a GGN Laplace posterior
    over a subnetwork S after :meth:`fit`, full-covariance by default, or Kronecker-factored or
    diagonal (``hessian_structure``); :class:`AutoLaplace` is the same family with
    laplace-torch's defaults.

    Usage::

        guide = AutoSubnetLaplace(model, subnetwork="largest_variance", size=1000)
        # ... train with SVI(model, guide, optim, Trace_ELBO()) as a MAP estimate ...
        guide.fit((x_train, y_train))
        probs = guide.predict(x_test, link="probit")

    :param callable model: a Pyro model whose weights are latent sites and with one observed
        site; a :class:`~pyro_bdl.models.NetworkModel` (:func:`pyro_bdl.models.classifier`,
        :func:`~pyro_bdl.models.regressor`) declares its network and likelihood, a hand-written
        model is read as :mod:`~pyro_bdl.guides.laplace.model` describes.
    :param subnetwork: ``"all"``, ``"last_layer"``, ``"random"``, ``"largest_variance"``, a list
        of site names or globs, or a list/LongTensor of packed weight indices.
    :param str hessian_structure: ``"full"`` (dense S × S, the default), ``"kron"`` (KFAC per
        ``Linear``/``Conv2d`` layer, bias folded in; the subnetwork must hold whole layers) or
        ``"diag"`` (the exact diagonal of the GGN). Every structure keeps its posterior, the
        tuned σ and the fit statistics in ``state_dict``.
    :param size: S for ``"random"``/``"largest_variance"``: a count or a fraction in (0, 1].
    :param variances: marginal variances for ``"largest_variance"``: ``"diagonal_laplace"``
        (computed in :meth:`fit`), a mapping site name -> tensor, or an
        :class:`~pyro_bdl.guides.AutoSWAG` guide (its ``marginal_variances()``, SWAG-diag).
    :param float prior_precision: λ of an isotropic Gaussian prior over all D weights, instead
        of the prior declared in :func:`~pyro_bdl.bayesianize` (default: that prior, one
        precision 1/s² per weight; :meth:`fit` raises
        :class:`~pyro_bdl.priors.NonGaussianPriorError` when it is not Gaussian). The buffer
        ``prior_precision`` holds λ: 0-dim when one value holds for every weight (given or
        tuned), else, after :meth:`fit`, the declared precision of each subnetwork weight.
    :param str prior_scaling: ``"per_weight"`` (default): λ is the prior precision of each
        included weight, λ_S = λ (laplace-torch's meaning); ``"subnetwork_fraction"``:
        λ_S = λ·S/D, the rule of Daxberger et al. (appendix C), which keeps the size of the
        linearised kernel of the D-weight prior when only S weights are kept.
    :param int seed: seed of the ``"random"`` rule.
    :param int batch_size: rows per Jacobian chunk in :meth:`predict`, and at most that many in
        :meth:`fit`.
    :param int chunk_memory: bytes one Jacobian chunk of :meth:`fit` may use for the network's
        forward graph, its layer-output gradients and temporaries; :meth:`fit` takes as many
        rows (≤ ``batch_size``) as fit. Default: ``max(2·S², batch_size·C·S)`` numbers (at least
        4 MiB), the size of the S-dependent part, so that the peak memory of :meth:`fit` hardly
        grows with the network. Raise it for speed on a network with large activations.
    :param accumulate_dtype: dtype of the ``"full"`` H_S and covariance (default float64, which a
        small prior precision needs: :func:`~pyro_bdl.guides.laplace.posterior.accumulation_dtype`);
        ``"kron"`` and ``"diag"`` always accumulate in float64 (far smaller than S × S).
    :param int max_memory: bytes :meth:`fit` may use for the S × S matrices and one Jacobian
        chunk (default: the memory available on the device).
    :param callable init_loc_fn: initial MAP values (default: the network's own weights).
    """

    #: Where each weight site sits in the packed vector (set by the first call of the guide).
    layout: SiteLayout
    #: The buffers ``fit`` sizes: a state's shapes replace the empty ones of an unfitted guide.
    _resizable_state = ("map_loc", "subnet_index", "ggn", "scale_tril", "prior_precision")

    def __init__(
        self,
        model,
        *,
        subnetwork: Any,
        hessian_structure: str = "full",
        size: int | float | None = None,
        variances: Any = "diagonal_laplace",
        prior_precision: float | None = None,
        prior_scaling: str = "per_weight",
        seed: int = 0,
        batch_size: int = 64,
        accumulate_dtype: torch.dtype | None = None,
        max_memory: int | None = None,
        chunk_memory: int | None = None,
        init_loc_fn=init_to_network,
    ):
        self.rule = parse_subnetwork(subnetwork, size=size, variances=variances, seed=seed)
        if prior_precision is not None:
            prior_precision = one_precision(prior_precision)
        check_choice("prior_scaling", prior_scaling, PRIOR_SCALINGS)
        check_choice("hessian_structure", hessian_structure, HESSIAN_STRUCTURES)
        if hessian_structure == "kron" and self.rule.kind in ("random", "largest_variance"):
            raise ValueError(
                f"hessian_structure='kron' needs whole layers; subnetwork={self.rule.kind!r} picks "
                "single weights. Use subnetwork='all', 'last_layer' or a list of layer site names, "
                "or hessian_structure='full' or 'diag'."
            )
        check_positive_int("batch_size", batch_size)
        if max_memory is not None:
            check_positive_int("max_memory", max_memory)
        if chunk_memory is not None:
            check_positive_int("chunk_memory", chunk_memory)
        check_accumulate_dtype(accumulate_dtype)
        check_supported(model)  # a NetworkModel's likelihood, before the MAP phase trains it
        super().__init__(model, init_loc_fn=init_loc_fn)
        self._user_model: tuple | None = (model,)  # as AutoGuide keeps it: no submodule
        self.prior_scaling = prior_scaling
        self._given_precision = prior_precision  # λ of a fit on a new subnetwork (None: declared)
        self.hessian_structure = hessian_structure
        self._structure: Any = None  # the kron/diag posterior (full lives in the buffers)
        self._saved_state: torch.Tensor | None = None  # get_extra_state of a loaded state
        self._stats: torch.Tensor | None = None  # fit statistics for the marginal likelihood
        self._noise: float | None = None  # a tuned Gaussian σ (None: the model's)
        self._noise0: float | None = None  # the model's σ, at which the GGN was computed
        self._likelihood = ""
        self.batch_size = batch_size
        self._observation = KeptObservation()
        self.accumulate_dtype = accumulate_dtype
        self.max_memory = max_memory
        self.chunk_memory = chunk_memory
        self.prior_precision: torch.Tensor
        # Empty until fit reads the declared prior, unless one value is given.
        given: list | float = [] if prior_precision is None else float(prior_precision)
        self.register_buffer("prior_precision", torch.tensor(given, dtype=torch.float64))
        for name in ("map_loc", "subnet_index", "ggn", "scale_tril"):
            self.register_buffer(name, torch.zeros(0))

    # ---- Pyro guide protocol -------------------------------------------------------------

    @sets_up
    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        # AutoContinuous keeps the subsampled sizes of plates, so the layout does too.
        self.layout, loc = SiteLayout.from_trace(self.prototype_trace, full_plates=False)
        self.loc = nn.Parameter(loc)

    def _ensure_setup(self) -> None:
        if self.prototype_trace is None:
            raise RuntimeError(
                "AutoSubnetLaplace has not seen the model yet; call the guide once with the "
                "model's arguments (for example guide(x, y) or one svi.step(x, y)) first."
            )

    def _unpack_latent(self, latent):
        parts = split_latent(self.layout, latent)
        return ((self.prototype_trace.nodes[s.name], p) for s, p in zip(self.layout, parts))

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """:meth:`AutoContinuous.forward` without its per-site overheads (:func:`.sample_sites`)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        latent = self.sample_latent(*args, **kwargs)
        plated = any(site.frames for site in self.layout)
        plates = self._create_plates(*args, **kwargs) if plated else {}
        return sample_sites(self.layout, latent, plates)

    @property
    def fitted(self) -> bool:
        return self.subnet_index.numel() > 0

    def get_posterior(self, *args, **kwargs):
        if not self.fitted:
            return PointMass(self.loc, event_dim=1, validate_args=False)  # flat_sites: why
        if self.hessian_structure == "full":
            return SubnetNormal(self.map_loc, self.subnet_index, self.scale_tril)
        return StructuredNormal(self.map_loc, self.subnet_index, self.posterior)

    @property
    def posterior(self):
        """The fitted posterior structure over the subnetwork
        (:mod:`~pyro_bdl.guides.laplace.posterior`): ``variances()``, ``apply_scale``,
        ``sample``, ``logdet``."""
        self._check_fitted("posterior")
        if self.hessian_structure == "full":
            lam = self._prior_s(self._precision_s(), self.subnet_index.numel(), self.layout.size)
            lam = torch.as_tensor(lam, dtype=torch.float64, device=self.ggn.device)
            return FullPosterior(self.ggn, lam, self._noise_scale(), self.scale_tril)
        if self._structure is None:
            self._structure = self._structure_from_state()
        return self._structure

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fitted:
            return self.loc, torch.zeros_like(self.loc)
        scale = torch.zeros_like(self.map_loc)
        scale[self.subnet_index] = self.posterior.variances().sqrt().to(scale.dtype)
        return self.map_loc, scale

    @property
    def covariance(self) -> torch.Tensor:
        """Σ_S (S × S), the posterior covariance of the subnetwork weights (``"full"`` only; the
        other structures give ``posterior.variances()``)."""
        self._check_fitted("covariance")
        if self.hessian_structure != "full":
            raise StructureAttributeError(
                f"covariance is the dense S × S matrix, which hessian_structure="
                f"{self.hessian_structure!r} never forms; use guide.posterior.variances() for "
                "the marginal variances."
            )
        return self.scale_tril @ self.scale_tril.T

    def __getattr__(self, name: str):
        # A property that raises an AttributeError (NotFittedError, StructureAttributeError)
        # sends Python here; give its own message rather than nn.Module's "no attribute".
        if isinstance(getattr(type(self), name, None), property):
            getattr(type(self), name).fget(self)
        return super().__getattr__(name)

    def _apply(self, fn, recurse: bool = True):
        # The kron/diag posterior and fit statistics follow .to() as buffers do; a loaded one not
        # yet rebuilt (that needs the model's layout) stays packed, rebuilt on map_loc's device.
        state = self._saved_state  # holds a kron/diag posterior when longer than 8 numbers
        waits = self._structure is None and state is not None and state.numel() > 8
        if waits and self.fitted and self.prototype_trace is not None:
            self._structure, waits = self._structure_from_state(), False
        if not waits:  # get_extra_state packs the same from the attributes set_extra_state set
            self._saved_state = None
        out = super()._apply(fn, recurse)
        if self._structure is not None:
            self._structure = self._structure.converted(fn)
        self._stats = None if self._stats is None else fn(self._stats)
        return out

    # ---- reading the model -------------------------------------------------------------------

    def _check_fitted(self, what: str) -> None:
        if not self.fitted:
            raise NotFittedError(
                f"AutoSubnetLaplace.{what} needs the Laplace posterior; train the MAP estimate, "
                "then call guide.fit(data) first."
            )

    @property
    def _raw_model(self):
        # The user's model without the guide's InitMessenger: predicting leaves the target site
        # unobserved, and a user's init_loc_fn need only know the weight sites.
        if self._user_model:
            return self._user_model[0]
        if self._model is None:
            raise model_lost(type(self).__name__, "fit or predict")
        return self.model

    def _observe(self, batch: tuple, *, without_targets: bool = False) -> Observation:
        check_weight_dtype(self._raw_model, self.loc)
        with eval_mode(self._raw_model):  # one row is enough to read the outputs' shape
            return observe(
                self._raw_model,
                self.layout,
                head(batch, 1),
                without_targets=without_targets,
                values=leaf_slots(self.layout, self.loc)[0],
                known=self.prototype_trace.nodes,  # type: ignore[attr-defined]
            )

    # ---- fitting ---------------------------------------------------------------------------

    def _precision(self, index=None, full=None) -> float | torch.Tensor:
        """λ of the weights ``index`` (of all D weights when ``None``): the one value held (given
        or tuned); the values held for this very subnetwork (declared or tuned per layer or
        weight); else the given λ, else the declared prior's precision (float64; taken from
        ``full`` when given)."""
        held = self.prior_precision
        if held.dim() == 0:
            return float(held)
        same = index is not None and self.fitted
        if same and torch.equal(index, self.subnet_index.to(index.device)):
            return held
        if self._given_precision is not None:
            return self._given_precision
        if index is None:
            return self.layout.gaussian_prior()[1].to(self.loc.device, torch.float64)
        return full[index] if full is not None else declared_precision(self.layout, index)

    def _precision_s(self) -> float | torch.Tensor:
        """λ of the fitted subnetwork weights: one value, or one per weight."""
        p = self.prior_precision
        return float(p) if p.dim() == 0 else p

    def _variances(self, data: Any, lam, obs: Observation, reduce_fn):
        external = self.rule.external_variances(self.layout)
        if external is not None or not self.rule.needs_diagonal_laplace:
            return external
        diag, _ = fit_diag(
            self._raw_model,
            self.layout,
            self.loc,
            data,
            obs,
            batch_size=self.batch_size,
            reduce_fn=reduce_fn,
            stats=False,
        )
        return 1.0 / (diag + lam)

    @differentiates
    def fit(
        self, data: Any, *, reduce_fn=None, check_mode: bool = True, trim_padding: bool = False
    ) -> AutoSubnetLaplace:
        r"""Compute the GGN Laplace posterior over the subnetwork at the current MAP values.

        A later ``fit`` (after more training, or on other data) replaces the posterior, the fit
        statistics and a tuned σ (the GGN is computed at the model's σ); it keeps the prior
        precision held, one value (given or tuned) or one per weight of the same subnetwork
        (declared, or tuned per layer or weight), and on another subnetwork starts again from
        ``prior_precision=``, else the declared prior.

        :param data: the training data, a tuple ``(x, y)`` of tensors or a DataLoader yielding
            ``(x, y)`` batches (the model's positional arguments).
        :param reduce_fn: for data-parallel fitting, a callable that sums a tensor over ranks
            (an all-reduce); each rank passes its own rows and every curvature statistic is
            summed once per block before it is factorised (:mod:`~pyro_bdl.guides.laplace.model`).
        :param bool check_mode: check that the weights are at a mode of the training loss
            (its gradient comes from the fit's own passes) and warn with
            :class:`~pyro_bdl.guides.laplace.model.NotAtModeWarning` when they are far from it
            (:func:`~pyro_bdl.guides.laplace.model.warn_if_not_at_mode`); ``False`` fits at
            any weights silently.
        :param bool trim_padding: the batches are a tokenizer's right-padded text batches
            (``x`` a mapping with an ``attention_mask`` of ones then zeros in each row): the
            rows of each batch are regrouped by length and every group trimmed to its longest
            row, so that no padding position beyond a group's width is computed
            (:class:`~pyro_bdl.guides.laplace.padding.ByLength`). The same posterior to float
            rounding for a network whose output for a row ignores its masked trailing positions
            (BERT-style encoders, right-padded causal decoders); not for a network that pools
            over padding. A batch without such a mask (a tensor ``x``, left padding, a mask
            not of zeros and ones, a row without a real token; for ``"kron"``, a row of one
            token) is refused.
        :returns: ``self``.
        :raises NonGaussianPriorError: when no ``prior_precision`` was given and a weight's
            declared prior is not Gaussian (before anything changes).
        """
        check_reduce_fn(reduce_fn)
        check_trim_padding(trim_padding)
        try:
            return self._fit(data, reduce_fn, check_mode, trim_padding)
        except BaseException as err:
            # Data parallel: a rank refusing before a reduction the others wait in joins their
            # agreement instead, so that every rank raises (the reduction's own errors are agreed).
            refuse = getattr(reduce_fn, "refuse", None)
            if refuse is not None and not raised_by_reduction(err):
                refuse(err)
            raise

    def _fit(self, data: Any, reduce_fn, check_mode: bool, trim_padding: bool) -> AutoSubnetLaplace:
        """:meth:`fit` (its arguments checked)."""
        first = next(iter_batches(data, self.batch_size))
        if trim_padding:
            # Every pass below sums over rows; ``first`` (the set-up and the memory measure)
            # keeps the untrimmed width, so the chunk sizes are those of the data as given.
            data = ByLength(data, self.batch_size, 2 if self.hessian_structure == "kron" else 1)
            data.check(first)  # a refusal before the set-up below (later rows: in the passes)
        if self.prototype_trace is None:
            self._setup_prototype(*first)
        obs = self._observe(first)
        # Checks first (nothing below changes state until the buffers are assigned).
        dtype = accumulation_dtype(self.accumulate_dtype, self.loc.dtype)
        count = self.rule.size_of(self.layout)
        if self.hessian_structure == "full":
            check_memory(
                count, obs.outputs, self.batch_size, dtype, self.loc.device, self.max_memory
            )
        # The diagonal Laplace needs λ of all D weights; otherwise the subnetwork's are read
        # site by site, so that no vector over all weights adds to the peak memory.
        lam = self._precision() if self.rule.needs_diagonal_laplace else None
        variances = self._variances(data, lam, obs, reduce_fn)
        index = self.rule.select(self.layout, variances).to(self.loc.device)
        lam_s = self._precision(index, full=lam)
        del lam, variances
        prior = self._prior_s(lam_s, index.numel(), self.layout.size)
        prior_t = torch.as_tensor(prior, dtype=torch.float64, device=self.loc.device)
        ggn, scale_tril, structure = torch.zeros(0), torch.zeros(0), None
        net = (self._raw_model, self.layout, self.loc)
        # The mode check's gradient comes from the fit's own passes (Jacobians and residuals).
        grad = torch.zeros(index.numel(), dtype=torch.float64, device=self.loc.device)
        grad_kw: dict[str, Any] = {"grad": grad} if check_mode else {}
        if self.hessian_structure == "full":
            ggn, stats = fit_full(
                *net,
                data,
                first,
                obs,
                index,
                dtype,
                batch_size=self.batch_size,
                chunk_memory=self.chunk_memory,
                reduce_fn=reduce_fn,
                **grad_kw,
            )
            scale_tril = posterior_factor(ggn, prior)
        elif self.hessian_structure == "diag":
            diag, diag_stats = fit_diag(
                *net, data, obs, index, batch_size=self.batch_size, reduce_fn=reduce_fn, **grad_kw
            )
            assert diag_stats is not None  # fit_diag gives them unless told not to
            stats = diag_stats
            structure = DiagPosterior(diag, prior_t)
        else:
            blocks, a_sums, g_sums, stats = fit_kron(
                *net, data, obs, index, batch_size=self.batch_size, reduce_fn=reduce_fn, **grad_kw
            )
            check_blockwise(prior_t, blocks)
            rows = float(stats[0])
            structure = KronPosterior.from_factors(
                blocks, a_sums, g_sums, rows, prior_t, index.numel()
            )
        self.map_loc = self.loc.detach().clone()
        self.subnet_index = index
        self.ggn, self.scale_tril = ggn, scale_tril
        self._structure, self._stats, self._noise = structure, stats, None
        self._saved_state = None
        self._likelihood, self._noise0 = obs.likelihood, obs.noise
        self.prior_precision = torch.as_tensor(lam_s, dtype=torch.float64, device=prior_t.device)
        if check_mode:
            theta = self.map_loc[index].double()
            warn_if_not_at_mode(grad + prior_t.to(theta) * theta, self.posterior)
        return self

    def _prior_s(self, lam, count: int, total: int):
        """λ_S from λ (one value or one per subnetwork weight)."""
        return lam * count / total if self.prior_scaling == "subnetwork_fraction" else lam

    # ---- predicting ------------------------------------------------------------------------

    def _jacobians(self, data: Any, obs: Observation, transform=None, check=None):
        """``(outputs, J_S, batch)`` at the MAP values (:func:`~.model.jacobians`)."""
        at = (self._raw_model, self.layout, self.map_loc, data, obs, self.subnet_index)
        return jacobians(*at, batch_size=self.batch_size, transform=transform, check=check)

    @differentiates
    def predict(
        self,
        x: torch.Tensor,
        *,
        link: str = "probit",
        num_samples: int = 1000,
        generator: torch.Generator | None = None,
    ):
        r"""The linearized predictive :math:`f(x,\theta^*) + J_S(x)(\theta_S - \theta_S^*)`.

        Categorical: class probabilities (n, C); Bernoulli: P(y = 1) (n,); Gaussian: the
        closed form ``(mean, variance)`` with the observation noise included (``link`` unused);
        heteroscedastic Gaussian: ``(E[μ], Var[μ] + E[σ²])`` (n,) each over the linearized
        outputs (μ, s), those of :meth:`predictive_distribution` (``num_samples`` draws from
        ``generator``).
        ``link``: ``"probit"`` (per logit; for two classes the binary probit of the logit
        difference :math:`f_1 - f_0`, which needs one backward pass a batch rather than two),
        ``"bridge"`` (Laplace bridge) or ``"mc"`` (``num_samples`` draws from ``generator``):
        :func:`~pyro_bdl.guides.laplace.predictive.linearized_predictive`.

        :param x: inputs, the model's first argument: a tensor or a dict of tensors.
        """
        check_choice("link", link, LINKS)
        check_positive_int("num_samples", num_samples)
        self._check_fitted("predict")
        if self._likelihood == "heteroscedastic":
            mixture = self.predictive_distribution(x, num_samples=num_samples, generator=generator)
            return mixture.mean, mixture.variance
        obs, chunks = self._predictive_chunks(x, link)
        noise = obs.noise if self._noise is None else self._noise
        return predictive(chunks, obs.likelihood, noise, obs.vector, link, num_samples, generator)

    @differentiates
    def predictive_distribution(
        self, x: torch.Tensor, *, num_samples: int = 1000, generator: torch.Generator | None = None
    ) -> torch.distributions.Distribution:
        r"""The linearized predictive of a regression model as a distribution over its targets
        (batch shape (n,), float64): ``Normal(mean, √variance)`` of :meth:`predict` under a
        Gaussian with one σ; under a heteroscedastic Gaussian the mixture of
        :math:`N(\mu, \sigma^2(s))` over ``num_samples`` draws of the linearized outputs
        :math:`(\mu, s) \sim N(f(x), J\Sigma J^\top)` from ``generator``
        (:func:`~pyro_bdl.guides.laplace.posterior.heteroscedastic_mixture`, which gives its
        Monte Carlo error), whose ``log_prob`` is the test log-likelihood.
        """
        check_positive_int("num_samples", num_samples)
        self._check_fitted("predictive_distribution")
        if self._likelihood not in ("gaussian", "heteroscedastic"):
            raise ValueError(
                f"predictive_distribution is the predictive of a regression model; this one's "
                f"likelihood is {self._likelihood!r}. Use predict(x) for class probabilities."
            )
        if self._likelihood == "gaussian":
            mean, var = self.predict(x)
            return torch.distributions.Normal(mean.double(), var.double().sqrt())
        obs, chunks = self._predictive_chunks(x, "probit")
        assert obs.split is not None
        outs, covs = zip(*((out, output_variance(jl, obs.likelihood)) for out, jl in chunks))
        z = standard_draws(num_samples, obs.outputs, generator)
        return heteroscedastic_mixture(torch.cat(outs), torch.cat(covs), obs.split, z)

    def _predictive_chunks(self, x, link: str):
        """``(observation, chunks (MAP outputs, J_S L))`` of the inputs ``x`` (checked)."""
        if not isinstance(x, (torch.Tensor, Mapping)):
            raise TypeError(
                f"x must be a torch.Tensor or a dict of tensors; got {type(x).__name__}. Pass "
                "several inputs as a dict of keyword arguments (a tuple reads as (x, y) here)."
            )
        check_weight_dtype(self._raw_model, self.loc)
        read = lambda: self._observe((x,), without_targets=True)  # noqa: E731
        obs = self._observation.get(self._raw_model, read)
        known = self.prototype_trace.nodes  # type: ignore[attr-defined]
        check = lambda trace: check_same_sites(trace, self.layout, known, targets=1)  # noqa: E731
        parts = self._jacobians((x,), obs, jacobian_transform(obs.likelihood, link), check)
        return obs, ((out, self.posterior.apply_scale(jac)) for out, jac, _ in parts)

    # ---- the evidence and the prior precision ----------------------------------------------

    @property
    def noise_scale(self) -> float | None:
        """The Gaussian observation noise σ the posterior and :meth:`predict` use: the tuned one
        (``tune_prior_precision(tune_noise=True)``), else the model's (``None`` unless the
        likelihood is Gaussian)."""
        return self._noise if self._noise is not None else self._noise0

    def _noise_scale(self, noise: float | None = None) -> float:
        """c = σ₀²/σ², the factor from the GGN at the model's σ₀ to the tuned σ (``noise``, by
        default the held one; ``None`` for none)."""
        noise = self._noise if noise is None else noise
        if noise is None:
            return 1.0
        assert self._noise0 is not None  # σ is tuned only under a Gaussian likelihood's σ₀
        return (self._noise0 / noise) ** 2

    def _sigma(self) -> torch.Tensor | None:
        """The tuned σ as a float64 tensor (``None``: the model's)."""
        return None if self._noise is None else torch.tensor(self._noise, dtype=torch.float64)

    def _set_prior(self, lam_s: torch.Tensor, sigma: float | None) -> None:
        """Hold λ_S (one per subnetwork weight) and σ, and refactor the posterior."""
        s, total = self.subnet_index.numel(), self.map_loc.numel()
        lam = lam_s / self._prior_s(1.0, s, total)
        same = bool(torch.all(lam == lam.reshape(-1)[0]))
        noise = sigma if sigma is not None else self._noise
        c = self._noise_scale(noise)
        prior: float | torch.Tensor = float(lam_s.reshape(-1)[0]) if same else lam_s
        # The posterior first: a factorisation that raises (or warns, under -W error) leaves
        # λ, σ and the posterior as they were.
        if self.hessian_structure == "full":
            self.scale_tril = posterior_factor(c * self.ggn, prior)
        else:
            self._structure = self._structure.with_prior(lam_s, c)
        self.prior_precision = lam.reshape(-1)[0].clone() if same else lam.clone()
        self._noise = noise
        self._saved_state = None  # a loaded extra state is stale now: pack the attributes

    def marginal_likelihood(self) -> float:
        r"""The Laplace log marginal likelihood :math:`\log p(\mathcal D)` at the held prior
        precision and σ (:func:`~pyro_bdl.guides.laplace.evidence.evidence`)."""
        self._check_fitted("marginal_likelihood")
        post = self.posterior
        theta = self.map_loc[self.subnet_index]
        lam = torch.as_tensor(post.lam, dtype=torch.float64)
        stats = self._fit_stats()
        value = evidence(post, theta, lam, stats, self._likelihood, self._noise0, self._sigma())
        return float(value)

    def _fit_stats(self) -> torch.Tensor:
        if self._stats is None:
            raise ValueError(
                "the marginal likelihood needs the fit statistics, which state_dict does not "
                "keep; call guide.fit(data) again."
            )
        return self._stats

    @differentiates
    def tune_prior_precision(
        self,
        data: Any = None,
        *,
        method: str = "marglik",
        search: str | None = None,
        grid: torch.Tensor | None = None,
        refine: bool = True,
        prior_structure: str = "scalar",
        tune_noise: bool = False,
        max_iter: int = 200,
    ) -> float | torch.Tensor:
        r"""Choose the prior precision by the Laplace marginal likelihood or the validation
        log-likelihood, update the posterior and return λ (a float for one value, else one per
        subnetwork weight).

        ``search="gradient"`` (the default for ``"marglik"`` without a ``grid``) maximises the
        evidence over log λ (``prior_structure``: ``"scalar"``, ``"layerwise"`` or
        ``"diagonal"``, the last not with ``"kron"``) and, with ``tune_noise`` (Gaussian
        likelihood), log σ, by L-BFGS (Immer et al. 2021). ``search="grid"`` searches one λ on
        a log grid (default :math:`10^{-4} … 10^{4}`, 17 values), then a finer grid between the
        best value's neighbours; it warns when the best value sits at the grid's edge (a
        one-value grid just sets λ, silently), and the gradient search when a λ ends outside
        :data:`~pyro_bdl.guides.laplace.evidence.SEARCH_RANGE` (both a
        :class:`~pyro_bdl.guides.laplace.evidence.PriorPrecisionBoundWarning`). The searches are
        those of :mod:`~pyro_bdl.guides.laplace.evidence`.

        :param data: validation ``(x, y)`` (or a DataLoader) for ``method="val_ll"``.
        :param str method: ``"marglik"`` or ``"val_ll"`` (probit predictive log-likelihood).
        """
        self._check_fitted("tune_prior_precision")
        search = tuning_search(
            method,
            search,
            grid=grid,
            data=data,
            prior_structure=prior_structure,
            tune_noise=tune_noise,
            max_iter=max_iter,
            likelihood=self._likelihood,
            hessian_structure=self.hessian_structure,
        )
        if search == "gradient":
            return self._tune_gradient(prior_structure, tune_noise, max_iter)
        return self._tune_grid(data, method, grid, refine)

    def _tune_gradient(self, prior_structure: str, tune_noise: bool, max_iter: int):
        stats = self._fit_stats()
        index = self.subnet_index
        post = self.posterior
        theta = self.map_loc[index].double()
        lam0 = torch.as_tensor(post.lam, dtype=torch.float64).expand(theta.shape)
        groups = layer_groups(self.layout, index)
        # The evidence rescales the GGN as computed (at σ₀) by (σ₀/σ)² itself.
        lam_s, sigma, _ = optimize_marglik(
            post,
            theta,
            groups.to(theta.device),
            lam0,
            stats,
            self._likelihood,
            self._noise0,
            prior_structure=prior_structure,
            tune_noise=tune_noise,
            max_iter=max_iter,
        )
        self._set_prior(lam_s, sigma)
        lam = self.prior_precision
        return float(lam) if lam.dim() == 0 else lam

    def _tune_grid(self, data: Any, method: str, grid, refine: bool) -> float:
        index = self.subnet_index
        s, total = index.numel(), self.map_loc.numel()
        ratio = self._prior_s(1.0, s, total)
        theta = self.map_loc[index]
        grid = default_grid(grid)
        if method == "val_ll":
            first = next(iter_batches(data, self.batch_size))
            if len(first) < 2:
                raise ValueError(
                    f"validation data must be (x, y); a batch held {len(first)} tensor(s). Pass "
                    "data=(x_val, y_val), or a DataLoader yielding (x, y)."
                )
            obs = self._observe(first)
            transform = jacobian_transform(obs.likelihood)  # the probit predict() returns
            parts = ((out, jac, b[1]) for out, jac, b in self._jacobians(data, obs, transform))
        if self.hessian_structure == "full" and self._noise is None:
            # In the GGN's eigenbasis every isotropic λ of the grid costs O(S).
            evals, evecs = eigenbasis(self.ggn)
            if method == "marglik":
                score = marglik_score(DiagPosterior(evals, evals.new_zeros(())), theta, ratio)
            else:
                score = val_ll_score(
                    parts, obs.likelihood, obs.noise, evals, evecs, ratio, split=obs.split
                )
        elif method == "marglik":
            score = marglik_score(
                self.posterior,
                theta,
                ratio,
                stats=self._fit_stats(),
                likelihood=self._likelihood,
                noise=self._noise0,
                sigma=self._sigma(),
            )
        else:
            noise = obs.noise if self._noise is None else self._noise
            c = self._noise_scale()
            score = structure_val_ll_score(
                self.posterior, parts, obs.likelihood, noise, c, ratio, split=obs.split
            )
        best = tune_grid(score, grid, refine=refine)
        lam_s = torch.full((s,), best * ratio, dtype=torch.float64, device=theta.device)
        self._set_prior(lam_s, None)
        return best


class AutoLaplace(AutoSubnetLaplace):
    """The Laplace guide family with laplace-torch's defaults: ``hessian_structure="kron"`` over
    ``subnetwork="all"`` weights; every argument of :class:`AutoSubnetLaplace` is accepted."""

    def __init__(self, model, *, subnetwork: Any = "all", hessian_structure: str = "kron", **kw):
        super().__init__(model, subnetwork=subnetwork, hessian_structure=hessian_structure, **kw)
