"""Lift any ``torch.nn.Module`` into a Bayesian :class:`~pyro.nn.PyroModule`, declaratively.

See docs/design/lifting.md for the contract: one site per parameter tensor (tied weights stay
tied, :mod:`pyro_bdl.nn.tied`), frozen parameters stay hidden, and a second call that would
change anything is refused unless ``relift=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pyro_bdl.nn import hf_methods, tied
from pyro_bdl.nn.convert import convert_, pyro_classes, set_weight
from pyro_bdl.nn.lift_rules import (
    DEFAULT_HIDE,
    ExposeOnly,
    Rule,
    check_prior_value,
    check_rules,
    check_unmatched,
    exposed,
    same_prior,
)
from pyro_bdl.nn.spec import (
    INIT_PREFIX,
    PriorFn,
    SiteSpec,
    Use,
    constant_buffer_names,
    init_to_network,
    mark_constant,
    site_spec,
)
from pyro_bdl.nn.vectorize import install_batched_forward
from pyro_bdl.priors import Normal, Prior

__all__ = [
    "DEFAULT_HIDE",
    "SiteSpec",
    "bayesianize",
    "constant_buffers",
    "init_to_network",
    "site_spec",
    "sites",
    "unlift",
]

_SITES_ATTR = "_bdl_sites"
#: The uses of each frozen parameter hidden as a buffer, by its first name; the tensor is read
#: from the first use's layer, since moving the network (``.to``, ``.double()``) replaces buffers.
_FROZEN_ATTR = "_bdl_frozen"

#: The parameter tensor each live site was lifted from: a layer still holding one is tied to that
#: site by a call that lifted only part of the network.
_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _make_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parameter_groups(module: nn.Module) -> list[tuple[torch.Tensor, list[Use]]]:
    """Every parameter tensor once (by identity), with all its dotted names, first name first;
    frozen parameters hidden by an earlier call (now buffers) are included."""
    groups: dict[int, tuple[torch.Tensor, list[Use]]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, param in sub._parameters.items():
            if param is None or pname.endswith("_unconstrained"):
                continue
            use = (_make_name(mod_name, pname), sub, pname)
            groups.setdefault(id(param), (param, []))[1].append(use)
    for uses in module.__dict__.get(_FROZEN_ATTR, {}).values():
        tensor = _frozen_tensor(uses)
        groups.setdefault(id(tensor), (tensor, list(uses)))
    return list(groups.values())


def _existing_sites(module: nn.Module) -> list[tuple[str, SiteSpec, dict]]:
    """Sites lifted by earlier calls anywhere in ``module``: (name from ``module``, spec, the
    registry that holds it)."""
    out, seen = [], set()
    for rel, sub in module.named_modules():
        registry = sub.__dict__.get(_SITES_ATTR, {})
        for spec in registry.values():
            if id(spec) not in seen:
                seen.add(id(spec))
                out.append((_make_name(rel, spec.name), spec, registry))
    return out


def _check_not_inside(module: nn.Module, existing: list[tuple[str, SiteSpec, dict]]) -> None:
    """Refuse ``module`` if a layer in it reads a site that an earlier call registered on a
    network around it: this call would not see that site, so a new prior or new rules for it
    would be dropped silently."""
    known = {id(spec) for _, spec, _ in existing}
    for sub in module.modules():
        for value in sub.__dict__.get("_pyro_samples", {}).values():
            if isinstance(value, SiteSpec) and id(value) not in known:
                raise ValueError(
                    f"{type(module).__name__} is part of a network that an earlier bayesianize "
                    f"call lifted: it reads that network's site {value.name!r}, which a call on "
                    "a part of it cannot change. Call bayesianize on the whole network (with "
                    "relift=True to change its prior or rules): bayesianize(net, prior, "
                    "relift=True)."
                )


def constant_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers that :func:`bayesianize` added anywhere in ``module`` and that no forward
    pass writes: the lifted weights' initial locations and the frozen parameters it hid. A
    rollback of a pass need not copy them (for a frozen base model, that copy would double its
    memory)."""
    return [
        b
        for sub in module.modules()
        for n in constant_buffer_names(sub)
        if (b := sub._buffers[n]) is not None
    ]


