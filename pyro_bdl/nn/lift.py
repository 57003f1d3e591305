"""Lift any ``torch.nn.Module`` into a Bayesian :class:`~pyro.nn.PyroModule`, declaratively."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyro.distributions as dist
import torch
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

from pyro_bdl.nn.vectorize import install_batched_forward
from pyro_bdl.priors import Normal, Prior

__all__ = [
    "DEFAULT_HIDE",
    "SiteSpec",
    "bayesianize",
    "init_to_network",
    "site_spec",
    "sites",
]

Predicate = Callable[[nn.Module, str, torch.Tensor], bool]
Rule = type | str | Predicate

#: Normalisation layers stay deterministic unless exposed: their parameters are few and the
#: posterior over them is poorly identified. ``_NormBase`` covers BatchNorm and InstanceNorm.
DEFAULT_HIDE: tuple[Rule, ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)

_SITES_ATTR = "_bdl_sites"
_INIT_PREFIX = "_bdl_init_"


@dataclass(eq=False)
class SiteSpec:
    """What :func:`bayesianize` knows about one weight site.

    :ivar str name: the Pyro site name (the dotted parameter name).
    :ivar module: the layer that owns the parameter.
    :ivar str param_name: the parameter's name within ``module`` (``"weight"``, ``"bias"``).
    :ivar prior: the :class:`~pyro_bdl.priors.Prior` (or callable) that builds the distribution.
    """

    name: str
    module: nn.Module
    param_name: str
    prior: Callable[[nn.Module, str, torch.Tensor], dist.Distribution]
    _cache: dict[Any, dist.Distribution] = field(default_factory=dict, repr=False)

    @property
    def init_value(self) -> torch.Tensor:
        """The initial posterior location (a buffer that follows ``module.to(...)``)."""
        return getattr(self.module, _INIT_PREFIX + self.param_name)

    @property
    def shape(self) -> torch.Size:
        return self.init_value.shape

    def __call__(self, module: nn.Module) -> dist.Distribution:
        """The prior distribution, built once per device and dtype (``PyroSample`` calls this)."""
        like = self.init_value
        key = (like.device, like.dtype)
        d = self._cache.get(key)
        if d is None:
            d = self.prior(self.module, self.param_name, like)
            d._bdl_site = self  # lets init_to_network and the ELBOs find the spec from a trace
            self._cache.clear()
            self._cache[key] = d
        return d


def _rule_matches(rule: Rule, module: nn.Module, name: str, param: torch.Tensor) -> bool:
    if isinstance(rule, type):
        return isinstance(module, rule)
    if isinstance(rule, str):
        return fnmatch.fnmatchcase(name, rule)
    return bool(rule(module, name, param))


def _check_rules(argument: str, rules: Iterable[Rule]) -> tuple[Rule, ...]:
    if isinstance(rules, (str, type)) or (callable(rules) and not isinstance(rules, Iterable)):
        rules = (rules,)  # type: ignore[assignment]
    rules = tuple(rules)
    for rule in rules:
        if isinstance(rule, type):
            if not issubclass(rule, nn.Module):
                raise TypeError(
                    f"{argument} rule {rule.__name__} is a type but not a torch.nn.Module "
                    "subclass; use a module type (torch.nn.BatchNorm2d), a name glob ('fc.*') "
                    "or a predicate (module, name, param) -> bool."
                )
        elif not isinstance(rule, str) and not callable(rule):
            raise TypeError(
                f"{argument} rules must be module types, parameter-name globs or predicates "
                f"(module, name, param) -> bool; got {type(rule).__name__} {rule!r}."
            )
    return rules


def bayesianize(
    module: nn.Module,
    prior: Prior | Callable[[nn.Module, str, torch.Tensor], dist.Distribution] | None = None,
    *,
    hide: Iterable[Rule] = DEFAULT_HIDE,
    expose: Iterable[Rule] = (),
) -> PyroModule:
    """Convert ``module`` **in place** into a Bayesian :class:`~pyro.nn.PyroModule`.

    Every exposed parameter becomes a :class:`~pyro.nn.PyroSample` site named by its dotted
    parameter name (``"layer1.0.conv1.weight"``) whose distribution is ``prior(module, name,
    param)`` with all dims as event dims. Hidden parameters stay ordinary parameters (Pyro
    registers them as ``pyro.param`` sites, so SVI trains them as point estimates).

    Rules are module types, parameter-name globs (``fnmatch``, on the dotted name) or predicates
    ``(module, name, param) -> bool``. They are applied in order, ``hide`` then ``expose``, and
    the last matching rule wins; a parameter no rule matches is exposed. Passing ``hide``
    replaces the default (normalisation layers); ``expose`` lists exceptions.

    When the weights carry leading sample dims (``Trace_ELBO(vectorize_particles=True)``,
    ``Predictive(parallel=True)``), the network runs once on the batched weights under
    ``torch.func.vmap`` and its output gets the sample dims in front
    (:mod:`pyro_bdl.nn.vectorize`); outside a plate its forward is unchanged.

    Already-lifted sites, and :class:`~pyro.nn.PyroSample`/:class:`~pyro.nn.PyroParam`
    attributes the user declared, are left as they are, so calling it twice is harmless.

    Usage::

        bnn = bdl.bayesianize(torchvision.models.resnet18(num_classes=10),
                              prior=bdl.priors.Normal(scale=1.0))

    :param torch.nn.Module module: any network, including one that is already partly a
        ``PyroModule``.
    :param prior: a :class:`~pyro_bdl.priors.Prior`, or any callable ``(module, name, param) ->
        Distribution`` (default ``priors.Normal(0, 1)``).
    :param hide: rules selecting parameters that stay deterministic.
    :param expose: rules selecting parameters that become random even if hidden.
    :returns: the same object, now a ``PyroModule``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"bayesianize expects a torch.nn.Module; got {type(module).__name__}. "
            "Pass the network itself (for example torchvision.models.resnet18())."
        )
    prior = Normal() if prior is None else prior
    if not callable(prior):
        raise TypeError(
            f"prior must be a pyro_bdl.priors.Prior or a callable (module, name, param) -> "
            f"Distribution; got {type(prior).__name__}."
        )
    rules = [(False, r) for r in _check_rules("hide", hide)]
    rules += [(True, r) for r in _check_rules("expose", expose)]

    # Decide and validate everything before changing the module (fail at the boundary).
    chosen: list[tuple[str, nn.Module, str, torch.Tensor]] = []
    for mod_name, sub in module.named_modules():
        for pname, param in list(sub._parameters.items()):
            if param is None or pname.endswith("_unconstrained"):
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            exposed = True
            for verdict, rule in rules:
                if _rule_matches(rule, sub, full, param):
                    exposed = verdict
            if exposed:
                chosen.append((full, sub, pname, param))
    inits = {}
    for full, sub, pname, param in chosen:
        d = prior(sub, pname, param.detach())
        if not isinstance(d, dist.Distribution) or d.event_shape != param.shape or d.batch_shape:
            raise ValueError(
                f"prior for site {full!r} must return a distribution with batch_shape () and "
                f"event_shape {tuple(param.shape)}; got {d!r}. Use pyro_bdl.priors or expand the "
                "distribution and call .to_event(param.dim())."
            )
        init_loc = getattr(prior, "init_loc", None)
        init = init_loc(sub, pname, param) if init_loc else param.detach().clone()
        inits[full] = init.detach().to(dtype=param.dtype, device=param.device)

    to_pyro_module_(module)
    registry: dict[str, SiteSpec] = dict(getattr(module, _SITES_ATTR, {}))
    for full, sub, pname, _param in chosen:
        spec = SiteSpec(full, sub, pname, prior)
        del sub._parameters[pname]
        sub.register_buffer(_INIT_PREFIX + pname, inits[full], persistent=False)
        setattr(sub, pname, PyroSample(spec))
        registry[full] = spec
    object.__setattr__(module, _SITES_ATTR, registry)
    install_batched_forward(module)
    return module  # type: ignore[return-value]


def sites(module: nn.Module) -> Mapping[str, SiteSpec]:
    """The weight sites that :func:`bayesianize` created in ``module``, in registration order."""
    registry = getattr(module, _SITES_ATTR, None)
    if registry is None:
        raise ValueError(
            f"{type(module).__name__} has no Bayesian sites; call "
            "pyro_bdl.bayesianize(module) first."
        )
    return registry


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
