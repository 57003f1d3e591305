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

from pyro_bdl._caller import user_stacklevel
from pyro_bdl.priors import Prior

__all__ = [
    "DEFAULT_HIDE",
    "ExposeOnly",
    "Rule",
    "check_prior_value",
    "check_rules",
    "exposed",
    "lora",
    "lora_and_head",
    "same_prior",
]

Predicate = Callable[[nn.Module, str, torch.Tensor], bool]
Rule = type | str | Predicate

#: Normalisation layers stay deterministic unless exposed: their parameters are few and the
#: posterior over them is poorly identified. ``_NormBase`` covers BatchNorm and InstanceNorm;
#: ``nn.RMSNorm`` exists from torch 2.4 on.
DEFAULT_HIDE: tuple[Rule, ...] = tuple(
    layer
    for layer in (
        nn.modules.batchnorm._NormBase,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
    )
    if layer is not None
)


class ExposeOnly:
    """An ``expose`` rule that also hides every parameter that no ``expose`` rule matches, so
    that ``expose=[rule]`` reads "only these are random" (the rest, frozen or trainable, stays a
    point estimate). Further ``expose`` rules add to it: ``expose=[bdl.nn.lora, "classifier.*"]``.

    :param str name: how errors and ``repr`` name the rule.
    :param predicate: ``(module, name, param) -> bool`` on the dotted parameter name.
    :param str missing: what to tell a user whose network has no matching parameter.
    :param unused: ``root -> prefixes``: the dotted-name prefixes, in the network being lifted,
        of parameters the rule leaves out there (:meth:`bound`).
    """

    def __init__(
        self,
        name: str,
        predicate: Predicate,
        missing: str,
        unused: Callable[[nn.Module], tuple[str, ...]] | None = None,
    ):
        self.name, self.predicate, self.missing, self.unused = name, predicate, missing, unused

    def __call__(self, module: nn.Module, name: str, param: torch.Tensor) -> bool:
        return bool(self.predicate(module, name, param))

    def bound(self, root: nn.Module) -> ExposeOnly:
        """This rule for the network ``root``: also false on the names under ``unused(root)``."""
        if self.unused is None:
            return self
        prefixes = self.unused(root)
        if not prefixes:
            return self

        def predicate(module: nn.Module, name: str, param: torch.Tensor) -> bool:
            return self.predicate(module, name, param) and not name.startswith(prefixes)

        return ExposeOnly(self.name, predicate, self.missing)

    def __repr__(self) -> str:
        return f"pyro_bdl.nn.{self.name}"


def _is_lora(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    # PEFT names every LoRA tensor under a lora_* container (lora_A, lora_B, lora_embedding_A,
    # lora_magnitude_vector), whatever the adapter's name; the base layer's weights are not. An
    # adapter may itself be named lora_*: under modules_to_save that is the head's copy.
    parts = name.split(".")
    return any(
        part.startswith("lora_") and (i == 0 or parts[i - 1] != "modules_to_save")
        for i, part in enumerate(parts)
    )


def _is_head(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    # PEFT trains a copy of the task head under modules_to_save (the original stays frozen).
    return "modules_to_save" in name.split(".")


def _inactive_adapters(root: nn.Module) -> tuple[str, ...]:
    """The name prefixes of the adapters of ``root`` that no forward pass reads: a PEFT layer
    (LoRA layer or task-head wrapper; its class lists ``adapter_layer_names``) holds every
    adapter added to the model, and uses only its ``active_adapters``. Random sites there
    would be drawn from the prior in every vectorized pass and never learnt."""
    out = []
    for path, layer in root.named_modules(remove_duplicate=False):
        containers = getattr(type(layer), "adapter_layer_names", None)
        if not containers and isinstance(layer._modules.get("modules_to_save"), nn.ModuleDict):
            containers = ("modules_to_save",)  # PEFT before 0.18 lists none on its head wrapper
        if not containers:
            continue
        # PEFT before 0.15 gives its head wrapper one active_adapter (a name), no active_adapters.
        names: Any = getattr(layer, "active_adapters", None)
        if names is None:
            names = getattr(layer, "active_adapter", ())
        active = {names} if isinstance(names, str) else set(names)
        for container in containers:
            adapters = layer._modules.get(container)  # a ModuleDict or ParameterDict
            for adapter in () if adapters is None else adapters.keys():  # type: ignore[operator]
                if adapter not in active:
                    out.append(".".join(filter(None, (path, container, adapter))) + ".")
    return tuple(out)


_NO_LORA = (
    "the network has no LoRA parameter (no name with a lora_* part); add the adapters first "
    "(peft.get_peft_model(model, peft.LoraConfig(...))), or pass the parameters to make random "
    "as expose= globs."
)

#: Only the LoRA matrices of the active adapters are random; the base network (and the task
#: head, and the adapters ``set_adapter`` did not activate) stay fixed point estimates:
#: ``bayesianize(peft_model, expose=bdl.nn.lora)``.
lora = ExposeOnly("lora", _is_lora, _NO_LORA, _inactive_adapters)

#: The LoRA matrices and the task head that PEFT trains (``modules_to_save``) of the active
#: adapters are random; the base network stays a fixed point estimate.
lora_and_head = ExposeOnly(
    "lora_and_head",
    lambda m, n, p: _is_lora(m, n, p) or _is_head(m, n, p),
    _NO_LORA,
    _inactive_adapters,
)


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
        if isinstance(rule, ExposeOnly) and argument != "expose":
            raise TypeError(
                f"{rule!r} selects the parameters to make random: pass it as expose={rule!r}, "
                f"not as {argument}=."
            )
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
    parameter is exposed and a frozen one (``requires_grad=False``) stays hidden, unless an
    :class:`ExposeOnly` rule is given: then it stays hidden."""
    verdict = trainable and not any(isinstance(rule, ExposeOnly) for _, rule in rules)
    for expose, rule in rules:
        if _rule_matches(rule, module, name, param):
            verdict = expose
    return verdict


def check_unmatched(
    rules: Sequence[tuple[bool, Rule]], names: Sequence[str], uses: Sequence[tuple]
) -> None:
    """Refuse an :class:`ExposeOnly` rule that matches no parameter (``uses``: ``(name, layer,
    attribute, tensor)``) and warn about every name glob that matches no parameter name (most
    likely a typo)."""
    for _, rule in rules:
        if isinstance(rule, ExposeOnly) and not any(rule(m, n, t) for n, m, _, t in uses):
            raise ValueError(f"expose={rule!r}: {rule.missing}")
    for expose, rule in rules:
        if isinstance(rule, str) and not any(fnmatch.fnmatchcase(n, rule) for n in names):
            argument = "expose" if expose else "hide"
            sample = ", ".join(map(repr, list(names)[:5])) or "none"
            warnings.warn(
                f"bayesianize: {argument} glob {rule!r} matches no parameter; the names look "
                f"like {sample}. Check the glob against dict(net.named_parameters()).",
                UserWarning,
                stacklevel=user_stacklevel(),
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