def _frozen_tensor(uses: tuple[Use, ...]) -> torch.Tensor:
    _, layer, attr = uses[0]
    tensor = layer._buffers[attr]
    assert tensor is not None  # registered by _freeze
    return tensor


def _distinct(uses: Iterable[Use]) -> list[Use]:
    """One use per (layer, attribute): a layer reachable under several paths holds it once."""
    out, seen = [], set()
    for use in uses:
        if (id(use[1]), use[2]) not in seen:
            seen.add((id(use[1]), use[2]))
            out.append(use)
    return out


def _decide(rules, groups):
    """(groups to lift, frozen groups to hide) under ``rules``; raises on a tied parameter whose
    names get different verdicts, on one an earlier call lifted in another layer and on an
    exposed parameter that is not floating point."""
    lift, freeze = [], []
    for param, uses in groups:
        earlier = _SOURCES.get(param)
        if earlier is not None:
            raise ValueError(
                f"parameter {uses[0][0]!r} is the tensor that an earlier bayesianize call lifted "
                f"as site {earlier.name!r} of {type(earlier.module).__name__}; this call would "
                "untie them (the layers would read different weights). Lift the whole network "
                "in one bayesianize call, on a fresh copy."
            )
        trainable = bool(param.requires_grad)
        verdicts = {full: exposed(rules, sub, full, param, trainable) for full, sub, _ in uses}
        if len(set(verdicts.values())) > 1:
            raise ValueError(
                f"parameter {uses[0][0]!r} is tied (one tensor under the names "
                f"{list(verdicts)}), but the hide/expose rules expose "
                f"{[n for n, v in verdicts.items() if v]} and hide "
                f"{[n for n, v in verdicts.items() if not v]}. A tied weight is one site: make "
                "the rules agree on all its names."
            )
        if verdicts[uses[0][0]]:
            if not param.is_floating_point():
                raise TypeError(
                    f"parameter {uses[0][0]!r} has dtype {param.dtype}; only floating-point "
                    "parameters can become random. Remove it from expose= (it stays hidden)."
                )
            lift.append((param, uses))
        elif not trainable and isinstance(param, nn.Parameter):
            freeze.append((param, uses))
    return lift, freeze


def _init_location(prior: Any, name: str, sub: nn.Module, pname: str, param: torch.Tensor):
    init_loc = getattr(prior, "init_loc", None)
    init = init_loc(sub, pname, param) if init_loc else param.detach().clone()
    if not isinstance(init, torch.Tensor) or init.shape != param.shape:
        raise ValueError(
            f"prior.init_loc for site {name!r} must return a tensor of shape "
            f"{tuple(param.shape)}; got {getattr(init, 'shape', type(init).__name__)}."
        )
    return init.detach().to(dtype=param.dtype, device=param.device)


def _change_error(new: list[str], reprior: list[str], dropped: list[str]) -> ValueError:
    parts = []
    if reprior:
        parts.append(f"give the lifted sites {reprior} a different prior")
    if new:
        parts.append(f"lift the parameters {new}")
    if dropped:
        parts.append(f"make the lifted sites {dropped} deterministic")
    return ValueError(
        "bayesianize was already called on this network, and this call would "
        + "; ".join(parts)
        + ". Pass relift=True to lift again with this prior and these rules (each site keeps "
        "its current initial location), or lift a fresh copy of the network."
    )


