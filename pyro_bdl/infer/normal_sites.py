r"""The ELBO terms of many weight sites under one scalar Normal prior, summed in one pass.

:func:`~pyro_bdl.bayesianize` gives every weight of a site the prior N(m, s²) with the same two
numbers (``priors.Normal``; ``priors.LayerwiseNormal`` per layer fan), and the guides that train
on a per-step path give each site a term in closed form:

- a point mass at w (AutoSWAG, AutoSubnetLaplace before ``fit``: the MAP step), the exact
  Trace_ELBO term log p(w) = −n(log s + ½ log 2π) − ‖w − m‖²/(2s²);
- a Normal q = N(μ, σ²) on the site (AutoMeanField), the exact −KL(q ‖ p) =
  −[n(log s − ½) − Σ log σ + (‖σ‖² + ‖μ − m‖²)/(2s²)].

Evaluated site by site, each term is a ``log_prob`` or ``kl_divergence`` call and half a dozen
small operations (on a GPU, kernel launches; with Pyro's validation, a support check that reads a
value back to the host per site). Summed over the sites of one (m, s, dtype, device), the squared
norms are one multi-tensor reduction (``torch._foreach_norm``) and a point mass needs nothing
else; a Normal adds Σ log σ, a logarithm and a sum per site. Nothing is concatenated, so the step
holds no copy of the weights.

:class:`NormalSites` accepts a site only when its trace entries are exactly what the lift and
these guides emit: the prior :func:`~pyro_bdl.bayesianize` built (``Independent`` over every dim
of a Normal from two numbers), no scale, mask or plate on either side (``poutine.scale``,
``poutine.mask``, vectorized particles), and a :class:`~pyro_bdl.guides.flat_sites.PointMass`
with no Jacobian at its own draw or a Normal with the site's shape. Any other site (a user's
prior, a conditioned or reparameterised site, a Radial or constrained guide) is refused, and the
ELBO evaluates it on its own as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pyro.distributions as dist
import torch
from torch.distributions import Independent, Normal

from pyro_bdl.guides.flat_sites import PointMass

__all__ = ["NormalSites", "prior_numbers", "zero_density"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

#: Normal subclasses whose KL to a Normal prior is the Normal–Normal closed form: torch's and
#: Pyro's ``Normal`` and any class that sets ``normal_kl = True`` (AutoMeanField's site Normal).
_NORMALS = (Normal, dist.Normal)


def prior_numbers(fn: Any) -> tuple[float, float] | None:
    """``(m, s)`` of a lifted weight's prior N(m, s²) as built by :mod:`pyro_bdl.priors`
    (an ``Independent`` over every dim of a Normal that remembers its two numbers), else
    ``None``."""
    base, dims = fn, 0
    if isinstance(fn, Independent):
        base, dims = fn.base_dist, fn.reinterpreted_batch_ndims
    numbers = getattr(base, "numbers", None)
    if numbers is None or base.event_shape or dims != len(base.batch_shape):
        return None
    return numbers


def zero_density(guide_site: dict) -> bool:
    """Whether the guide site is a :class:`PointMass` without a Jacobian at its own draw, with
    no scale or mask: its log-density, the guide's half of its ELBO term, is exactly 0."""
    q = guide_site["fn"]
    return (
        isinstance(q, PointMass)
        and q.zero_density
        and q.v is guide_site["value"]
        and guide_site["mask"] is None
        and not isinstance(guide_site["scale"], torch.Tensor)
        and guide_site["scale"] == 1.0
    )


def _plain(site: dict) -> bool:
    """No scale, mask or plate on the site (its term enters the ELBO once, unweighted)."""
    scale = site["scale"]
    return (
        site["mask"] is None
        and not site["cond_indep_stack"]
        and not isinstance(scale, torch.Tensor)
        and scale == 1.0
    )


