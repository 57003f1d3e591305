r"""Where every latent site sits in the flat parameter vector: one object for every method.

Every posterior in this package packs the unconstrained values of the model's latent sites into one
flat vector θ ∈ ℝᴰ (mean-field and Radial keep their locations and scales there, SWAG its moments,
Laplace its MAP and curvature, VOGN its mean and curvature). :class:`SiteLayout` is the one map
from that vector back to the model: each :class:`Site` knows its name, slice, unconstrained shape,
event dims, plates, the bijection onto its support and, for a weight lifted by
:func:`~pyro_bdl.bayesianize`, the layer and parameter that use it.

Usage::

    layout = SiteLayout.from_trace(poutine.trace(model).get_trace(x, y))
    flat = layout.pack({name: value, ...})          # (D,)
    weights = layout.unpack(flat)                   # {name: view of the site's shape}
    layout["fc.weight"].module                      # the nn.Linear that uses it

Splitting a flat vector goes through :func:`torch.split` (one autograd node for all sites):
slicing site by site would make each slice's backward fill a zero tensor of the full length D, a
cost that grows as (number of sites) × D.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pyro.infer.autoguide.utils import helpful_support_errors
from pyro.ops.tensor_utils import periodic_repeat
from pyro.poutine.util import site_is_subsample
from torch import nn
from torch.distributions import biject_to
from torch.distributions.transforms import ComposeTransform, IndependentTransform

from pyro_bdl.nn.lift import SiteSpec, site_spec
from pyro_bdl.priors import NonGaussianPriorError, gaussian_prior

__all__ = ["Site", "SiteLayout"]


def _is_identity(transform) -> bool:
    """Whether ``biject_to(support)`` is the identity (real support, possibly with event dims)."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return isinstance(transform, ComposeTransform) and not transform.parts


@dataclass(frozen=True, eq=False)
class Site:
    """One latent site of the flat vector.

    :ivar str name: the Pyro site name.
    :ivar int start: first index in the flat vector.
    :ivar int stop: one past the last index.
    :ivar torch.Size shape: the unconstrained shape, at full plate size.
    :ivar int event_dim: trailing dims of ``shape`` that form one draw of the site.
    :ivar tuple frames: the site's vectorized plates, as ``(name, dim)``.
    :ivar transform: maps the unconstrained value onto the support (``None``: the identity).
    :ivar spec: the :class:`~pyro_bdl.nn.SiteSpec` of a lifted weight, else ``None``.
    """

    name: str
    start: int
    stop: int
    shape: torch.Size
    event_dim: int
    frames: tuple[tuple[str, int], ...] = ()
    transform: Any = None
    spec: SiteSpec | None = None

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def whole(self) -> bool:
        """Whether every dim is an event dim (the site is one draw of its distribution)."""
        return self.event_dim == len(self.shape)

    @property
    def module(self) -> nn.Module | None:
        """The layer that uses this weight (``None`` for a site that is not a lifted weight)."""
        return self.spec.module if self.spec is not None else None

    @property
    def param_name(self) -> str | None:
        """The parameter's name within :attr:`module` (``"weight"``, ``"bias"``)."""
        return self.spec.param_name if self.spec is not None else None

    def constrain(self, unconstrained: torch.Tensor) -> torch.Tensor:
        """The site's value from its unconstrained value."""
        return unconstrained if self.transform is None else self.transform(unconstrained)