def _lift(module, prior, param, uses, inits, registry) -> None:
    name, owner, pname = uses[0]
    spec = SiteSpec(name, owner, pname, prior, tuple(u[0] for u in uses[1:]))
    spec.trainable = bool(param.requires_grad)
    for full, sub, attr in _distinct(uses):
        # A frozen parameter hidden by an earlier call is a buffer now.
        sub._parameters.pop(attr, None)
        sub._buffers.pop(attr, None)
        mark_constant(sub, attr, False)
        if sub is owner and attr == pname:
            sub.register_buffer(INIT_PREFIX + attr, inits[name], persistent=False)
            if not sub.__dict__.get(_LOADS_ATTR):
                sub.register_load_state_dict_pre_hook(load_lifted_weights)
                object.__setattr__(sub, _LOADS_ATTR, True)
        else:
            tied.install_alias(sub, attr, spec, full)
            spec.alias_uses.append((full, sub, attr))
        set_weight(sub, attr, PyroSample(spec))
    module.__dict__.get(_FROZEN_ATTR, {}).pop(name, None)
    registry[name] = spec
    if isinstance(param, nn.Parameter):
        _SOURCES[param] = spec


#: Set on a layer once :func:`load_lifted_weights` is registered on it.
_LOADS_ATTR = "_bdl_loads_lifted_weights"


def load_lifted_weights(
    layer: nn.Module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
) -> None:
    """A ``load_state_dict`` pre-hook of a lifted layer: the value of a lifted weight in the
    state_dict (a pretrained network's ``"0.weight"``) becomes the site's initial location, the
    one :func:`init_to_network` starts a guide from, instead of an unexpected key. A tied
    weight's other names are taken as the same tensor; a shape that differs is a load error."""
    for attr, prior in layer.__dict__.get("_pyro_samples", {}).items():
        key = prefix + attr
        if not isinstance(prior, SiteSpec) or key not in state_dict:
            continue
        value = state_dict.pop(key)
        target = layer._buffers.get(INIT_PREFIX + attr)
        if target is None:  # a tied name of a site another layer holds
            continue
        if value.shape != target.shape:
            errors.append(
                f"size mismatch for {key}: copying a weight of shape {tuple(value.shape)} into "
                f"the lifted site of shape {tuple(target.shape)}."
            )
            continue
        with torch.no_grad():
            target.copy_(value)


def _freeze(module, param, uses) -> None:
    tensor = param.detach()  # one tensor for every name: a tied frozen weight stays tied
    distinct = _distinct(uses)
    for _, sub, attr in distinct:
        del sub._parameters[attr]
        sub.register_buffer(attr, tensor)
        mark_constant(sub, attr, True)
    frozen = module.__dict__.setdefault(_FROZEN_ATTR, {})
    frozen[uses[0][0]] = tuple(uses)
    if len(distinct) > 1:
        object.__setattr__(module, "_apply", functools.partial(_apply_tied, module))


