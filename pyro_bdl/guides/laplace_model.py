r"""How :class:`~pyro_bdl.guides.AutoSubnetLaplace` reads a model: its likelihood, its network
outputs with the weights held at given values, and the data in row chunks.

The linearized Laplace needs the network outputs :math:`f(x, \theta)` per example and the
Hessian of the negative log-likelihood with respect to them (docs/design/laplace.md). The model
is run with its weight sites conditioned on the given values, and the outputs are read from the
observed site's distribution (``logits`` of a ``Categorical`` or ``Bernoulli``, ``loc`` of a
``Normal``), so any model that computes its likelihood from the network works.

The contract is explicit for a :class:`~pyro_bdl.models.NetworkModel` (what the factories of
:mod:`pyro_bdl.models` return): the likelihood and the noise σ are the ones it declares (a point
estimate of σ is read at its current value; a learned or heteroscedastic σ is refused by
:func:`check_supported`), and its network is switched to eval mode
while ``fit`` and ``predict`` evaluate it, because the examples must be independent given the
weights (BatchNorm then uses its running statistics). A hand-written model declares neither:
the likelihood and σ are read from its one observed site's distribution, and its layers are
left in the mode they are in, so put any BatchNorm in eval mode before ``fit`` and ``predict``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro_bdl._validation import check_finite
from pyro_bdl.curvature.jacobian import ParamSlot
from pyro_bdl.layout import SiteLayout
from pyro_bdl.models import NetworkModel
from pyro_bdl.priors import NonGaussianPriorError, gaussian_prior

__all__ = [
    "Observation",
    "check_supported",
    "declared_precision",
    "eval_mode",
    "forward_fn",
    "head",
    "iter_batches",
    "leaf_slots",
    "network",
    "observe",
    "read_outputs",
]


@dataclass(frozen=True)
class Observation:
    """The observed site of a model and what the curvature needs to know of it.

    :ivar str name: the site's name.
    :ivar str likelihood: ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``.
    :ivar noise: the Gaussian observation noise σ (``None`` otherwise).
    :ivar int outputs: C, the number of outputs per example.
    :ivar bool vector: whether the model's outputs have shape ``(B,)`` rather than ``(B, C)``.
    """

    name: str
    likelihood: str
    noise: float | None
    outputs: int
    vector: bool


def network(model) -> nn.Module | None:
    """The network of a :class:`~pyro_bdl.models.NetworkModel`; ``None`` for any other model."""
    return model.net if isinstance(model, NetworkModel) else None


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """The network of a :class:`~pyro_bdl.models.NetworkModel` in eval mode inside the block
    (restored after); a hand-written model is left as it is."""
    net = network(model)
    was = net.training if net is not None else False
    if net is not None:
        net.eval()
    try:
        yield
    finally:
        if net is not None and was:
            net.train()


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
                "the Normal observation noise must be one fixed σ for the linearized Laplace; "
                "got a scale that varies across examples. Use models.regressor(net, N, σ)."
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


def observe(model, layout: SiteLayout, args: tuple, *, without_targets: bool = False, values=None):
    """The :class:`Observation` of ``model(*args)``: its one observed site (called
    ``without_targets``, the one sample site that is not a weight site of ``layout``), the
    likelihood (declared by a :class:`~pyro_bdl.models.NetworkModel`, else read from the site)
    and the outputs' shape. ``values`` (site name -> value) holds the weights where they are,
    since weights drawn from a broad prior can overflow a deep network's outputs."""
    if isinstance(model, NetworkModel):
        check_supported(model)
    run = poutine.condition(model, data=values) if values is not None else model
    with torch.no_grad(), poutine.block():
        trace = poutine.trace(run).get_trace(*args)
    observed = [
        n
        for n, s in trace.nodes.items()
        if s["type"] == "sample"
        and not site_is_subsample(s)
        and n not in layout
        and (s["is_observed"] or without_targets)
    ]
    if len(observed) != 1:
        raise ValueError(
            f"AutoSubnetLaplace needs exactly one observed site in the model; found "
            f"{observed or 'none'}. Pass the targets as the model's y argument."
        )
    fn = trace.nodes[observed[0]]["fn"]
    if isinstance(model, NetworkModel):
        likelihood, noise = model.likelihood, model.noise_scale
    else:
        likelihood, noise = read_likelihood(fn)
    out = read_outputs(fn)
    outputs = out.shape[-1] if out.dim() == 2 else 1
    return Observation(observed[0], likelihood, noise, outputs, out.dim() == 1)


