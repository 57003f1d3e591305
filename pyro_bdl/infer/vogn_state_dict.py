"""VOGN's ``state_dict``: what it holds, and the checks that refuse a state of another model or
format before anything is restored."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pyro_bdl.infer.vogn_model import Hidden
from pyro_bdl.infer.vogn_update import VOGNState
from pyro_bdl.layout import SiteLayout

__all__ = ["FORMAT", "VERSION", "check_state_dict", "pack_state_dict", "unpack_state_dict"]

FORMAT = "pyro_bdl.infer.VOGN"
VERSION = 2
_KEYS = {
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
#: The keys of the state_dict VOGN wrote when its state was spread over a guide and an optimizer.
_EARLIER_KEYS = {"step", "sites", "hidden", "guide", "optimizer"}


def pack_state_dict(
    state: VOGNState,
    layout: SiteLayout,
    hidden: Sequence[Hidden],
    *,
    temperature: float,
    optimizer: dict[str, Any],
) -> dict[str, Any]:
    """The ``state_dict`` of a VOGN run (detached copies)."""

    def named(tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {h.name: t.detach().clone() for h, t in zip(hidden, tensors)}

    return {
        "format": FORMAT,
        "version": VERSION,
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


def check_state_dict(
    state: Any, layout: SiteLayout | None = None, hidden: Sequence[Hidden] | None = None
) -> None:
    """Refuse anything but a VOGN ``state_dict`` of this format (and, given the model's layout and
    hidden parameters, of this model), naming what differs.

    :raises ValueError: with the reason and the way out.
    """
    if isinstance(state, Mapping) and "format" not in state and set(state) == _EARLIER_KEYS:
        raise ValueError(
            "this VOGN state_dict has the earlier layout (keys 'guide' and 'optimizer' holding "
            "μ, σ, m and s), which this version does not read; restart the run, or resume it "
            "with the pyro_bdl version that wrote it."
        )
    if not isinstance(state, Mapping) or state.get("format") != FORMAT or set(state) != _KEYS:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"not a VOGN state_dict: expected keys {sorted(_KEYS)}; got {got}.")
    if state["version"] != VERSION:
        raise ValueError(
            f"this VOGN state_dict has format version {state['version']!r}; this version of "
            f"pyro_bdl reads version {VERSION}."
        )
    sites = [(str(n), tuple(s)) for n, s in state["sites"]]
    size = sum(int(torch.Size(s).numel()) for _, s in sites)
    for key in ("mean", "momentum", "curvature"):
        if not isinstance(state[key], torch.Tensor) or state[key].shape != (size,):
            raise ValueError(
                f"the VOGN state_dict is damaged: {key!r} must have shape ({size},), the total "
                f"size of its sites; got {getattr(state[key], 'shape', type(state[key]))}."
            )
    groups = (
        state["optimizer"].get("param_groups") if isinstance(state["optimizer"], dict) else None
    )
    if not isinstance(groups, list) or len(groups) != 1 or not {"lr", "betas"} <= set(groups[0]):
        raise ValueError(
            "the VOGN state_dict is damaged: 'optimizer' must be the state_dict of VOGN's "
            "optimizer (one parameter group with 'lr' and 'betas')."
        )
    names = sorted(state["hidden"])
    for key in ("hidden_momentum", "hidden_curvature"):
        if sorted(state[key]) != names:
            raise ValueError(
                f"the VOGN state_dict is damaged: {key!r} has entries {sorted(state[key])}, "
                f"its hidden parameters are {names}."
            )
    if layout is None or hidden is None:
        return
    ours = [(site.name, tuple(site.shape)) for site in layout]
    hidden_ours = {h.name: tuple(h.param.shape) for h in hidden}
    hidden_theirs = {n: tuple(t.shape) for n, t in state["hidden"].items()}
    if ours != sites or hidden_ours != hidden_theirs:
        mismatch = sorted(set(ours) ^ set(sites), key=str)
        mismatch += sorted(set(hidden_ours.items()) ^ set(hidden_theirs.items()), key=str)
        raise ValueError(
            f"the state_dict is from a different model: mismatching sites {mismatch} (name, "
            "shape); load it into the architecture it was saved from."
        )


@torch.no_grad()
def unpack_state_dict(state: Mapping[str, Any], into: VOGNState, hidden: Sequence[Hidden]):
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