def _normal_posterior(q: Any, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(loc, scale)`` of a Normal guide site over the whole of ``value``, else ``None``."""
    base = q.base_dist if isinstance(q, Independent) else q
    dims = q.reinterpreted_batch_ndims if isinstance(q, Independent) else 0
    if not (type(base) in _NORMALS or getattr(type(base), "normal_kl", False)):
        return None
    if not isinstance(base, Normal) or dims != value.dim():
        return None
    loc, scale = base.loc, base.scale
    if loc.shape != value.shape or scale.shape != value.shape:
        return None
    return loc, scale


class _SquaredNorms(torch.autograd.Function):
    """Σ ‖t‖² over the tensors given, from one multi-tensor norm, with the gradient 2t.

    Differentiated through the norm, ‖t‖² has the gradient 2‖t‖ · t/‖t‖, which is 0/0 where
    t = 0 (a site at the prior's mean, as ``init="prior_mean"`` starts it): autograd masks the
    first derivative to 0, but a second one (a Hessian-vector product of the loss) is NaN. Here
    the backward is 2t in differentiable operations, exact to any order."""

    @staticmethod
    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(tensors)).square().sum()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch._foreach_mul(ctx.saved_tensors, 2 * grad))


def _sum_of_squares(tensors: list[torch.Tensor], m: float) -> torch.Tensor:
    """Σ ‖t − m‖² over ``tensors`` from one multi-tensor norm: no concatenated copy, and its
    backward saves only the tensors themselves (views the step keeps anyway)."""
    if m:
        tensors = list(torch._foreach_sub(tensors, m))
    return _SquaredNorms.apply(*tensors)


def _point_log_prior(values: list[torch.Tensor], m: float, s: float) -> torch.Tensor:
    """Σ log N(w | m, s²) over every number of ``values``."""
    n = sum(v.numel() for v in values)
    return _sum_of_squares(values, m) * (-0.5 / s**2) - n * (math.log(s) + _HALF_LOG_2PI)


def _negative_kl(
    locs: list[torch.Tensor], scales: list[torch.Tensor], m: float, s: float
) -> torch.Tensor:
    """−Σ KL(N(μ, σ²) ‖ N(m, s²)) over every number of ``locs`` and ``scales``."""
    n = sum(loc.numel() for loc in locs)
    # Σ log σ site by site: a multi-tensor log would hold every site's logarithm at once.
    log_scales = torch.stack([scale.log().sum() for scale in scales]).sum()
    quadratic = (_sum_of_squares(scales, 0.0) + _sum_of_squares(locs, m)) * (0.5 / s**2)
    return log_scales - quadratic - n * (math.log(s) - 0.5)


class _Group:
    """The sites of one prior (m, s) on one dtype and device."""

    def __init__(self, m: float, s: float):
        self.m, self.s = m, s
        self.point_names: list[str] = []
        self.points: list[torch.Tensor] = []
        self.normal_names: list[str] = []
        self.locs: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []

    def total(self) -> torch.Tensor:
        parts = []
        if self.points:
            parts.append(_point_log_prior(self.points, self.m, self.s))
        if self.locs:
            parts.append(_negative_kl(self.locs, self.scales, self.m, self.s))
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def site_terms(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, w in zip(self.point_names, self.points):
            yield name, _point_log_prior([w], self.m, self.s)
        for name, loc, scale in zip(self.normal_names, self.locs, self.scales):
            yield name, _negative_kl([loc], [scale], self.m, self.s)


class NormalSites:
    """The closed-form ELBO terms (log p − log q, or −KL) of the latent sites :meth:`add`
    accepted, summed per prior in one pass.

    Usage (what ``TraceSuffStat_ELBO`` does per particle)::

        sites = NormalSites()
        method = sites.add(model_site, guide_site, exact_kl=True)  # None: evaluate it alone
        elbo_terms = sites.total()
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[Any, ...], _Group] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def add(self, name: str, model_site: dict, guide_site: dict, *, exact_kl: bool) -> str | None:
        """Take the site's term if it has one of the two closed forms (module docstring):
        returns how (``"delta"`` or ``"exact"``, as ``TraceSuffStat_ELBO.kl_methods``), or
        ``None`` for a site to evaluate on its own.

        :param bool exact_kl: whether a Normal guide site's KL is to be exact (the ELBO's
            ``kl`` option is ``"auto"`` or ``"exact"``); else only point masses are taken.
        """
        if not (_plain(model_site) and _plain(guide_site)):
            return None
        numbers = prior_numbers(model_site["fn"])
        value, q = guide_site["value"], guide_site["fn"]
        # A value of another shape broadcasts against the prior: its term counts each number
        # as often as the prior holds it, which only the site's own evaluation does.
        if numbers is None or value.shape != model_site["fn"].event_shape:
            return None
        if isinstance(q, PointMass):
            if not zero_density(guide_site) or q.event_shape != value.shape:
                return None
            group = self._group(numbers, value)
            group.point_names.append(name)
            group.points.append(value)
            return "delta"
        posterior = _normal_posterior(q, value) if exact_kl else None
        if posterior is None:
            return None
        group = self._group(numbers, value)
        group.normal_names.append(name)
        group.locs.append(posterior[0])
        group.scales.append(posterior[1])
        return "exact"

    def _group(self, numbers: tuple[float, float], value: torch.Tensor) -> _Group:
        key = (*numbers, value.dtype, value.device)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(*numbers)
        return group

    def total(self) -> torch.Tensor:
        """The sum of every accepted site's term (at least one site must have been added)."""
        totals = [group.total() for group in self._groups.values()]
        return sum(totals[1:], totals[0])

    def site_terms(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each accepted site's own term (to name the one that is non-finite)."""
        for group in self._groups.values():
            yield from group.site_terms()
