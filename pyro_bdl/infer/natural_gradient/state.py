"""The state of natural-gradient VI, shared by VOGN and IVON, and its ``state_dict``: what it
holds, and the checks that refuse a state of another model or format before anything is restored
(IVON's holds the same state without a temperature)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pyro_bdl.infer.natural_gradient.checks import betas_ok, lr_ok
from pyro_bdl.infer.natural_gradient.model import Hidden
from pyro_bdl.layout import SiteLayout

__all__ = [
    "NaturalGradientState",
    "StateFormat",
    "check_state_dict",
    "check_values",
    "initial_state",
    "map_tensors",
    "pack_state_dict",
    "state_tensors",
    "unpack_state_dict",
    "with_hidden",
]


@dataclass
class NaturalGradientState:
    r"""Everything a natural-gradient update changes, in one object (VOGN's and IVON's).

    :ivar mean: μ, the flat posterior mean of every weight site, ``(D,)``.
    :ivar momentum: the running average of ĝ (VOGN's m, IVON's g), like ``mean``.
    :ivar curvature: the running average of ĥ (VOGN's s, IVON's h), like ``mean``.
    :ivar hidden: the hidden point-estimate parameters (the network's own tensors).
    :ivar hidden_momentum: the momentum of each hidden parameter.
    :ivar hidden_curvature: the curvature of each hidden parameter.
    :ivar int step: the number of updates done.
    """

    mean: torch.Tensor
    momentum: torch.Tensor
    curvature: torch.Tensor
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    hidden_momentum: list[torch.Tensor] = dataclasses.field(default_factory=list)
    hidden_curvature: list[torch.Tensor] = dataclasses.field(default_factory=list)
    step: int = 0


def initial_state(layout: SiteLayout, hidden: Sequence[Hidden]) -> NaturalGradientState:
    """μ at the lifted weights' initial values, the hidden parameters themselves, every moment
    zero."""
    specs = [s.spec for s in layout if s.spec is not None]
    mean = torch.cat([spec.init_value.detach().reshape(-1) for spec in specs]).clone()
    params: list[torch.Tensor] = [h.param for h in hidden]
    return NaturalGradientState(
        mean=mean,
        momentum=torch.zeros_like(mean),
        curvature=torch.zeros_like(mean),
        hidden=params,
        hidden_momentum=[torch.zeros_like(p) for p in params],
        hidden_curvature=[torch.zeros_like(p) for p in params],
    )


#: The keys of every method's state_dict; a method without a temperature leaves that one out.
KEYS = frozenset(
    {
        "format",
        "version",
        "step",
        "sites",
        "hidden",
        "mean",
        "momentum",
        "curvature",
        "hidden_momentum",
        "hidden_curvature",
        "temperature",
        "optimizer",
    }
)


@dataclass(frozen=True)
class StateFormat:
    """What identifies one method's ``state_dict``.

    :ivar str method: the method's name in the messages (``"VOGN"``).
    :ivar str name: the ``"format"`` entry.
    :ivar int version: the ``"version"`` entry this release reads and writes.
    :ivar bool temperature: whether the state holds a temperature.
    :ivar frozenset earlier_keys: the keys of an earlier layout to refuse by name (or empty).
    :ivar bool nonnegative_curvature: whether the curvature of the weights is >= 0 (VOGN's, an
        average of squares; IVON's h may dip below 0 as long as h + δ > 0).
    """

    method: str
    name: str
    version: int
    temperature: bool
    earlier_keys: frozenset[str] = frozenset()
    nonnegative_curvature: bool = False

    @property
    def keys(self) -> frozenset[str]:
        return KEYS if self.temperature else KEYS - {"temperature"}


def pack_state_dict(
    state: NaturalGradientState,
    layout: SiteLayout,
    hidden: Sequence[Hidden],
    *,
    temperature: float,
    optimizer: dict[str, Any],
    spec: StateFormat,
) -> dict[str, Any]:
    """The ``state_dict`` of a run in format ``spec`` (detached copies)."""
    fmt, version, keys = spec.name, spec.version, spec.keys

    def named(tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {h.name: t.detach().clone() for h, t in zip(hidden, tensors)}

    out = {
        "format": fmt,
        "version": version,
        "step": state.step,
        "sites": [(site.name, tuple(site.shape)) for site in layout],
        "hidden": named(state.hidden),
        "mean": state.mean.detach().clone(),
        "momentum": state.momentum.detach().clone(),
        "curvature": state.curvature.detach().clone(),
        "hidden_momentum": named(state.hidden_momentum),
        "hidden_curvature": named(state.hidden_curvature),
        "temperature": float(temperature),
        "optimizer": optimizer,
    }
    return {k: v for k, v in out.items() if k in keys}


def check_state_dict(
    state: Any,
    layout: SiteLayout | None = None,
    hidden: Sequence[Hidden] | None = None,
    *,
    spec: StateFormat,
) -> None:
    """Refuse anything but a ``state_dict`` in format ``spec`` (and, given the model's layout and
    hidden parameters, of this model), naming what differs.

    :raises ValueError: with the reason and the way out.
    """
    method, fmt, version, keys = spec.method, spec.name, spec.version, spec.keys
    fix = f"Nothing was loaded; pass a state_dict that {method.lower()}.state_dict() returned."
    if (
        spec.earlier_keys
        and isinstance(state, Mapping)
        and "format" not in state
        and set(state) == spec.earlier_keys
    ):
        raise ValueError(
            f"this {method} state_dict has the earlier layout (keys 'guide' and 'optimizer' "
            "holding μ, σ, m and s), which this version does not read; restart the run, or "
            "resume it with the pyro_bdl version that wrote it."
        )
    if not isinstance(state, Mapping) or state.get("format") != fmt or set(state) != keys:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"not a {method} state_dict: expected format {fmt!r} and keys {sorted(keys)}; got "
            f"{got} (format {state.get('format') if isinstance(state, Mapping) else None!r}). "
            + fix
        )
    if state["version"] != version:
        raise ValueError(
            f"this {method} state_dict has format version {state['version']!r}; this version of "
            f"pyro_bdl reads version {version}. Resume it with the pyro_bdl version that wrote "
            "it, or restart the run."
        )
    try:
        sites = [(str(n), tuple(int(d) for d in s)) for n, s in state["sites"]]
    except (TypeError, ValueError):
        raise ValueError(
            f"the {method} state_dict is damaged: 'sites' must be a list of (name, shape) pairs; "
            f"got {state['sites']!r:.80}. " + fix
        ) from None
    step, temperature = state["step"], state.get("temperature", 1.0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"the {method} state_dict is damaged: 'step' must be an int >= 0; got {step!r}. " + fix
        )
    if not isinstance(temperature, (int, float)) or not 0 < float(temperature) < float("inf"):
        raise ValueError(
            f"the {method} state_dict is damaged: 'temperature' must be a number > 0; got "
            f"{temperature!r}. " + fix
        )
    size = sum(int(torch.Size(s).numel()) for _, s in sites)
    for key in ("mean", "momentum", "curvature"):
        value = state[key]
        if (
            not isinstance(value, torch.Tensor)
            or value.shape != (size,)
            or not value.is_floating_point()
        ):
            raise ValueError(
                f"the {method} state_dict is damaged: {key!r} must have shape ({size},), the total "
                f"size of its sites; got {getattr(state[key], 'shape', type(state[key]))}. " + fix
            )
    groups = (
        state["optimizer"].get("param_groups") if isinstance(state["optimizer"], dict) else None
    )
    if (
        not isinstance(groups, list)
        or len(groups) != 1
        or not isinstance(groups[0], Mapping)
        or not {"lr", "betas", "params"} <= set(groups[0])
        or len(groups[0]["params"]) != 1
        or not isinstance(state["optimizer"].get("state"), Mapping)
    ):
        raise ValueError(
            f"the {method} state_dict is damaged: 'optimizer' must be the state_dict of {method}'s "
            "optimizer (a 'state' dict and one parameter group with 'lr', 'betas' and its one "
            f"placeholder parameter); got {type(state['optimizer']).__name__}. " + fix
        )
    if not (lr_ok(groups[0]["lr"]) and betas_ok(groups[0]["betas"])):
        raise ValueError(
            f"the {method} state_dict is damaged: its optimizer needs a finite lr >= 0 (a "
            f"schedule may end at 0) and betas, two numbers in [0, 1); got "
            f"lr={groups[0]['lr']!r}, betas={groups[0]['betas']!r}. " + fix
        )
    shapes = {}
    for key in ("hidden", "hidden_momentum", "hidden_curvature"):
        if not isinstance(state[key], Mapping) or not all(
            isinstance(t, torch.Tensor) for t in state[key].values()
        ):
            raise ValueError(
                f"the {method} state_dict is damaged: {key!r} must map names to tensors; got "
                f"{state[key]!r:.80}. " + fix
            )
        shapes[key] = {str(n): tuple(t.shape) for n, t in state[key].items()}
    for key in ("hidden_momentum", "hidden_curvature"):
        if shapes[key] != shapes["hidden"]:
            raise ValueError(
                f"the {method} state_dict is damaged: {key!r} has entries "
                f"{sorted(shapes[key].items())}, its hidden parameters are "
                f"{sorted(shapes['hidden'].items())} (name, shape). " + fix
            )
    check_values(state, spec)
    if layout is None or hidden is None:
        return
    ours = [(site.name, tuple(site.shape)) for site in layout]
    hidden_ours = {h.name: tuple(h.param.shape) for h in hidden}
    hidden_theirs = {n: tuple(t.shape) for n, t in state["hidden"].items()}
    if ours != sites or hidden_ours != hidden_theirs:
        mismatch = [f"site {n!r} {s}: only in the state" for n, s in sorted(set(sites) - set(ours))]
        mismatch += [
            f"site {n!r} {s}: only in this model" for n, s in sorted(set(ours) - set(sites))
        ]
        for name in sorted(set(hidden_ours) | set(hidden_theirs)):
            theirs, own = hidden_theirs.get(name), hidden_ours.get(name)
            if theirs != own:
                mismatch.append(f"hidden {name!r}: the state has {theirs}, this model {own}")
        if not mismatch:
            mismatch = ["the same sites in another order"]
        raise ValueError(
            "the state_dict is from a different model: mismatching sites (name, shape): "
            + "; ".join(mismatch)
            + ". Load it into the architecture it was saved from."
        )


def check_values(state: Mapping[str, Any], spec: StateFormat) -> None:
    """Refuse a state_dict (of the right layout) holding NaN or inf anywhere, or a negative
    curvature where the method's is a mean of squares (every hidden parameter's curvature, and
    the weights' where ``spec.nonnegative_curvature``): loaded, it would refuse every later step
    or give NaN posterior scales."""
    method = spec.method
    named = [(repr(key), state[key]) for key in ("mean", "momentum", "curvature")]
    for key in ("hidden", "hidden_momentum", "hidden_curvature"):
        named += [(f"{key}[{n!r}]", t) for n, t in state[key].items()]
    for key, tensor in named:
        if not tensor.is_floating_point():
            raise ValueError(
                f"the {method} state_dict is damaged: {key} must be floating point; got "
                f"{tensor.dtype}. Nothing was loaded."
            )
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"the {method} state_dict is damaged: {key} holds {int(bad.sum())} non-finite "
                f"value(s) (NaN or inf), the first at index {first}. Nothing was loaded; load a "
                "checkpoint from before the run diverged."
            )
    floors = [(f"hidden_curvature[{n!r}]", t) for n, t in state["hidden_curvature"].items()]
    if spec.nonnegative_curvature:
        floors.insert(0, ("'curvature'", state["curvature"]))
    for key, tensor in floors:
        if tensor.numel() and float(tensor.min()) < 0:
            first = tuple(int(i) for i in (tensor < 0).nonzero()[0])
            raise ValueError(
                f"the {method} state_dict is damaged: {key} must be >= 0 (a mean of squared "
                f"gradients); got {float(tensor.min())!r} (first negative entry at index {first}). "
                "Nothing was loaded; load a checkpoint from before the run diverged."
            )


@torch.no_grad()
def unpack_state_dict(
    state: Mapping[str, Any], into: NaturalGradientState, hidden: Sequence[Hidden]
) -> NaturalGradientState:
    """Copy a checked ``state_dict`` into the tensors of ``into``; returns the restored state."""
    into.mean.copy_(state["mean"])
    into.momentum.copy_(state["momentum"])
    into.curvature.copy_(state["curvature"])
    for h, p, m, s in zip(hidden, into.hidden, into.hidden_momentum, into.hidden_curvature):
        p.copy_(state["hidden"][h.name])
        m.copy_(state["hidden_momentum"][h.name])
        s.copy_(state["hidden_curvature"][h.name])
    into.step = int(state["step"])
    return into


def state_tensors(state: NaturalGradientState) -> list[torch.Tensor]:
    """The mean, momentum and curvature, then the hidden parameters and their moments."""
    hidden = [*state.hidden, *state.hidden_momentum, *state.hidden_curvature]
    return [state.mean, state.momentum, state.curvature, *hidden]


def with_hidden(
    state: NaturalGradientState, keep: Sequence[bool], like: NaturalGradientState | None = None
) -> NaturalGradientState:
    """``state`` with the hidden parameters and their moments of ``like`` (all of them), or, by
    default, only those of ``state`` where ``keep`` (the same tensors, not copies)."""
    if like is not None:
        hidden, momentum, curvature = like.hidden, like.hidden_momentum, like.hidden_curvature
    else:
        hidden, momentum, curvature = (
            [t for t, k in zip(tensors, keep) if k]
            for tensors in (state.hidden, state.hidden_momentum, state.hidden_curvature)
        )
    return dataclasses.replace(
        state, hidden=hidden, hidden_momentum=momentum, hidden_curvature=curvature
    )


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a state_dict) with ``fn`` applied to every tensor inside its dicts, lists and
    tuples."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value
