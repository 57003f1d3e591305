"""Restoring a checkpoint: the fingerprint check that refuses another model before anything
changes, then the param store and the optimizer (their parts checked by :mod:`._checks`)."""

from __future__ import annotations

import pyro
import torch
from pyro.optim.optim import is_scheduler

from pyro_bdl.checkpoint._parts import (
    compare,
    constraint_from_spec,
    constraint_spec,
    has,
    likelihood_of,
    module_fingerprint,
    params_fingerprint,
    qualname,
)

__all__ = ["mismatches", "restore_optim", "restore_params"]


def mismatches(payload, guide, model, modules, generators) -> tuple[list[str], list[str]]:
    """The differences that refuse the file, and the saved parts nobody asked for."""
    saved = payload["fingerprint"]
    out: list[str] = []
    both_guides = guide is not None and saved["guide"] is not None
    if both_guides:
        compare({"class": saved["guide"]}, {"class": qualname(guide)}, "guide", out)
    now_lik = likelihood_of(model, guide)
    shared = set(saved["likelihood"]) & set(now_lik)
    compare(
        {k: saved["likelihood"][k] for k in shared}, {k: now_lik[k] for k in shared}, "model", out
    )
    store = pyro.get_param_store().get_state()
    if store["params"]:  # an empty store is filled from the file instead
        specs = {n: constraint_spec(c) for n, c in store["constraints"].items()}
        compare(saved["params"], params_fingerprint(store["params"], specs), "param", out)
    if both_guides and saved["guide_state"] is not None and isinstance(guide, torch.nn.Module):
        compare(saved["guide_state"], module_fingerprint(guide), "guide key", out)
    for name, m in modules.items():
        if name not in saved["modules"]:
            out.append(f"module {name!r}: only in this process")
        else:
            compare(saved["modules"][name], module_fingerprint(m), f"module {name!r} key", out)
    for name in generators:
        if name not in payload["generators"]:
            out.append(f"generator {name!r}: only in this process")
    unused = [f"module {n!r}" for n in saved["modules"] if n not in modules]
    unused += [f"generator {n!r}" for n in payload["generators"] if n not in generators]
    return out, unused


def restore_params(payload, path: str) -> None:
    live = pyro.get_param_store().get_state()["params"]
    saved = payload["param_store"]
    # The new parameters' constraints first: a refusal there must come before any copy.
    new_constraints = {
        name: constraint_from_spec(saved["constraints"][name], param=name, path=path)
        for name in saved["values"]
        if name not in live
    }
    new = {}
    with torch.no_grad():
        for name, value in saved["values"].items():
            if name in live:
                # In place: the guide's modules and the optimizers hold these very tensors.
                live[name].copy_(value)
            else:
                new[name] = value.detach().clone().requires_grad_()
    if new:
        pyro.get_param_store().set_state({"params": new, "constraints": new_constraints})


def restore_optim(optim, state) -> None:
    if not has(optim, "get_state", "set_state"):
        optim.load_state_dict(state)
        return
    live = pyro.get_param_store().get_state()["params"]
    waiting = {}
    for name, s in state.items():
        param = live.get(name)
        obj = None if param is None else optim.optim_objs.get(param)
        if obj is None:  # created on the next step, which then consumes this state
            waiting[name] = s
        elif is_scheduler(obj):
            obj.load_state_dict(s["scheduler"])
            obj.optimizer.load_state_dict(s["optimizer"])
        else:
            obj.load_state_dict(s)
    optim.set_state(waiting)
