"""Which parameters :func:`~pyro_bdl.bayesianize` exposes, and the checks it makes on a prior,
all before the module changes (docs/design/lifting.md)."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyro.distributions as dist
import torch
from torch import nn

from pyro_bdl.priors import Prior

__all__ = ["DEFAULT_HIDE", "Rule", "check_prior_value", "check_rules", "exposed", "same_prior"]

Predicate = Callable[[nn.Module, str, torch.Tensor], bool]
Rule = type | str | Predicate

#: Normalisation layers stay deterministic unless exposed: their parameters are few and the
#: posterior over them is poorly identified. ``_NormBase`` covers BatchNorm and InstanceNorm.
DEFAULT_HIDE: tuple[Rule, ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def _rule_matches(rule: Rule, module: nn.Module, name: str, param: torch.Tensor) -> bool:
    if isinstance(rule, type):
        return isinstance(module, rule)
    if isinstance(rule, str):
        return fnmatch.fnmatchcase(name, rule)
    return bool(rule(module, name, param))


def check_rules(argument: str, rules: Iterable[Rule]) -> tuple[Rule, ...]:
    """The rules as a tuple (a single rule is accepted); raises ``TypeError`` on a bad one."""
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


def exposed(
    rules: Sequence[tuple[bool, Rule]],
    module: nn.Module,
    name: str,
    param: torch.Tensor,
    trainable: bool,
) -> bool:
    """The verdict for one parameter: the last matching rule wins; with no match a trainable
    parameter is exposed and a frozen one (``requires_grad=False``) stays hidden."""
    verdict = trainable
    for expose, rule in rules:
        if _rule_matches(rule, module, name, param):
            verdict = expose
    return verdict


def warn_unmatched_globs(rules: Sequence[tuple[bool, Rule]], names: Sequence[str]) -> None:
    """Warn about every name glob that matches no parameter name (most likely a typo)."""
    for expose, rule in rules:
        if isinstance(rule, str) and not any(fnmatch.fnmatchcase(n, rule) for n in names):
            argument = "expose" if expose else "hide"
            sample = ", ".join(map(repr, list(names)[:5])) or "none"
            warnings.warn(
                f"bayesianize: {argument} glob {rule!r} matches no parameter; the names look "
                f"like {sample}. Check the glob against dict(net.named_parameters()).",
                UserWarning,
                stacklevel=3,
            )


def _tensors(d: Any) -> Iterable[torch.Tensor]:
    """The tensors a distribution (and the distributions it wraps) holds."""
    seen: set[int] = set()
    stack = [d]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, torch.distributions.Distribution):
                stack.append(value)


def check_prior_value(name: str, d: Any, param: torch.Tensor) -> None:
    """Refuse a prior distribution of the wrong type, shape, dtype or device for ``param``."""
    if not isinstance(d, dist.Distribution) or d.event_shape != param.shape or d.batch_shape:
        raise ValueError(
            f"prior for site {name!r} must return a distribution with batch_shape () and "
            f"event_shape {tuple(param.shape)}; got {d!r}. Use pyro_bdl.priors or expand the "
            "distribution and call .to_event(param.dim())."
        )
    for t in _tensors(d):
        if t.is_floating_point() and (t.dtype != param.dtype or t.device != param.device):
            raise ValueError(
                f"prior for site {name!r} returned a distribution on {t.dtype} / {t.device}, but "
                f"the parameter is {param.dtype} / {param.device}; sampling it would silently "
                "change the weight's dtype or device. Build the distribution from the param "
                "argument (torch.as_tensor(x, dtype=param.dtype, device=param.device)) or use "
                "pyro_bdl.priors."
            )


def same_prior(a: Any, b: Any) -> bool:
    """Whether two priors declare the same distribution: the same object, or two
    :class:`~pyro_bdl.priors.Prior` s of one class with equal settings."""
    if a is b:
        return True
    return isinstance(a, Prior) and type(a) is type(b) and repr(a) == repr(b)
