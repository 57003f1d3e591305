r"""Subnetwork linearized Laplace as a Pyro guide (DESIGN.md 4.7).

While the network trains, :class:`AutoSubnetLaplace` is a MAP point estimate (a ``Delta`` over
the packed weights, like Pyro's ``AutoLaplaceApproximation``). :meth:`~AutoSubnetLaplace.fit`
then computes the full-covariance GGN Laplace posterior over a subnetwork S of the weights,

.. math:: H_S = \sum_n J_S(x_n)^\top \Lambda(x_n) J_S(x_n) + \lambda_S I, \qquad
          \lambda_S = \lambda\, S / D,

keeping every other weight at its MAP value. :math:`J_S` comes from
:func:`~pyro_bdl.curvature.subnet.subnet_jacobian`, which never forms a Jacobian over all D
weights. The network outputs are read from the model itself: the model runs with the weights
conditioned on their values and the observed site's distribution gives the outputs (``logits``
for ``Categorical``/``Bernoulli``, ``loc`` for ``Normal``, whose ``scale`` is the noise).
Examples must be independent given the weights (BatchNorm in eval mode: ``fit`` and
``predict`` switch ``model.net`` to eval mode when the model has one).

After ``fit`` the guide samples :math:`\theta = \theta^* + \mathrm{scatter}_S(L z)` so
``Predictive`` works, and :meth:`~AutoSubnetLaplace.predict` gives the linearized predictive.

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
    Immer et al., "Improving predictions of Bayesian neural nets via local linearization",
    AISTATS 2021.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoContinuous
from pyro.poutine.util import site_is_subsample
from torch import nn
from torch.distributions import biject_to

from pyro_bdl._validation import check_choice, check_positive, check_positive_int
from pyro_bdl.curvature.subnet import (
    ParamSlot,
    diagonal_ggn,
    jacobian_row_bytes,
    linearized_predictive,
    output_hessian_factor,
    subnet_ggn,
    subnet_jacobian,
    tune_grid,
)
from pyro_bdl.guides.laplace_posterior import (
    SubnetNormal,
    check_memory,
    marglik_score,
    posterior_factor,
    val_ll_score,
)
from pyro_bdl.guides.subnetwork import SiteInfo, iter_batches, parse_subnetwork, read_outputs
from pyro_bdl.nn.lift import init_to_network, site_spec

__all__ = ["AutoSubnetLaplace", "NotFittedError", "SubnetNormal"]


#: The least default ``chunk_memory`` (bytes).
MIN_CHUNK_MEMORY = 4 << 20


class NotFittedError(RuntimeError):
    """Raised when a post-hoc posterior is used before it was fitted."""


def _head(batch: tuple, n: int) -> tuple:
    """The first ``n`` rows of every tensor of a batch."""
    return tuple(t[:n] if isinstance(t, torch.Tensor) else t for t in batch)


class AutoSubnetLaplace(AutoContinuous):
    r"""Subnetwork linearized Laplace: a MAP guide while training, then a full-covariance GGN
    Laplace posterior over a subnetwork S after :meth:`fit`.

    Usage::

        guide = AutoSubnetLaplace(model, subnetwork="largest_variance", size=1000)
        # ... train with SVI(model, guide, optim, Trace_ELBO()) as a MAP estimate ...
        guide.fit((x_train, y_train))
        probs = guide.predict(x_test, link="probit")

    :param callable model: a Pyro model whose weights are latent sites (for example
        :func:`pyro_bdl.models.classifier` over a lifted network) and with one observed site.
    :param subnetwork: ``"all"``, ``"last_layer"``, ``"random"``, ``"largest_variance"``, a list
        of site names or globs, or a list/LongTensor of packed weight indices.
    :param size: S for ``"random"``/``"largest_variance"``: a count or a fraction in (0, 1].
    :param variances: marginal variances for ``"largest_variance"``: ``"diagonal_laplace"``
        (computed in :meth:`fit`), a mapping site name -> tensor, or an
        :class:`~pyro_bdl.guides.AutoSWAG` guide (its ``marginal_variances()``, SWAG-diag).
    :param float prior_precision: λ of the isotropic Gaussian prior over all D weights (match
        the prior used for MAP training: 1/s²).
    :param bool prior_rescaling: use λ_S = λ·S/D over the subnetwork (the paper's rule) instead
        of λ.
    :param int seed: seed of the ``"random"`` rule.
    :param int batch_size: rows per Jacobian chunk in :meth:`predict`, and at most that many in
        :meth:`fit`.
    :param int chunk_memory: bytes one Jacobian chunk of :meth:`fit` may use for the network's
        forward graph, its layer-output gradients and temporaries; :meth:`fit` takes as many
        rows (≤ ``batch_size``) as fit. Default: ``max(2·S², batch_size·C·S)`` numbers (at least
        4 MiB), the size of the S-dependent part, so that the peak memory of :meth:`fit` hardly
        grows with the network. Raise it for speed on a network with large activations.
    :param accumulate_dtype: dtype of H_S and the covariance (default: the weights' dtype;
        ``torch.float64`` is more robust for large S).
    :param int max_memory: bytes :meth:`fit` may use for the S × S matrices and one Jacobian
        chunk (default: the memory available on the device).
    :param callable init_loc_fn: initial MAP values (default: the network's own weights).
    """

    def __init__(
        self,
        model,
        *,
        subnetwork: Any,
        size: int | float | None = None,
        variances: Any = "diagonal_laplace",
        prior_precision: float = 1.0,
        prior_rescaling: bool = True,
        seed: int = 0,
        batch_size: int = 64,
        accumulate_dtype: torch.dtype | None = None,
        max_memory: int | None = None,
        chunk_memory: int | None = None,
        init_loc_fn=init_to_network,
    ):
        self.rule = parse_subnetwork(subnetwork, size=size, variances=variances, seed=seed)
        check_positive("prior_precision", prior_precision, fix="Pass λ = 1/prior_scale² > 0.")
        check_positive_int("batch_size", batch_size)
        if max_memory is not None:
            check_positive_int("max_memory", max_memory)
        if chunk_memory is not None:
            check_positive_int("chunk_memory", chunk_memory)
        if accumulate_dtype is not None and not (
            isinstance(accumulate_dtype, torch.dtype) and accumulate_dtype.is_floating_point
        ):
            raise TypeError(f"accumulate_dtype must be a float dtype; got {accumulate_dtype!r}.")
        super().__init__(model, init_loc_fn=init_loc_fn)
        # A tuple, as AutoGuide keeps its model: not a submodule, and dropped when pickled.
        self._user_model: tuple | None = (model,)
        self.prior_rescaling = bool(prior_rescaling)
        self.batch_size = batch_size
        self.accumulate_dtype = accumulate_dtype
        self.max_memory = max_memory
        self.chunk_memory = chunk_memory
        self.prior_precision: torch.Tensor
        self.register_buffer(
            "prior_precision", torch.tensor(float(prior_precision), dtype=torch.float64)
        )
        for name in ("map_loc", "subnet_index", "ggn", "scale_tril"):
            self.register_buffer(name, torch.zeros(0))

    # ---- Pyro guide protocol -------------------------------------------------------------

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        self.loc = nn.Parameter(self._init_loc())
        self._sites = []
        offset = 0
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            spec = site_spec(site)
            shape = self._unconstrained_shapes[name]
            module_id = id(spec.module) if spec is not None else None
            self._sites.append(SiteInfo(name, shape, offset, module_id))
            offset += math.prod(shape)

    @property
    def fitted(self) -> bool:
        return self.subnet_index.numel() > 0

    def get_posterior(self, *args, **kwargs):
        if self.fitted:
            return SubnetNormal(self.map_loc, self.subnet_index, self.scale_tril)
        return dist.Delta(self.loc, event_dim=1)

    def _loc_scale(self, *args, **kwargs):
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

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The fitted buffers are sized by fit(); give them the stored shapes before copying.
        for name in ("map_loc", "subnet_index", "ggn", "scale_tril"):
            key = prefix + name
            if key in state_dict:
                self._buffers[name] = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- evaluating the network ----------------------------------------------------------

    def _check_fitted(self, what: str) -> None:
        if not self.fitted:
            raise NotFittedError(
                f"AutoSubnetLaplace.{what} needs the Laplace posterior; train the MAP estimate, "
                "then call guide.fit(data) first."
            )

    def _slots(self, packed: torch.Tensor) -> tuple[dict, list[ParamSlot]]:
        """Leaf tensors (requiring grad) for every site, from a packed vector, and their slots."""
        values, slots = {}, []
        for site, unconstrained in self._unpack_latent(packed.detach()):
            # A detached view of ``packed``: a fresh leaf without copying the weights.
            u = unconstrained.detach().requires_grad_(True)
            transform = biject_to(site["fn"].support)
            value = transform(u)
            spec = site_spec(site)
            # The fast path needs the layer to use u itself; a constrained site (value ≠ u) takes
            # the generic path, which differentiates through the transform.
            if spec is not None and value is u:
                slots.append(ParamSlot(u, spec.module, spec.param_name))
            else:
                slots.append(ParamSlot(u, None, ""))
            values[site["name"]] = value
        return values, slots

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        net = getattr(self._user_model[0], "net", None) if self._user_model else None
        was = net.training if isinstance(net, nn.Module) else None
        if isinstance(net, nn.Module):
            net.eval()
        try:
            yield
        finally:
            if isinstance(net, nn.Module) and was:
                net.train()

    @property
    def _raw_model(self):
        # The user's model without the guide's InitMessenger: predicting leaves the target site
        # unobserved, and a user's init_loc_fn need only know the weight sites.
        return self._user_model[0] if self._user_model else self.model

    def _forward_fn(self, values: dict, args: tuple, kwargs: dict, obs_name: str):
        def forward() -> torch.Tensor:
            with poutine.block():
                conditioned = poutine.condition(self._raw_model, data=values)
                trace = poutine.trace(conditioned).get_trace(*args, **kwargs)
            if obs_name not in trace.nodes:
                raise ValueError(f"the model has no site {obs_name!r} any more.")
            return read_outputs(trace.nodes[obs_name]["fn"])[1]

        return forward

    def _detect(self, args: tuple, kwargs: dict, *, without_targets: bool = False) -> dict:
        """The observed site, the likelihood, the number of outputs and the noise. Called
        ``without_targets``, the site is the one sample site that is not a weight site."""
        with torch.no_grad(), poutine.block():
            trace = poutine.trace(self._raw_model).get_trace(*args, **kwargs)
        weights = {site.name for site in self._sites}
        observed = [
            n
            for n, s in trace.nodes.items()
            if s["type"] == "sample"
            and not site_is_subsample(s)
            and (s["is_observed"] or (without_targets and n not in weights))
        ]
        if len(observed) != 1:
            raise ValueError(
                f"AutoSubnetLaplace needs exactly one observed site in the model; found "
                f"{observed or 'none'}. Pass the targets as the model's y argument."
            )
        likelihood, out, noise = read_outputs(trace.nodes[observed[0]]["fn"])
        outputs = out.shape[-1] if out.dim() == 2 else 1
        return {
            "obs_name": observed[0],
            "likelihood": likelihood,
            "noise": noise,
            "C": outputs,
            "vector": out.dim() == 1,
        }

    def _batches(self, data: Any) -> Iterator[tuple]:
        return iter_batches(data, self.batch_size)

    # ---- fitting ---------------------------------------------------------------------------

    def _variances(self, data: Any, lam: float, meta: dict) -> torch.Tensor | None:
        external = self.rule.external_variances(self._sites)
        if external is not None or not self.rule.needs_diagonal_laplace:
            return external
        diag = torch.zeros(self.loc.numel(), dtype=torch.float64, device=self.loc.device)
        with self._eval_mode():
            for batch in self._batches(data):
                values, slots = self._slots(self.loc)
                forward = self._forward_fn(values, batch, {}, meta["obs_name"])
                diag += diagonal_ggn(
                    forward,
                    slots,
                    lambda f: output_hessian_factor(f, meta["likelihood"], meta["noise"]),
                ).double()
        return 1.0 / (diag + lam)

    def fit(self, data: Any) -> AutoSubnetLaplace:
        r"""Compute the GGN Laplace posterior over the subnetwork at the current MAP values.

        :param data: the training data, a tuple ``(x, y)`` of tensors or a DataLoader yielding
            ``(x, y)`` batches (the model's positional arguments).
        :returns: ``self``.
        """
        batches = self._batches(data)
        first = next(batches)
        if self.prototype_trace is None:
            self._setup_prototype(*first)
        with self._eval_mode():  # one row is enough to read the outputs' shape
            meta = self._detect(_head(first, 1), {})
        total = self.loc.numel()
        # Checks first (nothing below changes state until the buffers are assigned).
        dtype = self.accumulate_dtype or self.loc.dtype
        if self.rule.kind in ("random", "largest_variance"):
            count = self.rule.count(total)
        else:
            count = int(self.rule.select(self._sites).numel())
        item = torch.finfo(dtype).bits // 8
        check_memory(count, meta["C"], self.batch_size, dtype, self.loc.device, self.max_memory)
        lam = float(self.prior_precision)
        variances = self._variances(data, lam, meta)
        index = self.rule.select(self._sites, variances).to(self.loc.device)
        # The network-dependent memory (forward graph, layer-output gradients, unfolded inputs)
        # of a Jacobian chunk is kept within a budget the size of the S-dependent part, so the
        # peak stays O(B·C·S + S²) as the network grows: rows per chunk = budget / bytes per row.
        # The default, two S × S matrices, keeps this phase below the three S × S matrices of
        # the factorisation below; the 4 MiB floor keeps small subnetworks from crawling one
        # example at a time.
        budget = self.chunk_memory or max(
            item * max(2 * count * count, self.batch_size * meta["C"] * count), MIN_CHUNK_MEMORY
        )
        rows, select_numbers = self._chunk_rows(first, index, meta, budget, item)
        ggn = torch.zeros(index.numel(), index.numel(), dtype=dtype, device=self.loc.device)
        with self._eval_mode():
            for batch in iter_batches(data, rows):
                values, slots = self._slots(self.loc)
                forward = self._forward_fn(values, batch, {}, meta["obs_name"])
                jac, out = subnet_jacobian(
                    forward, slots, index, return_outputs=True, select_numbers=select_numbers
                )
                factor = output_hessian_factor(out, meta["likelihood"], meta["noise"])
                subnet_ggn(jac, factor, out=ggn)
                del jac, out, factor, forward, values, slots
        scale_tril = self._posterior_factor(ggn, lam, total)
        self.map_loc = self.loc.detach().clone()
        self.subnet_index = index
        self.ggn = ggn
        self.scale_tril = scale_tril
        return self

    def _chunk_rows(self, first: tuple, index, meta: dict, budget: int, item: int):
        """(rows per Jacobian chunk, numbers per entry-picking temporary) within ``budget``
        bytes: 3/4 for the rows' network memory, 1/4 for the three temporaries of
        :func:`~pyro_bdl.curvature.subnet.subnet_jacobian`. The bytes per row are measured as
        the difference between a two-row and a one-row chunk, which leaves out what a forward
        pass allocates once whatever the rows (the prior's tensors, for example)."""
        net = getattr(self._user_model[0], "net", None) if self._user_model else None
        exclude = [self.loc, *(t for t in first if isinstance(t, torch.Tensor))]
        if isinstance(net, nn.Module):
            exclude += [*net.parameters(), *net.buffers()]
        peaks = []
        with self._eval_mode():
            for n in (1, 2):
                part = _head(first, n)
                values, slots = self._slots(self.loc)
                forward = self._forward_fn(values, part, {}, meta["obs_name"])
                peaks.append(jacobian_row_bytes(forward, slots, index, exclude=exclude))
        n_first = next(t.shape[0] for t in first if isinstance(t, torch.Tensor))
        per_row = peaks[1] - peaks[0] if n_first > 1 else peaks[0]
        rows = max(1, min(self.batch_size, budget * 3 // 4 // max(per_row, 1)))
        return rows, max(1, budget // 4 // (3 * item))

    def _prior_s(self, lam: float, count: int, total: int) -> float:
        return lam * count / total if self.prior_rescaling else lam

    def _posterior_factor(self, ggn: torch.Tensor, lam: float, total: int) -> torch.Tensor:
        return posterior_factor(ggn, self._prior_s(lam, ggn.shape[0], total))

    # ---- predicting --------------------------------------------------------------------------

    def _jacobians(self, x: torch.Tensor, obs_name: str):
        """(outputs (b, C), J_S (b, C, S)) at the MAP values, ``batch_size`` rows at a time."""
        with self._eval_mode():
            for (xb,) in self._batches((x,)):
                values, slots = self._slots(self.map_loc)
                forward = self._forward_fn(values, (xb,), {}, obs_name)
                jac, out = subnet_jacobian(forward, slots, self.subnet_index, return_outputs=True)
                yield out, jac

    def predict(self, x: torch.Tensor, *, link: str = "probit", num_samples: int = 1000):
        r"""The linearized predictive :math:`f(x,\theta^*) + J_S(x)(\theta_S - \theta_S^*)`.

        Categorical: class probabilities (n, C); Bernoulli: P(y = 1) (n,); Gaussian: the
        closed form ``(mean, variance)`` with the observation noise included (``link`` unused).
        ``link="probit"`` divides the logits by :math:`\sqrt{1 + \pi \bar v / 8}`, where
        :math:`\bar v` is the variance of a logit (Bernoulli) or the mean variance of the pairwise
        logit differences (categorical; exact binary probit for C = 2, invariant to shifting the
        logits, and the argmax of the MAP network is kept); ``link="mc"`` averages the softmax
        over ``num_samples`` draws of the Gaussian GLM.

        :param torch.Tensor x: inputs, the model's first argument.
        """
        check_choice("link", link, ("probit", "mc"))
        check_positive_int("num_samples", num_samples)
        self._check_fitted("predict")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}.")
        with self._eval_mode():
            meta = self._detect((x[:1],), {}, without_targets=True)
        parts = []
        for out, jac in self._jacobians(x, meta["obs_name"]):
            jl = jac.to(self.scale_tril.dtype) @ self.scale_tril
            parts.append(
                linearized_predictive(
                    out.to(jl.dtype),
                    jl,
                    meta["likelihood"],
                    link=link,
                    num_samples=num_samples,
                    noise=meta["noise"],
                )
            )
        if meta["likelihood"] == "gaussian":
            mean, var = torch.cat([m for m, _ in parts]), torch.cat([v for _, v in parts])
            if meta["vector"]:  # the model's outputs have shape (B,)
                return mean.squeeze(-1), var.squeeze(-1)
            return mean, var
        return torch.cat(parts)

    # ---- prior precision ---------------------------------------------------------------------

    def tune_prior_precision(
        self,
        data: Any = None,
        *,
        method: str = "marglik",
        grid: torch.Tensor | None = None,
        refine: bool = True,
    ) -> float:
        r"""Choose λ by the Laplace marginal likelihood or by validation log-likelihood.

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
        grid = torch.logspace(-4, 4, 17, dtype=torch.float64) if grid is None else grid
        grid = torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
        check_positive("grid", grid)
        s, total = self.subnet_index.numel(), self.map_loc.numel()
        ratio = self._prior_s(1.0, s, total)
        evals, evecs = torch.linalg.eigh(self.ggn.double())
        evals = evals.clamp_min(0)
        if method == "marglik":
            score = marglik_score(evals, self.map_loc[self.subnet_index].double(), ratio)
        else:
            meta = self._val_meta(data)
            parts = self._val_parts(data, meta["obs_name"])
            score = val_ll_score(parts, meta["likelihood"], meta["noise"], evals, evecs, ratio)
        best = tune_grid(score, grid, refine=refine)
        self.prior_precision = torch.tensor(best, dtype=torch.float64)
        self.scale_tril = self._posterior_factor(self.ggn, best, total)
        return best

    def _val_meta(self, data: Any) -> dict:
        batch = next(self._batches(data))
        if len(batch) < 2:
            raise ValueError("validation data must be (x, y).")
        with self._eval_mode():
            return self._detect(_head(batch, 1), {})

    def _val_parts(self, data: Any, obs_name: str):
        """(outputs, J_S, targets) chunks of the validation data at the MAP values."""
        with self._eval_mode():
            for batch in self._batches(data):
                if len(batch) < 2:
                    raise ValueError("validation data must be (x, y).")
                values, slots = self._slots(self.map_loc)
                forward = self._forward_fn(values, batch[:1], {}, obs_name)
                jac, out = subnet_jacobian(forward, slots, self.subnet_index, return_outputs=True)
                yield out, jac, batch[1]