def check_supported(model) -> None:
    """Refuse a :class:`~pyro_bdl.models.NetworkModel` whose likelihood the linearized Laplace
    cannot take: a Gaussian whose σ is a latent site or comes from the network. The GGN and the
    predictive treat the observation noise as one known σ. Other models pass (their likelihood
    is read from the observed site at :meth:`fit`)."""
    if not isinstance(model, NetworkModel):
        return
    if model.likelihood == "gaussian" and model.noise in ("learned", "heteroscedastic"):
        what = (
            "σ is a latent site (noise='learned')"
            if model.noise == "learned"
            else "σ(x) comes from the network (heteroscedastic_regressor)"
        )
        raise ValueError(
            f"AutoSubnetLaplace with a Gaussian likelihood needs one known noise σ, but {what}; "
            "the linearized Laplace treats σ as fixed. Use regressor(..., noise='point') (σ "
            "fitted with the MAP weights and held at its estimate) or noise='fixed', or a "
            "variational guide (AutoMeanField, AutoRadial) or AutoSWAG for this model."
        )


def leaf_slots(layout: SiteLayout, flat: torch.Tensor) -> tuple[dict, list[ParamSlot]]:
    """Every site's value from the packed unconstrained ``flat`` (fresh leaves that require
    grad, views of ``flat``), and the :class:`~pyro_bdl.curvature.ParamSlot` of each site."""
    values, slots = {}, []
    for site, block in zip(layout, layout.split(flat.detach())):
        u = block.detach().requires_grad_(True)
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


def forward_fn(model, values: dict, args: tuple, obs_name: str) -> Callable[[], torch.Tensor]:
    """A function running ``model(*args)`` with the weight sites at ``values`` and returning the
    network outputs behind the observed site ``obs_name``."""

    def forward() -> torch.Tensor:
        with poutine.block():
            conditioned = poutine.condition(model, data=values)
            trace = poutine.trace(conditioned).get_trace(*args)
        if obs_name not in trace.nodes:
            raise ValueError(f"the model has no site {obs_name!r} any more.")
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


def head(batch: tuple, n: int) -> tuple:
    """The first ``n`` rows of every tensor of a batch."""
    return tuple(t[:n] if isinstance(t, torch.Tensor) else t for t in batch)


def iter_batches(data: Any, batch_size: int) -> Iterator[tuple]:
    """Chunks of at most ``batch_size`` rows from a tuple of tensors or a DataLoader."""
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        batches: Iterable = [tuple(data)]
    elif isinstance(data, Iterable) and not isinstance(data, (torch.Tensor, str, dict)):
        batches = data
    else:
        raise TypeError(
            "data must be a tuple of tensors (x, y) or a DataLoader yielding (x, y); got "
            f"{type(data).__name__}."
        )
    empty = True
    for batch in batches:
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        if not any(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError(
                "data must be a tuple of tensors (x, y) or a DataLoader yielding (x, y); a "
                f"batch held {', '.join(type(t).__name__ for t in batch[:3])}."
            )
        for i, t in enumerate(batch):
            if isinstance(t, torch.Tensor):
                check_finite(f"data tensor {i} (0: x, 1: y)", t)
        rows = {t.shape[0] for t in batch if isinstance(t, torch.Tensor)}
        if len(rows) != 1 or 0 in rows:
            raise ValueError(
                f"every tensor of a batch needs the same, non-zero number of rows; got "
                f"{sorted(rows)}. Pass matching (x, y)."
            )
        n = rows.pop()
        for start in range(0, n, batch_size):
            empty = False
            yield tuple(
                t[start : start + batch_size] if isinstance(t, torch.Tensor) else t for t in batch
            )
    if empty:
        raise ValueError("data is empty; fit needs at least one example.")