def _apply_tied(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``module._apply`` (``.to``, ``.double()``, ``.cuda()``), after which every tied frozen
    weight is one tensor again: torch replaces buffers layer by layer, giving each its copy."""
    type(module)._apply(module, *args, **kwargs)
    for uses in module.__dict__.get(_FROZEN_ATTR, {}).values():
        tensor = _frozen_tensor(uses)
        for _, sub, attr in uses[1:]:
            sub._buffers[attr] = tensor
    return module


def _unlift(module, spec: SiteSpec, registry: dict) -> None:
    """Make a lifted site an ordinary parameter again, at its current initial location."""
    value = spec.init_value.detach().clone()
    param = nn.Parameter(value, requires_grad=spec.trainable)
    uses: list[Use] = [(spec.name, spec.module, spec.param_name), *spec.alias_uses]
    for _, sub, attr in uses:
        delattr(sub, attr)
        tied.remove_alias(sub, attr)
    delattr(spec.module, INIT_PREFIX + spec.param_name)
    for _, sub, attr in uses:
        set_weight(sub, attr, param)
    registry.pop(spec.name, None)
    if not spec.trainable:
        _freeze(module, param, uses)


def bayesianize(
    module: nn.Module,
    prior: Prior | PriorFn | None = None,
    *,
    hide: Iterable[Rule] = DEFAULT_HIDE,
    expose: Iterable[Rule] = (),
    relift: bool = False,
) -> PyroModule:
    """Convert ``module`` **in place** into a Bayesian :class:`~pyro.nn.PyroModule`.

    Every exposed parameter becomes a :class:`~pyro.nn.PyroSample` site named by its dotted
    parameter name (``"layer1.0.conv1.weight"``) whose distribution is ``prior(module, name,
    param)`` with all dims as event dims. Hidden trainable parameters stay ordinary parameters
    (Pyro registers them as ``pyro.param`` sites, so SVI trains them as point estimates).

    Rules are module types, parameter-name globs (``fnmatch``, on the dotted name) or predicates
    ``(module, name, param) -> bool``. They are applied in order, ``hide`` then ``expose``, and
    the last matching rule wins. A parameter no rule matches is exposed, unless it is frozen
    (``requires_grad=False``). Passing ``hide`` replaces the default (normalisation layers);
    ``expose`` lists exceptions. A glob that matches no parameter name draws a ``UserWarning``.

    **Frozen parameters** stay hidden and fixed: they become buffers under the same
    ``state_dict`` keys, so neither Pyro's parameter store nor SVI sees or trains them. An
    ``expose`` rule that matches one makes it random like any other weight (its
    :attr:`SiteSpec.trainable` is then ``False``). Non-floating parameters cannot be exposed.

    **Tied weights** (one tensor under several names: two layers holding the same
    ``nn.Parameter``, or one layer instance used twice) are one site, named by the first dotted
    name; every layer reads the same sampled value in a forward pass, and the other names are
    listed in :attr:`SiteSpec.aliases` (see :mod:`pyro_bdl.nn.tied`). The rules must give all
    names of a tied weight the same verdict.

    **Calling it again** on a lifted network with the same prior and rules changes nothing. A
    call that would change anything (another prior, or rules that lift or hide other
    parameters) raises a ``ValueError`` naming the sites, unless ``relift=True``: then the
    sites get the new prior, newly exposed parameters are lifted and newly hidden sites become
    ordinary parameters again, every site keeping its current initial location.
    :class:`~pyro.nn.PyroSample`/:class:`~pyro.nn.PyroParam` attributes the user declared are
    left as they are.

    **Any layer** lifts: recurrent layers, attention, embeddings, Hugging Face models and PEFT
    adapters (layer classes with their own metaclass included; :mod:`pyro_bdl.nn.convert`).
    A layer that cannot be lifted (TorchScript, gradient checkpointing on) raises
    :class:`~pyro_bdl.nn.LayerNotLiftable` naming it and the way out; every check runs before
    the network changes, so a refused call leaves it as it was. To make only a PEFT model's
    LoRA matrices random, pass ``expose=bdl.nn.lora`` (or ``bdl.nn.lora_and_head``): an
    :class:`~pyro_bdl.nn.ExposeOnly` rule, which hides every parameter no ``expose`` rule
    matches. docs/methods/layers.md says which method supports which layer. :func:`unlift`
    turns the sites back into ordinary parameters holding chosen values (a guide's median), for
    code that reads the weights directly (PEFT's ``save_pretrained``, refused until then).

    When the weights carry leading sample dims (``Trace_ELBO(vectorize_particles=True)``,
    ``Predictive(parallel=True)``), the network runs once on the batched weights under
    ``torch.func.vmap`` and its output gets the sample dims in front
    (:mod:`pyro_bdl.nn.vectorize`); outside a plate its forward is unchanged.

    Usage::

        bnn = bdl.bayesianize(torchvision.models.resnet18(num_classes=10),
                              prior=bdl.priors.Normal(scale=1.0))

    :param torch.nn.Module module: any network, including one that is already partly a
        ``PyroModule``.
    :param prior: a :class:`~pyro_bdl.priors.Prior`, or any callable ``(module, name, param) ->
        Distribution`` on ``param``'s dtype and device (default ``priors.Normal(0, 1)``).
    :param hide: rules selecting parameters that stay deterministic.
    :param expose: rules selecting parameters that become random even if hidden or frozen.
    :param bool relift: on an already-lifted network, apply this prior and these rules.
    :returns: the same object, now a ``PyroModule``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"bayesianize expects a torch.nn.Module; got {type(module).__name__}. "
            "Pass the network itself (for example torchvision.models.resnet18())."
        )
    prior = Normal() if prior is None else prior
    # A distribution and a class are callable too, but not as (module, name, param).
    use = (
        "Use bdl.priors.Normal(loc, scale) (or Laplace, ScaleMixtureNormal), or a callable "
        "returning dist.Normal(0, 1).expand(param.shape).to_event(param.dim())."
    )
    got = None
    if isinstance(prior, torch.distributions.Distribution):
        got = f"the distribution {type(prior).__name__}, which has no shape for each weight. {use}"
    elif isinstance(prior, type):
        instance = f"Pass an instance: bdl.priors.{prior.__name__}()."
        got = f"the class {prior.__name__}. {instance if issubclass(prior, Prior) else use}"
    elif not callable(prior):
        got = f"{type(prior).__name__}."
    if got is not None:
        raise TypeError(
            "prior must be a pyro_bdl.priors.Prior or a callable (module, name, param) -> "
            f"Distribution; got {got}"
        )
    rules = [(False, r) for r in check_rules("hide", hide)]
    # An ExposeOnly rule may leave out parts of this network (PEFT's inactive adapters).
    rules += [
        (True, r.bound(module) if isinstance(r, ExposeOnly) else r)
        for r in check_rules("expose", expose)
    ]

    # Decide and validate everything before changing the module (fail at the boundary).
    groups = _parameter_groups(module)
    existing = _existing_sites(module)
    _check_not_inside(module, existing)
    names = [u[0] for _, uses in groups for u in uses]
    names += [n for name, spec, _ in existing for n in (name, *spec.aliases)]
    uses = [(*u, p) for p, us in groups for u in us]
    uses += [(n, spec.module, spec.param_name, spec.init_value) for n, spec, _ in existing]
    check_unmatched(rules, names, uses)
    lift, freeze = _decide(rules, groups)
    reprior = [n for n, spec, _ in existing if not same_prior(spec.prior, prior)]
    dropped = [
        (n, spec, registry)
        for n, spec, registry in existing
        if not exposed(rules, spec.module, n, spec.init_value, spec.trainable)
    ]
    lifted_before = _SITES_ATTR in module.__dict__ or bool(existing)
    new = [uses[0][0] for _, uses in lift] if lifted_before else []
    if (new or reprior or dropped) and not relift:
        raise _change_error(new, reprior, [n for n, _, _ in dropped])
    kept = [(n, s) for n, s, _ in existing if all(s is not d[1] for d in dropped)]
    for name, spec in kept:
        if name in reprior:
            like = spec.init_value
            check_prior_value(name, prior(spec.module, spec.param_name, like), like)
    for param, (name, sub, pname) in ((p, uses[0]) for p, uses in lift):
        check_prior_value(name, prior(sub, pname, param.detach()), param)
    pyro_classes(module)  # refuses a layer that cannot become a PyroModule
    # Last: an initial location drawn from the prior moves the RNG.
    inits = {}
    for param, (name, sub, pname) in ((p, uses[0]) for p, uses in lift):
        inits[name] = _init_location(prior, name, sub, pname, param)

    convert_(module)
    tied.install_first_path_naming(module)
    registry: dict[str, SiteSpec] = dict(module.__dict__.get(_SITES_ATTR, {}))
    for _, spec, holder in dropped:
        _unlift(module, spec, registry if holder is module.__dict__.get(_SITES_ATTR) else holder)
    for name, spec in kept:
        if name in reprior:
            spec.set_prior(prior)
    for param, uses in freeze:
        _freeze(module, param, uses)
    for param, uses in lift:
        _lift(module, prior, param, uses, inits, registry)
    object.__setattr__(module, _SITES_ATTR, registry)
    install_batched_forward(module)
    (hf_methods.guard if _existing_sites(module) else hf_methods.unguard)(module)
    return module  # type: ignore[return-value]


def unlift(module: nn.Module, values: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Make every weight site of a lifted ``module`` an ordinary parameter again (a frozen
    one a buffer again), holding ``values[name]``, or its initial location for a site that
    ``values`` leaves out: the network as code that reads its weights directly expects it.

    A Hugging Face/PEFT user saves the adapters trained as random sites this way (PEFT's
    ``save_pretrained``, ``merge_and_unload``, ``merge_adapter`` and ``set_adapter``, and
    turning gradient checkpointing on, are refused on the lifted network:
    :mod:`pyro_bdl.nn.hf_methods`)::

        bdl.nn.unlift(net, guide.median())   # the posterior mean of a Gaussian guide
        net.save_pretrained("adapter")       # or net.merge_and_unload()

    Everything is checked before the network changes. :func:`bayesianize` lifts it again.

    :param torch.nn.Module module: a network lifted by :func:`bayesianize`.
    :param values: the value of each site, by site name: ``guide.median()``, or one draw
        ``{name: draws[name][k]}`` of a ``Predictive``; each takes the site's dtype and device.
    :returns: the same object, with no weight sites (:func:`sites` refuses it, as a fresh one).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"unlift expects the lifted torch.nn.Module; got {type(module).__name__}. Pass the "
            "network bayesianize returned (a ready-made model's is model.net)."
        )
    existing = _existing_sites(module)
    if not existing:
        raise ValueError(
            f"unlift expects a network lifted by bayesianize; {type(module).__name__} has no "
            "weight site. Pass the network bayesianize returned."
        )
    values = {} if values is None else values
    if not isinstance(values, Mapping):
        raise TypeError(
            f"values must map site names to tensors (guide.median()); got {type(values).__name__}."
        )
    by_name = {name: spec for name, spec, _ in existing}
    unknown = [k for k in values if k not in by_name]
    if unknown:
        raise ValueError(
            f"values names {unknown}, which are not weight sites of this network (its sites "
            f"look like {list(by_name)[:3]}). Drop them: {{k: v for k, v in values.items() if "
            "k in bdl.sites(net)}."
        )
    for name, value in values.items():
        shape = by_name[name].shape
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"values[{name!r}] must be a tensor of the site's shape {tuple(shape)}; got "
                f"{type(value).__name__}. Pass one tensor of that shape per site (guide.median() "
                "gives them)."
            )
        if value.shape != shape:
            raise ValueError(
                f"values[{name!r}] must be a tensor of the site's shape {tuple(shape)}; got "
                f"{tuple(value.shape)}. Pass one tensor of that shape per site (guide.median() "
                "gives them)."
            )
    for name, spec, registry in existing:
        if name in values:
            with torch.no_grad():
                spec.init_value.copy_(values[name].detach())
        _unlift(module, spec, registry)
    for sub in module.modules():
        if not sub.__dict__.get(_SITES_ATTR, True):
            del sub.__dict__[_SITES_ATTR]  # a fresh network again: bayesianize lifts it anew
    hf_methods.unguard(module)
    return module


def sites(module: nn.Module) -> Mapping[str, SiteSpec]:
    """The weight sites that :func:`bayesianize` created in ``module``, in registration order."""
    registry = getattr(module, _SITES_ATTR, None)
    if registry is None:
        raise ValueError(
            f"{type(module).__name__} has no Bayesian sites; call "
            "pyro_bdl.bayesianize(module) first."
        )
    return registry
