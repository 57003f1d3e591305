"""What a lifted weight site is, and how a trace site leads back to it.

:class:`SiteSpec` is what :func:`~pyro_bdl.bayesianize` records per weight; :func:`site_spec`
finds it from a trace site (through the prior distribution it built) and
:func:`init_to_network` starts a guide at the network's own weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyro.distributions as dist
import torch
from pyro.infer.autoguide.initialization import init_to_median
from torch import nn

from pyro_bdl.nn import tied

__all__ = [
    "INIT_PREFIX",
    "PriorFn",
    "SiteSpec",
    "Use",
    "constant_buffer_names",
    "init_to_network",
    "mark_constant",
    "site_spec",
]

#: The prefix of the buffer holding a lifted weight's initial location on its layer.
INIT_PREFIX = "_bdl_init_"

#: Per layer, the names of its buffers that hold frozen parameters hidden by ``bayesianize``.
_CONSTANT_ATTR = "_bdl_constant"


def mark_constant(layer: nn.Module, name: str, constant: bool) -> None:
    """Record that ``layer``'s buffer ``name`` holds a frozen parameter hidden by
    ``bayesianize`` (``constant``), or no longer does."""
    names = layer.__dict__.setdefault(_CONSTANT_ATTR, set())
    if constant:
        names.add(name)
    else:
        names.discard(name)


def constant_buffer_names(layer: nn.Module) -> set[str]:
    """The names of ``layer``'s own buffers that ``bayesianize`` added and that no forward pass
    writes: the lifted weights' initial locations and the frozen parameters it hid. Read from
    the layer alone, as a global forward hook sees it; a rollback of a pass need not copy them
    (for a frozen base model, that copy would double its memory)."""
    frozen = layer.__dict__.get(_CONSTANT_ATTR, set())
    return {n for n in layer._buffers if n.startswith(INIT_PREFIX) or n in frozen}


PriorFn = Callable[[nn.Module, str, torch.Tensor], dist.Distribution]
Use = tuple[str, nn.Module, str]  # (dotted name, layer, attribute name)


@dataclass(eq=False)
class SiteSpec:
    """What :func:`bayesianize` knows about one weight site.

    :ivar str name: the Pyro site name (the first dotted name of the parameter).
    :ivar module: the layer that owns the parameter.
    :ivar str param_name: the parameter's name within ``module`` (``"weight"``, ``"bias"``).
    :ivar prior: the :class:`~pyro_bdl.priors.Prior` (or callable) that builds the distribution.
    :ivar tuple aliases: the parameter's other dotted names (tied weights, or a layer instance
        reachable under several paths); every one of them reads this one site.
    :ivar bool trainable: the parameter's ``requires_grad`` before lifting (``False``: a frozen
        parameter exposed explicitly).
    :ivar list alias_uses: ``(dotted name, layer, attribute)`` of every layer other than
        :attr:`module` that reads this site.
    """

    name: str
    module: nn.Module
    param_name: str
    prior: PriorFn
    aliases: tuple[str, ...] = ()
    trainable: bool = True
    alias_uses: list[Use] = field(default_factory=list, repr=False)
    _cache: dict[Any, dist.Distribution] = field(default_factory=dict, repr=False)

    @property
    def init_value(self) -> torch.Tensor:
        """The initial posterior location (a buffer that follows ``module.to(...)``)."""
        return getattr(self.module, INIT_PREFIX + self.param_name)

    @property
    def alias_layers(self) -> tuple[tuple[nn.Module, str], ...]:
        """``(layer, attribute)`` of every layer other than :attr:`module` that reads this site
        (tied weights; empty when one layer instance holds it, even one reachable under several
        paths). A method that writes a weight value or hooks layers must serve these too."""
        return tuple((sub, attr) for _, sub, attr in self.alias_uses)

    @property
    def shape(self) -> torch.Size:
        return self.init_value.shape

    def set_prior(self, prior: PriorFn) -> None:
        """Replace the prior (the distribution is built afresh on the next read)."""
        self.prior = prior
        self._cache.clear()

    def __call__(self, module: nn.Module) -> dist.Distribution:
        """The prior distribution (``PyroSample`` calls this, with the layer that reads the site:
        the owner or an alias layer), built once per device and dtype when the prior says it
        may be (``Prior.cacheable``), else on every call: a callable prior may read a learned
        ``pyro.param``, whose graph is new at every step."""
        tied.check_alias_read(self, module)
        # Straight from the layer's buffers: PyroModule's attribute lookup runs Python code
        # first, and this runs per weight site on every forward pass.
        like = self.module._buffers.get(INIT_PREFIX + self.param_name)
        if like is None:
            like = self.init_value
        cacheable = getattr(self.prior, "cacheable", False)
        key = (like.device, like.dtype)
        d = self._cache.get(key) if cacheable else None
        if d is None:
            # A cached prior is built with inference mode off even when the first forward pass
            # runs under torch.inference_mode(): built there, its tensors would be inference
            # tensors, and every later training step would fail to save them for backward.
            with torch.inference_mode(False) if cacheable else contextlib.nullcontext():
                d = self.prior(self.module, self.param_name, like)
            d._bdl_site = self  # lets init_to_network and the ELBOs find the spec from a trace
            if cacheable:
                self._cache.clear()
                self._cache[key] = d
        return d


def site_spec(site: Mapping[str, Any]) -> SiteSpec | None:
    """The :class:`SiteSpec` behind a trace site, or ``None`` if it is not a lifted weight."""
    fn = site.get("fn")
    while fn is not None:
        spec = getattr(fn, "_bdl_site", None)
        if spec is not None:
            return spec
        fn = getattr(fn, "base_dist", None)
    return None


def init_to_network(site: Mapping[str, Any]) -> torch.Tensor:
    """Initialisation strategy: a lifted weight starts at the prior's initial location (by default
    the network's own weights); any other site falls back to ``init_to_median``."""
    spec = site_spec(site)
    if spec is not None:
        return spec.init_value.detach().clone()
    return init_to_median(site)