class SiteLayout(Sequence[Site]):
    """The ordered latent sites of a model and their slices of one flat vector of length D.

    Build it from a trace (:meth:`from_trace`) or from lifted weights (:meth:`from_specs`).
    Indexing by position or by name returns a :class:`Site`; an unknown name raises a
    ``ValueError`` that lists the valid ones.
    """

    def __init__(self, sites: Sequence[Site]):
        sites = tuple(sites)
        if not sites:
            raise ValueError(
                "the model has no latent sites; lift the network with pyro_bdl.bayesianize(net) "
                "so that its weights become sample sites."
            )
        start = 0
        for site in sites:
            numel = math.prod(site.shape)
            if site.start != start or site.stop - site.start != numel:
                raise ValueError(
                    f"site {site.name!r} must take the flat indices [{start}, {start + numel}): "
                    f"right after the previous site, one per number of its shape "
                    f"{tuple(site.shape)}; got [{site.start}, {site.stop}). Build the sites with "
                    "consecutive slices, or use SiteLayout.from_trace / from_specs."
                )
            start = site.stop
        self._sites = sites
        self._by_name = {s.name: s for s in sites}
        self.size = start
        self.sizes = [s.numel for s in sites]

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_trace(cls, trace, *, full_plates: bool = True) -> tuple[SiteLayout, torch.Tensor]:
        """The layout of a trace's latent sites and their values, packed unconstrained.

        A subsampled plate keeps parameters for the full plate (``full_plates=True``): the value
        is repeated periodically to the full size, as Pyro's autoguides do.
        """
        sites, values = [], []
        start = 0
        for name, node in trace.iter_stochastic_nodes():
            if site_is_subsample(node):
                continue
            fn = node["fn"]
            with helpful_support_errors(node):
                transform = biject_to(fn.support)
            value = node["value"].detach()
            unconstrained = transform.inv(value).detach()
            event_dim = fn.event_dim + unconstrained.dim() - value.dim()
            frames = []
            for frame in node["cond_indep_stack"]:
                full_size = frame.full_size or frame.size
                if full_plates and full_size != frame.size:
                    unconstrained = periodic_repeat(unconstrained, full_size, frame.dim - event_dim)
                frames.append((frame.name, frame.dim))
            unconstrained = unconstrained.contiguous()
            sites.append(
                Site(
                    name=name,
                    start=start,
                    stop=start + unconstrained.numel(),
                    shape=unconstrained.shape,
                    event_dim=event_dim,
                    frames=tuple(frames),
                    transform=None if _is_identity(transform) else transform,
                    spec=site_spec(node),
                )
            )
            values.append(unconstrained.reshape(-1))
            start += unconstrained.numel()
        layout = cls(sites)
        dtypes = {v.dtype for v in values}
        if len(dtypes) > 1:
            raise ValueError(
                "all latent sites are packed into one vector, so they must share a dtype; got "
                f"{sorted(map(str, dtypes))}. Convert the network with net.to(dtype) before "
                "lifting."
            )
        return layout, torch.cat(values)

    @classmethod
    def from_specs(cls, specs: Sequence[SiteSpec]) -> SiteLayout:
        """The layout of lifted weights (no plates, real support), in the given order."""
        sites, start = [], 0
        for spec in specs:
            n = spec.init_value.numel()
            sites.append(Site(spec.name, start, start + n, spec.shape, len(spec.shape), spec=spec))
            start += n
        return cls(sites)

    # -- the sequence --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sites)

    def __iter__(self) -> Iterator[Site]:
        return iter(self._sites)

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            site = self._by_name.get(key)
            if site is None:
                raise ValueError(
                    f"unknown site {key!r}; the sites are {', '.join(map(repr, self._by_name))}."
                )
            return site
        return self._sites[key]

    def __contains__(self, key) -> bool:
        if isinstance(key, str):
            return key in self._by_name
        return key in self._sites

    def __repr__(self) -> str:
        return f"SiteLayout({len(self)} sites, D={self.size})"

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    # -- flat <-> per site ---------------------------------------------------------------------

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of every site's block of ``flat`` (last dim D), shaped ``batch + site.shape``."""
        if flat.shape[-1] != self.size:
            raise ValueError(
                f"flat must have length {self.size} (the layout's D) in its last dim; got shape "
                f"{tuple(flat.shape)}. Pass a vector packed by this layout (layout.pack(values)), "
                "with optional leading batch dims."
            )
        batch = flat.shape[:-1]
        return [
            part.reshape(batch + site.shape)
            for part, site in zip(flat.split(self.sizes, dim=-1), self._sites)
        ]

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: block of flat}`` (views where possible), each shaped ``batch + site.shape``."""
        return dict(zip(self._by_name, self.split(flat)))

    def pack(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat vector of ``{name: value}`` (every site, each of its own shape)."""
        missing = [n for n in self._by_name if n not in values]
        if missing:
            raise ValueError(
                f"values must hold a tensor for every site; missing {missing} (got "
                f"{sorted(values)}). Pass {{name: tensor}} for every name in layout.names."
            )
        parts = []
        for site in self._sites:
            value = values[site.name]
            lead = value.dim() - len(site.shape)
            if lead < 0 or value.shape[lead:] != site.shape:
                raise ValueError(
                    f"value of site {site.name!r} must end in shape {tuple(site.shape)}; got "
                    f"{tuple(value.shape)}. Give it the site's shape, with optional leading "
                    "batch dims."
                )
            parts.append(value.reshape((*value.shape[:lead], -1)))
        return torch.cat(parts, dim=-1)

    def indices(self, site: Site | str) -> torch.Tensor:
        """The flat indices of one site (a ``LongTensor``)."""
        site = self[site] if isinstance(site, str) else site
        return torch.arange(site.start, site.stop)

    def gaussian_prior(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ``(mean, precision)`` (each ``(D,)``) of the Gaussian prior declared for every site
        by :func:`~pyro_bdl.bayesianize`, the one place methods read the prior from.

        :raises NonGaussianPriorError: when a site is not a lifted weight or its prior is not
            Gaussian; the message names the site and the way out (an explicit precision).
        """
        means, precisions = [], []
        for site in self._sites:
            if site.spec is None:
                raise NonGaussianPriorError(
                    f"site {site.name!r} is not a weight lifted by pyro_bdl.bayesianize, so its "
                    "prior is unknown to this method; pass prior_precision= explicitly or make "
                    "the site observed."
                )
            mean, precision = gaussian_prior(site.spec)
            means.append(mean.reshape(-1))
            precisions.append(precision.reshape(-1))
        return torch.cat(means), torch.cat(precisions)

    @property
    def modules(self) -> list[nn.Module]:
        """The distinct layers that use the lifted weights, in the order of first use."""
        seen: dict[int, nn.Module] = {}
        for site in self._sites:
            if site.module is not None:
                seen.setdefault(id(site.module), site.module)
        return list(seen.values())
