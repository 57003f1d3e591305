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
:mod:`~pyro_bdl.guides.subnetwork` chooses S, :mod:`~pyro_bdl.guides.laplace_model` reads the
model, :mod:`pyro_bdl.curvature` computes :math:`J_S` (never over all D weights) and its GGN
within the budgets of :mod:`~pyro_bdl.curvature.memory`, and
:mod:`~pyro_bdl.guides.laplace_posterior` turns the GGN into the posterior and predictive.

After ``fit`` the guide samples :math:`\theta = \theta^* + \mathrm{scatter}_S(L z)` so
``Predictive`` works, and :meth:`~AutoSubnetLaplace.predict` gives the linearized predictive.

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
    Immer et al., "Improving predictions of Bayesian neural nets via local linearization",
    AISTATS 2021.
"""

from __future__ import annotations

from typing import Any

import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoContinuous
from torch import nn

from pyro_bdl._validation import check_choice, check_positive, check_positive_int
from pyro_bdl.curvature.ggn import diagonal_ggn, output_hessian_factor, subnet_ggn
from pyro_bdl.curvature.jacobian import subnet_jacobian
from pyro_bdl.curvature.memory import check_memory, chunk_budget, chunk_rows
from pyro_bdl.guides.access import SiteAccess
from pyro_bdl.guides.laplace_model import (
    Observation,
    check_supported,
    declared_precision,
    eval_mode,
    forward_fn,
    head,
    iter_batches,
    leaf_slots,
    network,
    observe,
)
from pyro_bdl.guides.laplace_posterior import (
    LINKS,
    SubnetNormal,
    accumulation_dtype,
    posterior_factor,
    predictive,
    tune_precision,
)
from pyro_bdl.guides.state_checks import SubnetLaplaceState
from pyro_bdl.guides.subnetwork import parse_subnetwork
from pyro_bdl.layout import SiteLayout
from pyro_bdl.nn.lift import init_to_network

__all__ = ["PRIOR_SCALINGS", "AutoSubnetLaplace", "NotFittedError", "SubnetNormal"]

#: Meanings of ``prior_precision`` over a subnetwork (see :class:`AutoSubnetLaplace`).
PRIOR_SCALINGS = ("per_weight", "subnetwork_fraction")


class NotFittedError(RuntimeError):
    """Raised when a post-hoc posterior is used before it was fitted."""


class AutoSubnetLaplace(SubnetLaplaceState, SiteAccess, AutoContinuous):
    r"""Subnetwork linearized Laplace: a MAP guide while training, then a full-covariance GGN
    Laplace posterior over a subnetwork S after :meth:`fit`.

    Usage::

        guide = AutoSubnetLaplace(model, subnetwork="largest_variance", size=1000)
        # ... train with SVI(model, guide, optim, Trace_ELBO()) as a MAP estimate ...
        guide.fit((x_train, y_train))
        probs = guide.predict(x_test, link="probit")

    :param callable model: a Pyro model whose weights are latent sites and with one observed
        site; a :class:`~pyro_bdl.models.NetworkModel` (:func:`pyro_bdl.models.classifier`,
        :func:`~pyro_bdl.models.regressor`) declares its network and likelihood, a hand-written
        model is read as :mod:`~pyro_bdl.guides.laplace_model` describes.
    :param subnetwork: ``"all"``, ``"last_layer"``, ``"random"``, ``"largest_variance"``, a list
        of site names or globs, or a list/LongTensor of packed weight indices.
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
    :param accumulate_dtype: dtype of H_S and the covariance (default float64, which a small
        prior precision needs; see ``laplace_posterior.accumulation_dtype``).
    :param int max_memory: bytes :meth:`fit` may use for the S × S matrices and one Jacobian
        chunk (default: the memory available on the device).
    :param callable init_loc_fn: initial MAP values (default: the network's own weights).
    """

    #: Where each weight site sits in the packed vector (set by the first call of the guide).
    layout: SiteLayout

    def __init__(
        self,
        model,
        *,
        subnetwork: Any,
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
            check_positive("prior_precision", prior_precision, fix="Pass λ = 1/prior_scale² > 0.")
        check_choice("prior_scaling", prior_scaling, PRIOR_SCALINGS)
        check_positive_int("batch_size", batch_size)
        if max_memory is not None:
            check_positive_int("max_memory", max_memory)
        if chunk_memory is not None:
            check_positive_int("chunk_memory", chunk_memory)
        if accumulate_dtype is not None and not (
            isinstance(accumulate_dtype, torch.dtype) and accumulate_dtype.is_floating_point
        ):
            raise TypeError(f"accumulate_dtype must be a float dtype; got {accumulate_dtype!r}.")
        check_supported(model)  # a NetworkModel's likelihood, before the MAP phase trains it
        super().__init__(model, init_loc_fn=init_loc_fn)
        self._user_model: tuple | None = (model,)  # as AutoGuide keeps it: no submodule
        self.prior_scaling = prior_scaling
        self.batch_size = batch_size
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
        nodes = self.prototype_trace.nodes
        for site, value in zip(self.layout, self.layout.split(latent)):
            yield nodes[site.name], value

    @property
    def fitted(self) -> bool:
        return self.subnet_index.numel() > 0

    def get_posterior(self, *args, **kwargs):
        if self.fitted:
            return SubnetNormal(self.map_loc, self.subnet_index, self.scale_tril)
        return dist.Delta(self.loc, event_dim=1)

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fitted:
            return self.loc, torch.zeros_like(self.loc)
        scale = torch.zeros_like(self.map_loc)
        scale[self.subnet_index] = self.scale_tril.square().sum(-1).sqrt().to(scale.dtype)
        return self.map_loc, scale

    @property
    def covariance(self) -> torch.Tensor:
        """Σ_S (S × S), the posterior covariance of the subnetwork weights."""
        self._check_fitted("covariance")
        return self.scale_tril @ self.scale_tril.T

    def __getstate__(self):
        self._user_model = None  # a model is often a closure, which cannot be pickled
        return super().__getstate__()

    # ---- evaluating the network ----------------------------------------------------------

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
        return self._user_model[0] if self._user_model else self.model

    def _forward(self, flat: torch.Tensor, args: tuple, obs: Observation):
        """(forward function, slots) of the network with the weights at the packed ``flat``."""
        values, slots = leaf_slots(self.layout, flat)
        return forward_fn(self._raw_model, values, args, obs.name), slots

    def _observe(self, batch: tuple, *, without_targets: bool = False) -> Observation:
        with eval_mode(self._raw_model):  # one row is enough to read the outputs' shape
            return observe(
                self._raw_model, self.layout, head(batch, 1), without_targets=without_targets
            )

    def _batches(self, data: Any, rows: int | None = None):
        return iter_batches(data, rows or self.batch_size)

    # ---- fitting ---------------------------------------------------------------------------

    def _precision(self, index=None, full=None) -> float | torch.Tensor:
        """λ: the one value held (given or tuned), else the declared prior's precision (float64)
        of the weights ``index`` (taken from ``full`` when given), or of all D weights."""
        if self.prior_precision.dim() == 0:
            return float(self.prior_precision)
        if index is None:
            return self.layout.gaussian_prior()[1].to(self.loc.device, torch.float64)
        return full[index] if full is not None else declared_precision(self.layout, index)

    def _variances(self, data: Any, lam, obs: Observation):
        external = self.rule.external_variances(self.layout)
        if external is not None or not self.rule.needs_diagonal_laplace:
            return external
        diag = torch.zeros(self.loc.numel(), dtype=torch.float64, device=self.loc.device)
        with eval_mode(self._raw_model):
            for batch in self._batches(data):
                forward, slots = self._forward(self.loc, batch, obs)
                diag += diagonal_ggn(
                    forward, slots, lambda f: output_hessian_factor(f, obs.likelihood, obs.noise)
                ).double()
        return 1.0 / (diag + lam)

    def fit(self, data: Any) -> AutoSubnetLaplace:
        r"""Compute the GGN Laplace posterior over the subnetwork at the current MAP values.

        :param data: the training data, a tuple ``(x, y)`` of tensors or a DataLoader yielding
            ``(x, y)`` batches (the model's positional arguments).
        :returns: ``self``.
        :raises NonGaussianPriorError: when no ``prior_precision`` was given and a weight's
            declared prior is not Gaussian (before anything changes).
        """
        first = next(self._batches(data))
        if self.prototype_trace is None:
            self._setup_prototype(*first)
        obs = self._observe(first)
        # Checks first (nothing below changes state until the buffers are assigned).
        dtype = accumulation_dtype(self.accumulate_dtype, self.loc.dtype)
        count = self.rule.size_of(self.layout)
        item = torch.finfo(dtype).bits // 8
        check_memory(count, obs.outputs, self.batch_size, dtype, self.loc.device, self.max_memory)
        # The diagonal Laplace needs λ of all D weights; otherwise the subnetwork's are read
        # site by site, so that no vector over all weights adds to the peak memory.
        lam = self._precision() if self.rule.needs_diagonal_laplace else None
        variances = self._variances(data, lam, obs)
        index = self.rule.select(self.layout, variances).to(self.loc.device)
        lam_s = self._precision(index, full=lam)
        del lam, variances
        budget = chunk_budget(count, obs.outputs, self.batch_size, item, self.chunk_memory)
        # Measured on the first rows; the weights and the data are not the chunk's memory.
        tensors = [t for t in first if isinstance(t, torch.Tensor)]
        net = network(self._raw_model)
        owned = [*net.parameters(), *net.buffers()] if net is not None else []
        exclude = [self.loc, *tensors, *owned]
        with eval_mode(self._raw_model):
            at = lambda n: self._forward(self.loc, head(first, n), obs)  # noqa: E731
            rows, select_numbers = chunk_rows(
                at, index, budget, self.batch_size, item, available=len(tensors[0]), exclude=exclude
            )
        ggn = torch.zeros(index.numel(), index.numel(), dtype=dtype, device=self.loc.device)
        with eval_mode(self._raw_model):
            for batch in self._batches(data, rows):
                forward, slots = self._forward(self.loc, batch, obs)
                jac, out = subnet_jacobian(
                    forward, slots, index, return_outputs=True, select_numbers=select_numbers
                )
                factor = output_hessian_factor(out, obs.likelihood, obs.noise)
                subnet_ggn(jac, factor, out=ggn)
                del jac, out, factor, forward, slots
        scale_tril = posterior_factor(ggn, self._prior_s(lam_s, index.numel(), self.layout.size))
        self.map_loc = self.loc.detach().clone()
        self.subnet_index = index
        self.ggn = ggn
        self.scale_tril = scale_tril
        if not isinstance(lam_s, float):
            self.prior_precision = lam_s
        return self

    def _prior_s(self, lam, count: int, total: int):
        """λ_S from λ (one value or one per subnetwork weight)."""
        return lam * count / total if self.prior_scaling == "subnetwork_fraction" else lam

    # ---- predicting --------------------------------------------------------------------------

    def _jacobians(self, data: Any, obs: Observation):
        """(outputs (b, C), J_S (b, C, S), batch) at the MAP values, ``batch_size`` rows at a
        time; the model gets the batch's first tensor (the inputs)."""
        with eval_mode(self._raw_model):
            for batch in self._batches(data):
                forward, slots = self._forward(self.map_loc, batch[:1], obs)
                jac, out = subnet_jacobian(forward, slots, self.subnet_index, return_outputs=True)
                yield out, jac, batch

    def predict(self, x: torch.Tensor, *, link: str = "probit", num_samples: int = 1000):
        r"""The linearized predictive :math:`f(x,\theta^*) + J_S(x)(\theta_S - \theta_S^*)`.

        Categorical: class probabilities (n, C); Bernoulli: P(y = 1) (n,); Gaussian: the
        closed form ``(mean, variance)`` with the observation noise included (``link`` unused).
        ``link``: ``"probit"`` (per logit), ``"bridge"`` (Laplace bridge) or ``"mc"``
        (``num_samples`` draws): :func:`~pyro_bdl.guides.laplace_posterior.linearized_predictive`.

        :param torch.Tensor x: inputs, the model's first argument.
        """
        check_choice("link", link, LINKS)
        check_positive_int("num_samples", num_samples)
        self._check_fitted("predict")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}.")
        obs = self._observe((x,), without_targets=True)
        chunks = (
            (out, jac.to(self.scale_tril.dtype) @ self.scale_tril)
            for out, jac, _ in self._jacobians((x,), obs)
        )
        return predictive(chunks, obs.likelihood, obs.noise, obs.vector, link, num_samples)

    # ---- prior precision ---------------------------------------------------------------------

    def tune_prior_precision(
        self,
        data: Any = None,
        *,
        method: str = "marglik",
        grid: torch.Tensor | None = None,
        refine: bool = True,
    ) -> float:
        r"""Choose one λ for every weight by the Laplace marginal likelihood or by validation
        log-likelihood.

        Searches a log-spaced grid (default :math:`10^{-4} … 10^{4}`, 17 values), then a finer
        grid between the best value's neighbours, updates the posterior and returns λ. Warns
        when the best value sits at the grid's edge (a one-value grid just sets λ, silently).

        :param data: validation ``(x, y)`` (or a DataLoader) for ``method="val_ll"``.
        :param str method: ``"marglik"`` or ``"val_ll"`` (probit predictive log-likelihood).
        """
        check_choice("method", method, ("marglik", "val_ll"))
        self._check_fitted("tune_prior_precision")
        if method == "val_ll" and data is None:
            raise ValueError("method='val_ll' needs validation data (x, y); pass data=.")
        s, total = self.subnet_index.numel(), self.map_loc.numel()
        ratio = self._prior_s(1.0, s, total)
        if method == "marglik":
            best = tune_precision(self.ggn, ratio, grid, refine, self.map_loc[self.subnet_index])
        else:
            first = next(self._batches(data))
            if len(first) < 2:
                raise ValueError("validation data must be (x, y).")
            obs = self._observe(first)
            parts = ((out, jac, batch[1]) for out, jac, batch in self._jacobians(data, obs))
            best = tune_precision(self.ggn, ratio, grid, refine, parts=parts, obs=obs)
        self.prior_precision = torch.tensor(best, dtype=torch.float64)
        self.scale_tril = posterior_factor(self.ggn, self._prior_s(best, s, total))
        return best
