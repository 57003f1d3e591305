r"""The passes of the Laplace guide family over the network: how a model is read (its
likelihood, its network outputs with the weights held at given values, the data in row chunks),
and the curvature passes of ``fit`` and the Jacobian pass of ``predict``, each a function of
explicit arguments (docs/design/laplace.md).

The linearized Laplace needs the network outputs :math:`f(x, \theta)` per example and the
Hessian of the negative log-likelihood with respect to them. The model is run with its weight
sites conditioned on the given values, and the outputs are read from the observed site's
distribution (``logits`` of a ``Categorical`` or ``Bernoulli``, ``loc`` of a ``Normal``), so any
model that computes its likelihood from the network works.

The contract is explicit for a :class:`~pyro_bdl.models.NetworkModel` (what the factories of
:mod:`pyro_bdl.models` return): the likelihood and the noise σ are the ones it declares (a point
estimate of σ is read at its current value; a learned σ is refused by :func:`check_supported`;
a heteroscedastic regressor's outputs are the network's, the mean and the variance read from
them by its ``split``, and its curvature is the Gaussian's Fisher,
:func:`~pyro_bdl.curvature.ggn.heteroscedastic_factor`), and its network is switched to eval mode
while ``fit`` and ``predict`` evaluate it, because the examples must be independent given the
weights (BatchNorm then uses its running statistics). A hand-written model declares neither:
the likelihood and σ are read from its one observed site's distribution, and its layers are
left in the mode they are in, so put any BatchNorm in eval mode before ``fit`` and ``predict``.

The fit passes (:func:`fit_full`, :func:`fit_diag`, :func:`fit_kron`) return the curvature of
one Hessian structure with the fit statistics of the data at the MAP
(:func:`~pyro_bdl.guides.laplace.evidence.fit_statistics`). Every statistic is a sum over
examples, so data-parallel ranks each pass their own rows and a ``reduce_fn`` (a sum over ranks,
such as an all-reduce) adds them before anything is divided or factorised: one call per
curvature block (the GGN, the diagonal, each Kronecker factor) and one for the statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro_bdl._validation import check_callable
from pyro_bdl.curvature.ggn import (
    LIKELIHOODS,
    Split,
    diagonal_ggn,
    linear_layer_ggn,
    mean_and_log_variance,
    output_hessian_factor,
    subnet_ggn,
)
from pyro_bdl.curvature.jacobian import ParamSlot, subnet_jacobian, widened
from pyro_bdl.curvature.kfac import kfac_sums
from pyro_bdl.curvature.memory import chunk_budget, chunk_rows, forward_rows
from pyro_bdl.guides.laplace.batches import batch_leaves, head, iter_batches
from pyro_bdl.guides.laplace.evidence import fit_statistics
from pyro_bdl.guides.laplace.mode import MODE_TOLERANCE_SD, NotAtModeWarning, warn_if_not_at_mode
from pyro_bdl.guides.laplace.posterior import KronBlock, kron_blocks
from pyro_bdl.layout import SiteLayout
from pyro_bdl.models import NetworkModel, mean_log_variance
from pyro_bdl.priors import NonGaussianPriorError, gaussian_prior

__all__ = [
    "MODE_TOLERANCE_SD",
    "KeptObservation",
    "NotAtModeWarning",
    "Observation",
    "ReduceFn",
    "check_reduce_fn",
    "check_same_sites",
    "check_supported",
    "check_weight_dtype",
    "declared_precision",
    "eval_mode",
    "fit_diag",
    "fit_full",
    "fit_kron",
    "forward_at",
    "forward_fn",
    "heteroscedastic_split",
    "jacobians",
    "leaf_slots",
    "network",
    "observe",
    "random_state_kept",
    "read_outputs",
    "residual",
    "training_loss_gradient",
    "warn_if_not_at_mode",
]

#: Sums a tensor over data-parallel ranks and returns the sum (same shape and dtype).
ReduceFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Observation:
    """The observed site of a model and what the curvature needs to know of it.

    :ivar str name: the site's name.
    :ivar str likelihood: ``"categorical"``, ``"bernoulli"``, ``"gaussian"`` or
        ``"heteroscedastic"`` (a Gaussian with σ(x) from the network).
    :ivar noise: the Gaussian observation noise σ (``None`` otherwise).
    :ivar int outputs: C, the number of outputs per example.
    :ivar bool vector: whether the model's outputs have shape ``(B,)`` rather than ``(B, C)``.
    :ivar split: ``outputs -> (mean, log σ²)`` of a heteroscedastic Gaussian (``None``
        otherwise); its outputs are the model's return value, the network's.
    """

    name: str
    likelihood: str
    noise: float | None
    outputs: int
    vector: bool
    split: Split | None = None


class KeptObservation:
    """The :class:`Observation` that ``predict`` reads from a
    :class:`~pyro_bdl.models.NetworkModel`, kept between calls: reading it runs the model on one
    row, a whole pass through the network's layers (a sixth of a 16-row batch's predictive on a
    6-layer transformer). What a NetworkModel fixes is kept (the site, the likelihood, the
    outputs' shape); σ, which training moves, is read afresh each call, and the caller checks the
    model's sites on every pass that uses it (``check`` of :func:`jacobians`). Any other model
    is read on every call. A copy starts empty: it reads its own model."""

    def __init__(self) -> None:
        self._kept: tuple[Any, Observation] | None = None

    def __getstate__(self) -> dict:
        return {"_kept": None}

    def get(self, model, read: Callable[[], Observation]) -> Observation:
        """The observation of ``model``: the kept one, else ``read()`` (kept if a NetworkModel)."""
        if self._kept is not None and self._kept[0] is model:
            obs = self._kept[1]
            return replace(obs, noise=None if obs.split is not None else model.noise_scale)
        obs = read()
        self._kept = (model, obs) if isinstance(model, NetworkModel) else None
        return obs


def network(model) -> nn.Module | None:
    """The network of a :class:`~pyro_bdl.models.NetworkModel`; ``None`` for any other model."""
    return model.net if isinstance(model, NetworkModel) else None


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """The network of a :class:`~pyro_bdl.models.NetworkModel` in eval mode inside the block
    (restored after); a hand-written model is left as it is."""
    net = network(model)
    # Each layer's own mode comes back, not net.train()'s: a network trained with some layers
    # held in eval mode (a frozen BatchNorm) keeps them there.
    modes = [(m, m.training) for m in net.modules()] if net is not None else []
    if net is not None:
        net.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def check_weight_dtype(model, loc: torch.Tensor) -> None:
    """Refuse packed weights ``loc`` of another floating dtype than the network of a
    :class:`~pyro_bdl.models.NetworkModel` (whose lifted layers keep their weights' dtype in
    their initial values): one of the two was converted after the guide was set up, and the
    network would mix them in its first product."""
    net = network(model)
    if net is None:
        return
    dtypes = {t.dtype for t in (*net.parameters(), *net.buffers()) if t.is_floating_point()}
    if len(dtypes) != 1 or loc.dtype in dtypes:
        return  # a mixed-dtype network has no one dtype to compare with
    (dtype,) = dtypes
    raise TypeError(
        f"the guide's weights are {loc.dtype} but the network's are {dtype}: the network or "
        "the guide was converted after the guide was set up. Convert both the same way, for "
        f"example net.to({dtype}) and guide.to({dtype}), or neither."
    )


def _unwrap(fn):
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def read_likelihood(fn) -> tuple[str, float | None]:
    """(likelihood, noise σ) of an observed site's distribution."""
    base = _unwrap(fn)
    if isinstance(base, torch.distributions.Categorical):
        return "categorical", None
    if isinstance(base, torch.distributions.Bernoulli):
        return "bernoulli", None
    if isinstance(base, torch.distributions.Normal):
        scale = torch.as_tensor(base.scale).detach()
        if scale.numel() > 1 and not torch.allclose(scale, scale.reshape(-1)[0].expand_as(scale)):
            raise ValueError(
                "the Normal observation noise of a hand-written model must be one fixed σ for "
                "the linearized Laplace; got a scale that varies across examples. Use "
                "models.regressor(net, N, σ), or models.heteroscedastic_regressor(net, N) for "
                "σ(x) from the network."
            )
        return "gaussian", float(scale.reshape(-1)[0])
    raise ValueError(
        f"unsupported likelihood {type(base).__name__} at the observed site; expected "
        "Categorical(logits=...), Bernoulli(logits=...) or Normal(loc, σ)."
    )


def read_outputs(fn) -> torch.Tensor:
    """The network outputs, (B, C) or (B,), behind an observed site's distribution."""
    base = _unwrap(fn)
    if isinstance(base, (torch.distributions.Categorical, torch.distributions.Bernoulli)):
        return base.logits
    if isinstance(base, torch.distributions.Normal):
        return base.loc
    read_likelihood(fn)  # raises, naming the unsupported distribution
    raise AssertionError("unreachable")


def observe(
    model,
    layout: SiteLayout,
    args: tuple,
    *,
    without_targets: bool = False,
    values=None,
    known: Collection[str] | None = None,
):
    """The :class:`Observation` of ``model(*args)``: its one observed site (called
    ``without_targets``, the one sample site that is not a weight site of ``layout``), the
    likelihood (declared by a :class:`~pyro_bdl.models.NetworkModel`, else read from the site)
    and the outputs' shape. ``values`` (site name -> value) holds the weights where they are,
    since weights drawn from a broad prior can overflow a deep network's outputs. ``known``
    (the sample sites the guide was set up with) refuses a model that has grown or lost a site
    since (:func:`check_same_sites`)."""
    if isinstance(model, NetworkModel):
        check_supported(model)
    run = poutine.condition(model, data=values) if values is not None else model
    # Reading the model draws any site it does not hold (the targets when called without them):
    # the global random state is left as it was, so that reading (or a refusal) moves nothing.
    with random_state_kept(args), torch.no_grad(), poutine.block():
        trace = poutine.trace(run).get_trace(*args)
    if known is not None:
        check_same_sites(trace, layout, known, targets=int(without_targets))
    observed = [
        n
        for n, s in trace.nodes.items()
        if _is_data_or_latent(s)  # pyro.deterministic records are not data
        and n not in layout
        and (s["is_observed"] or without_targets)
    ]
    if len(observed) != 1:
        raise ValueError(
            f"AutoSubnetLaplace needs exactly one observed site in the model (pyro.deterministic "
            f"sites aside); found {observed or 'none'}. Pass the targets as the model's y "
            "argument."
        )
    fn = trace.nodes[observed[0]]["fn"]
    split = heteroscedastic_split(model)
    if split is not None:
        likelihood, noise = "heteroscedastic", None
    elif isinstance(model, NetworkModel):
        likelihood, noise = model.likelihood, model.noise_scale
    else:
        likelihood, noise = read_likelihood(fn)
    out = trace.nodes["_RETURN"]["value"] if split is not None else read_outputs(fn)
    outputs = out.shape[-1] if out.dim() == 2 else 1
    return Observation(observed[0], likelihood, noise, outputs, out.dim() == 1, split)


def random_state_kept(args: Any) -> contextlib.AbstractContextManager:
    """The global random state (the CPU's and that of the CUDA devices the tensors of ``args``
    are on) restored after the block: a model run without its targets draws them."""
    cuda = {t.device.index or 0 for t in batch_leaves(args).values() if t.is_cuda}
    return torch.random.fork_rng(devices=sorted(cuda))


def heteroscedastic_split(model) -> Split | None:
    """The map ``outputs -> (mean, log σ²)`` of a
    :func:`~pyro_bdl.models.heteroscedastic_regressor` (its ``split``, else
    :func:`~pyro_bdl.models.mean_log_variance`); ``None`` for any other model."""
    if isinstance(model, NetworkModel) and model.noise == "heteroscedastic":
        return model.split or mean_log_variance
    return None


def _is_data_or_latent(site: dict) -> bool:
    return (
        site["type"] == "sample"
        and not site_is_subsample(site)
        and not site["infer"].get("_deterministic")
    )


def check_same_sites(trace, layout: SiteLayout, known: Collection[str], *, targets: int = 0):
    """Refuse a model whose trace has latent sites the guide was not set up with (``known``, the
    latent sites of its prototype), or lacks one of its weight sites: the packed weights no
    longer describe the model, and a new site would be drawn from its prior at every pass.
    ``targets``: how many unobserved sites are the model's targets (1 when called without
    them)."""
    new = [
        n
        for n, s in trace.nodes.items()
        if _is_data_or_latent(s) and not s["is_observed"] and n not in known
    ]
    missing = [n for n in layout.names if n not in trace.nodes]
    if len(new) > targets or missing:
        parts = [f"new sites {new}" + (" (one is the target)" if targets else "")] if new else []
        parts += [f"missing sites {missing}"] if missing else []
        raise ValueError(
            f"the model has changed since the guide was set up: {' and '.join(parts)}; the "
            f"guide packs {layout.names}. Create a new guide for the changed model, train its "
            "MAP estimate and fit it."
        )


def check_supported(model) -> None:
    """Refuse a :class:`~pyro_bdl.models.NetworkModel` whose likelihood the linearized Laplace
    cannot take: a token-level model, or a Gaussian whose σ is a latent site (the GGN and the
    predictive hold the weights' posterior only). Other models pass (a hand-written one's
    likelihood is read from the observed site at :meth:`fit`)."""
    if not isinstance(model, NetworkModel):
        return
    if model.likelihood not in LIKELIHOODS:
        raise ValueError(
            f"AutoSubnetLaplace does not support likelihood={model.likelihood!r} (a token-level "
            "language model): its GGN over every token position is not implemented. Use a "
            "sequence classifier (pyro_bdl.models.classifier on a pooled output) for Laplace, or "
            "AutoSWAG or a variational guide for the language model."
        )
    if model.likelihood == "gaussian" and model.noise == "learned":
        raise ValueError(
            "AutoSubnetLaplace with a Gaussian likelihood needs σ known or from the network, "
            "but σ is a latent site (noise='learned'), which the posterior over the weights "
            "does not cover. Use regressor(..., noise='point') (σ fitted with the MAP weights "
            "and held at its estimate), noise='fixed', heteroscedastic_regressor (σ(x) from "
            "the network), or a variational guide (AutoMeanField, AutoRadial) or AutoSWAG."
        )


def leaf_slots(
    layout: SiteLayout, flat: torch.Tensor, wanted: set[int] | None = None
) -> tuple[dict, list[ParamSlot]]:
    """Every site's value from the packed unconstrained ``flat`` (fresh leaves that require
    grad, views of ``flat``), and the :class:`~pyro_bdl.curvature.ParamSlot` of each site.

    With ``wanted`` (the positions in ``layout`` of a subnetwork's sites, :func:`sites_touched`)
    only those sites require grad: nothing is differentiated with respect to the others, so a
    forward pass records no graph before the first layer of the subnetwork (the last-layer
    fit's base runs as under ``no_grad``); the values are the same."""
    values, slots = {}, []
    for k, (site, block) in enumerate(zip(layout, layout.split(flat.detach()))):
        u = block.detach().requires_grad_(wanted is None or k in wanted)
        value = site.constrain(u)
        # The hook path needs the layer to use u itself; a constrained site (value ≠ u) takes
        # the generic path, which differentiates through the transform.
        # A weight tied into several layers is read by all of them: only the generic path
        # (autograd through the whole forward) sees every use.
        tied = site.spec is not None and bool(site.spec.alias_layers)
        if site.module is not None and value is u and not tied:
            slots.append(ParamSlot(u, site.module, site.param_name or ""))
        else:
            slots.append(ParamSlot(u, None, ""))
        values[site.name] = value
    return values, slots


def sites_touched(layout: SiteLayout, index: torch.Tensor) -> set[int]:
    """Positions in ``layout`` of the sites holding at least one packed position of ``index``
    (a pass over the data takes it once: ``index`` may hold every weight)."""
    starts = torch.tensor([site.start for site in layout], dtype=torch.long)
    owners = torch.searchsorted(starts, index.detach().cpu().long(), right=True) - 1
    return set(torch.bincount(owners, minlength=len(starts)).nonzero().flatten().tolist())


def forward_fn(
    model,
    values: dict,
    args: tuple,
    obs_name: str,
    *,
    returned: bool = False,
    check: Callable[[Any], None] | None = None,
) -> Callable[[], torch.Tensor]:
    """A function running ``model(*args)`` with the weight sites at ``values`` and returning the
    network outputs behind the observed site ``obs_name`` (with ``returned``, the model's return
    value: a heteroscedastic regressor's network outputs, of which its ``split`` reads the mean
    and the variance). ``check(trace)`` runs on each pass's trace before anything is read."""

    def forward() -> torch.Tensor:
        with poutine.block():
            conditioned = poutine.condition(model, data=values)
            trace = poutine.trace(conditioned).get_trace(*args)
        if check is not None:
            check(trace)
        if obs_name not in trace.nodes:
            raise ValueError(
                f"the model has no site {obs_name!r} any more; the guide read it as the observed "
                "site when it was set up. Give the model the same observed site at every call, "
                "or build a new guide for the changed model."
            )
        if returned:
            return trace.nodes["_RETURN"]["value"]
        return read_outputs(trace.nodes[obs_name]["fn"])

    return forward


def declared_precision(layout: SiteLayout, index: torch.Tensor) -> torch.Tensor:
    """The precision (float64, on ``index``'s device) of the Gaussian prior declared in
    :func:`~pyro_bdl.bayesianize` for the packed weights ``index`` (sorted), read site by site
    so that no vector over all D weights is formed; every site is checked.

    :raises NonGaussianPriorError: naming the first site whose prior is not Gaussian (or that is
        not a lifted weight) and the way out, an explicit ``prior_precision=``.
    """
    parts = []
    for site in layout:
        if site.spec is None:
            raise NonGaussianPriorError(
                f"site {site.name!r} is not a weight lifted by pyro_bdl.bayesianize, so its "
                "prior is unknown to this method; pass prior_precision= explicitly."
            )
        _, precision = gaussian_prior(site.spec)
        local = index[(index >= site.start) & (index < site.stop)] - site.start
        parts.append(precision.reshape(-1)[local.to(precision.device)].to(index.device))
    return torch.cat(parts).to(torch.float64)


# ---- the passes ----------------------------------------------------------------------------


def forward_at(
    model,
    layout: SiteLayout,
    flat: torch.Tensor,
    args: tuple,
    obs: Observation,
    wanted: set[int] | None = None,
    check: Callable[[Any], None] | None = None,
):
    """``(forward function, slots)`` of the network of ``model`` with the weights at the packed
    ``flat`` (:func:`leaf_slots`, :func:`forward_fn`, which runs ``check``); with ``wanted``,
    only those sites require grad."""
    values, slots = leaf_slots(layout, flat, wanted)
    returned = obs.split is not None
    return forward_fn(model, values, args, obs.name, returned=returned, check=check), slots


#: Set on an exception raised by ``reduce_fn`` itself (see :func:`raised_by_reduction`).
_AGREED = "raised_by_reduction"


def raised_by_reduction(err: BaseException) -> bool:
    """Whether ``err`` came out of the ``reduce_fn`` (an agreeing reduction, such as
    :func:`~pyro_bdl.distributed.allreduce_sum`, raises the same error on every rank), rather
    than from this rank's own passes."""
    return bool(getattr(err, "__dict__", {}).get(_AGREED, False))


def check_reduce_fn(reduce_fn: Any) -> None:
    check_callable(
        "reduce_fn",
        reduce_fn,
        what="a callable summing a tensor over ranks",
        optional=True,
        fix="Pass pyro_bdl.distributed's all-reduce (allreduce_sum), or None on one process.",
    )


def _reduce(reduce_fn: ReduceFn | None, t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` summed over ranks by ``reduce_fn``, refused unless finite: a non-finite curvature
    would give a posterior of NaN variances (``what`` names the statistic in the message)."""
    try:
        out = t if reduce_fn is None else reduce_fn(t)
    except BaseException as err:
        err.__dict__[_AGREED] = True
        raise
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        raise ValueError(
            f"reduce_fn must return a tensor of the shape it was given {tuple(t.shape)}; got "
            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}."
        )
    if not bool(torch.isfinite(out).all()):
        source = "reduce_fn returned" if reduce_fn is not None else "the fit computed"
        raise ValueError(
            f"{source} a non-finite {what} (NaN or inf); the Laplace posterior needs a finite "
            "curvature, so nothing was fitted. Check that reduce_fn sums over ranks (an "
            "all-reduce with op=SUM) and that the network's outputs on every rank's data are "
            "finite."
        )
    return out


def _stats(out: torch.Tensor, batch: tuple, obs: Observation) -> torch.Tensor:
    return fit_statistics(out, _targets(batch), obs.likelihood, obs.noise, obs.split)


def _factor(obs: Observation):
    return lambda f: output_hessian_factor(f, obs.likelihood, obs.noise, split=obs.split)


def residual(f: torch.Tensor, y: torch.Tensor, obs: Observation) -> torch.Tensor:
    r""":math:`r_n = \partial(-\log p(y_n \mid f_n)) / \partial f_n` (B, C) at the outputs ``f``
    (B, C): with the Jacobians of a fit pass, :math:`\sum_n J_n^\top r_n` is the gradient of
    the negative log-likelihood, which the mode check needs (:func:`warn_if_not_at_mode`)."""
    with torch.enable_grad():
        leaf = widened(f.detach()).requires_grad_(True)
        return torch.autograd.grad(_negative_log_likelihood(leaf, y, obs), leaf)[0]


def _residual_fn(batch: tuple, obs: Observation, grad: torch.Tensor | None):
    """The residual function of one batch for the curvature passes; ``None`` without ``grad``."""
    if grad is None:
        return None
    y = _targets(batch)
    return lambda f: residual(f, y, obs)


def _targets(batch: tuple) -> torch.Tensor:
    if len(batch) < 2 or not isinstance(batch[1], torch.Tensor):
        raise ValueError("fit needs the targets: pass data as (x, y) or a DataLoader of (x, y).")
    return batch[1]


def _reduce_into(reduce_fn: ReduceFn | None, grad: torch.Tensor | None) -> None:
    if grad is not None:
        grad.copy_(_reduce(reduce_fn, grad, "gradient of the training loss"))


def single_linear(layout: SiteLayout, index: torch.Tensor) -> KronBlock | None:
    """The block of the subnetwork when it is exactly one whole ``Linear`` layer (weight, and
    bias if it has one), else ``None``."""
    try:
        blocks = kron_blocks(layout, index)
    except ValueError:
        return None
    if len(blocks) != 1 or blocks[0].layer.kind != "linear":
        return None
    return blocks[0] if blocks[0].positions.numel() == index.numel() else None


def fit_full(
    model,
    layout: SiteLayout,
    loc: torch.Tensor,
    data: Any,
    first: tuple,
    obs: Observation,
    index: torch.Tensor,
    dtype: torch.dtype,
    *,
    batch_size: int,
    chunk_memory: int | None = None,
    reduce_fn: ReduceFn | None = None,
    grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(GGN over index (S × S, in dtype), statistics)`` of ``model`` at the packed weights
    ``loc``, from :math:`J_S` in row chunks sized by the memory budget
    (:mod:`~pyro_bdl.curvature.memory`: ``chunk_memory`` bytes, at most ``batch_size`` rows);
    when the subnetwork is one whole ``Linear`` layer (the last layer), from its inputs without
    :math:`J_S` (:func:`~pyro_bdl.curvature.ggn.linear_layer_ggn`). The memory of a chunk is
    measured on ``first``, the first batch of ``data``. With ``grad`` (S, float64) the gradient
    of the negative log-likelihood over the subnetwork, :math:`\sum_n J_n^\top r_n`
    (:func:`residual`), is added to it from the same passes."""
    item = torch.finfo(dtype).bits // 8
    count = index.numel()
    budget = chunk_budget(count, obs.outputs, batch_size, item, chunk_memory)
    # Measured on the first rows; the weights and the data are not the chunk's memory.
    tensors = list(batch_leaves(first).values())
    net = network(model)
    owned = [*net.parameters(), *net.buffers()] if net is not None else []
    exclude = [loc, *tensors, *owned]
    layer = single_linear(layout, index)
    wanted = sites_touched(layout, index)
    with eval_mode(model):
        at = lambda n: forward_at(model, layout, loc, head(first, n), obs, wanted)  # noqa: E731
        if layer is not None:
            # Per row: the forward graph, one row of the O·k products, the layer input, the
            # gradients at the layer's output (O × C) and their products (O × O).
            o = layer.positions.shape[0]
            width = 2 * count + layer.positions.shape[1] + o * (o + obs.outputs)
            rows = forward_rows(
                at, budget, batch_size, width * item, available=len(tensors[0]), exclude=exclude
            )
            select_numbers = budget // 4 // (3 * item)
        else:
            rows, select_numbers = chunk_rows(
                at, index, budget, batch_size, item, available=len(tensors[0]), exclude=exclude
            )
    ggn = torch.zeros(count, count, dtype=dtype, device=loc.device)
    stats = torch.zeros(4, dtype=torch.float64)
    with eval_mode(model):
        for batch in iter_batches(data, rows):
            forward, slots = forward_at(model, layout, loc, batch, obs, wanted)
            out = None
            residual_fn = _residual_fn(batch, obs, grad)
            if layer is not None:
                module, bias = layer.layer.module, layer.layer.bias
                out = linear_layer_ggn(
                    forward,
                    module,
                    bias,
                    layer.positions,
                    _factor(obs),
                    ggn,
                    residual_fn=residual_fn,
                    grad=grad,
                )
            if out is None:
                jac, out = subnet_jacobian(
                    forward, slots, index, return_outputs=True, select_numbers=select_numbers
                )
                subnet_ggn(jac, _factor(obs)(out), out=ggn)
                if residual_fn is not None and grad is not None:
                    r = residual_fn(out)
                    grad += torch.einsum("bc,bcs->s", r.to(grad.dtype), jac.to(grad.dtype))
                del jac
            stats += _stats(out, batch, obs).cpu()
            del out, forward, slots
    _reduce_into(reduce_fn, grad)
    return _reduce(reduce_fn, ggn, "GGN"), _reduce(reduce_fn, stats, "fit statistics")


def fit_diag(
    model,
    layout: SiteLayout,
    loc: torch.Tensor,
    data: Any,
    obs: Observation,
    index: torch.Tensor | None = None,
    *,
    batch_size: int,
    reduce_fn: ReduceFn | None = None,
    stats: bool = True,
    grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(diagonal of the GGN over index (all D weights when None), statistics or None)`` of
    ``model`` at the packed weights ``loc``: exact, from per-example gradients of
    :math:`L^\\top f` (:func:`~pyro_bdl.curvature.ggn.diagonal_ggn`). With ``grad`` (over
    ``index``, float64) the gradient of the negative log-likelihood is added to it from the same
    backward passes."""
    diag = torch.zeros(loc.numel(), dtype=torch.float64, device=loc.device)
    every = torch.zeros_like(diag) if grad is not None else None
    total = torch.zeros(4, dtype=torch.float64)
    factor = _factor(obs)
    with eval_mode(model):
        for batch in iter_batches(data, batch_size):
            forward, slots = forward_at(model, layout, loc, batch, obs)
            seen: list[torch.Tensor] = []

            def record(f, seen=seen):
                seen.append(f.detach())
                return factor(f)

            residual_fn = _residual_fn(batch, obs, grad)
            diag += diagonal_ggn(
                forward, slots, record, residual_fn=residual_fn, grad=every
            ).double()
            if stats:
                total += _stats(seen[0], batch, obs).cpu()
    diag = _reduce(
        reduce_fn, diag if index is None else diag[index.to(diag.device)], "GGN diagonal"
    )
    if grad is not None and every is not None:
        grad += every if index is None else every[index.to(every.device)]
        _reduce_into(reduce_fn, grad)
    return diag, (_reduce(reduce_fn, total, "fit statistics") if stats else None)


def fit_kron(
    model,
    layout: SiteLayout,
    loc: torch.Tensor,
    data: Any,
    obs: Observation,
    index: torch.Tensor,
    *,
    batch_size: int,
    reduce_fn: ReduceFn | None = None,
    grad: torch.Tensor | None = None,
):
    r"""``(blocks, A sums, G sums, statistics)`` of the layers in the subnetwork ``index``
    (:func:`~pyro_bdl.guides.laplace.posterior.kron_blocks`,
    :func:`~pyro_bdl.curvature.kfac.kfac_sums`) of ``model`` at the packed weights ``loc``, in
    float64. With ``grad`` (S, float64) the gradient of the negative log-likelihood over the
    subnetwork is added to it from the same backward passes."""
    blocks = kron_blocks(layout, index)
    kw: dict[str, Any] = dict(dtype=torch.float64, device=loc.device)
    a_sums = [torch.zeros(b.positions.shape[1], b.positions.shape[1], **kw) for b in blocks]
    g_sums = [torch.zeros(b.positions.shape[0], b.positions.shape[0], **kw) for b in blocks]
    stats = torch.zeros(4, dtype=torch.float64)
    layers = [b.layer for b in blocks]
    grad_sums = None if grad is None else [torch.zeros(b.positions.shape, **kw) for b in blocks]
    wanted = sites_touched(layout, index)
    with eval_mode(model):
        for batch in iter_batches(data, batch_size):
            forward, _ = forward_at(model, layout, loc, batch, obs, wanted)
            residual_fn = _residual_fn(batch, obs, grad)
            out = kfac_sums(
                forward,
                layers,
                _factor(obs),
                a_sums,
                g_sums,
                residual_fn=residual_fn,
                grad_sums=grad_sums,
            )
            stats += _stats(out, batch, obs).cpu()
    if grad is not None and grad_sums is not None:
        for block, part in zip(blocks, grad_sums):
            grad[block.positions.reshape(-1).to(grad.device)] += part.reshape(-1)
        _reduce_into(reduce_fn, grad)
    a_sums = [_reduce(reduce_fn, a, "Kronecker factor A") for a in a_sums]
    g_sums = [_reduce(reduce_fn, g, "Kronecker factor G") for g in g_sums]
    return blocks, a_sums, g_sums, _reduce(reduce_fn, stats, "fit statistics")


def jacobians(
    model,
    layout: SiteLayout,
    loc: torch.Tensor,
    data: Any,
    obs: Observation,
    index: torch.Tensor,
    *,
    batch_size: int,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    check: Callable[[Any], None] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple]]:
    """``(outputs (b, C), J_S (b, C, S), batch)`` of ``model`` at the packed weights ``loc``,
    ``batch_size`` rows at a time; the model gets the whole batch, as in a fit, so that a
    :class:`~pyro_bdl.models.NetworkModel` checks the targets of every batch (validation data),
    whatever Pyro's validation switch. With ``transform``, ``J_S`` is that of
    ``transform(outputs)`` (b, K, S) (:func:`~pyro_bdl.curvature.jacobian.subnet_jacobian`).
    The global random state is left as it was (the model draws the targets it is not given),
    so that a predictive draws only its own Monte Carlo samples from it. ``check(trace)`` runs
    on every pass (:func:`forward_fn`)."""
    wanted = sites_touched(layout, index)
    with eval_mode(model):
        for batch in iter_batches(data, batch_size):
            forward, slots = forward_at(model, layout, loc, batch, obs, wanted, check)
            with random_state_kept(batch):
                jac, out = subnet_jacobian(
                    forward, slots, index, return_outputs=True, transform=transform
                )
            yield out, jac, batch


# ---- is the network at a mode? ---------------------------------------------------------------


def _negative_log_likelihood(out: torch.Tensor, y: torch.Tensor, obs: Observation):
    if obs.likelihood == "heteroscedastic":
        assert obs.split is not None
        mean, log_var = mean_and_log_variance(out, obs.split)
        r = y.to(mean).reshape(mean.shape) - mean
        return 0.5 * (log_var + r.square() * (-log_var).exp()).sum()
    if obs.likelihood == "gaussian":
        assert obs.noise is not None
        return (out - y.to(out).reshape(out.shape)).square().sum() / (2 * obs.noise**2)
    if obs.likelihood == "bernoulli":
        return -dist.Bernoulli(logits=out).log_prob(y.to(out).reshape(out.shape)).sum()
    return -dist.Categorical(logits=out).log_prob(y.reshape(-1)).sum()


def training_loss_gradient(
    model,
    layout: SiteLayout,
    loc: torch.Tensor,
    data: Any,
    obs: Observation,
    index: torch.Tensor,
    *,
    batch_size: int,
    reduce_fn: ReduceFn | None = None,
) -> torch.Tensor:
    """The gradient (float64, over the subnetwork ``index``) of the negative log-likelihood of
    ``data`` under ``model`` at the packed weights ``loc``, summed over all rows (and ranks)."""
    grad = torch.zeros(loc.numel(), dtype=torch.float64, device=loc.device)
    with eval_mode(model):
        for batch in iter_batches(data, batch_size):
            y = _targets(batch)
            forward, slots = forward_at(model, layout, loc, batch, obs)
            leaves = [slot.value for slot in slots]
            nll = _negative_log_likelihood(forward(), y, obs)
            grads = torch.autograd.grad(nll, leaves, allow_unused=True)
            grad += torch.cat(
                [
                    (g if g is not None else torch.zeros_like(u)).reshape(-1)
                    for g, u in zip(grads, leaves)
                ]
            ).double()
    return _reduce(reduce_fn, grad[index.to(grad.device)], "gradient of the training loss")
