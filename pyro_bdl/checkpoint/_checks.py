"""Checking every part of a checkpoint before any is restored.

Restoring goes part by part (param store, guide, modules, generators, optimizer, RNG), and a part
that fails halfway would leave the earlier ones restored and the later ones not. So each part is
checked first, the way it will be restored: RNG and generator states are tried on scratch
generators, state dicts against the live modules, optimizer states against the parameters they
belong to. :func:`part_errors` lists every reason to refuse; an empty list means restoring cannot
fail.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyro
import torch

from pyro_bdl.checkpoint._parts import constraint_from_spec, has
from pyro_bdl.guides.state_checks import state_dict_errors

__all__ = ["part_errors", "rng_errors"]


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def rng_errors(state: Any) -> list[str]:
    """Why :func:`~pyro_bdl.checkpoint._parts.set_rng_state` would fail on ``state``, found by
    setting each part on a scratch generator (the process's own are left alone)."""
    if not isinstance(state, Mapping) or not {"python", "numpy", "torch", "cuda"} <= set(state):
        return [f"rng: expected a dict with python, numpy, torch and cuda; got {state!r:.80}"]
    errors = []
    try:
        py = state["python"]
        random.Random().setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    except Exception as err:
        errors.append(f"rng['python']: not a Python random state ({_reason(err)})")
    try:
        npst = state["numpy"]
        keys = npst["keys"]
        if not isinstance(keys, torch.Tensor) or keys.shape != (624,) or keys.is_floating_point():
            raise ValueError(f"keys must be 624 integers; got {keys!r:.60}")
        np.random.RandomState().set_state(
            (npst["kind"], keys.cpu().numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
             npst["cached_gaussian"])
        )  # fmt: skip
    except Exception as err:
        errors.append(f"rng['numpy']: not a NumPy MT19937 state ({_reason(err)})")
    errors += _generator_errors(state["torch"], "cpu", "rng['torch']")
    cuda = state["cuda"]
    if not isinstance(cuda, (list, tuple)):
        errors.append(f"rng['cuda']: expected a list of CUDA generator states; got {cuda!r:.60}")
    elif torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        for i, s in enumerate(cuda):
            errors += _generator_errors(s, f"cuda:{i}", f"rng['cuda'][{i}]")
    else:  # not restored here (set_rng_state warns); only its form is checked
        for i, s in enumerate(cuda):
            if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8 or s.dim() != 1:
                errors.append(f"rng['cuda'][{i}]: expected a 1-d uint8 tensor; got {s!r:.60}")
    return errors


def _generator_errors(state: Any, device: Any, where: str) -> list[str]:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        return [f"{where}: expected a uint8 tensor (Generator.get_state()); got {state!r:.60}"]
    try:
        torch.Generator(device=device).set_state(state.cpu())
    except Exception as err:
        return [f"{where}: not a generator state for {device} ({_reason(err)})"]
    return []


def _param_errors(payload: Mapping[str, Any], path: str) -> list[str]:
    live = pyro.get_param_store().get_state()["params"]
    saved = payload["param_store"]
    values, specs = saved.get("values"), saved.get("constraints")
    if not isinstance(values, Mapping) or not isinstance(specs, Mapping):
        return ["param store: expected dicts 'values' and 'constraints'"]
    errors = []
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            errors.append(f"param {name!r}: the file holds a {type(value).__name__}, not a tensor")
        elif name in live and value.shape != live[name].shape:
            errors.append(
                f"param {name!r}: the file has shape {tuple(value.shape)}, this process "
                f"{tuple(live[name].shape)}"
            )
        elif name not in live:
            if name not in specs:
                errors.append(f"param {name!r}: no constraint in the file")
                continue
            try:
                constraint_from_spec(specs[name], param=name, path=path)
            except Exception as err:
                errors.append(str(err))
    return errors


def _torch_optim_errors(state: Any, params: list[torch.Tensor], where: str) -> list[str]:
    """A ``torch.optim.Optimizer.state_dict()`` for an optimizer over ``params`` (by position)?"""
    if not isinstance(state, Mapping) or not {"state", "param_groups"} <= set(state):
        return [f"{where}: expected an optimizer state_dict (state, param_groups)"]
    groups, per_param = state["param_groups"], state["state"]
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        return [f"{where}: param_groups must be a list of dicts with 'params'"]
    count = sum(len(g["params"]) for g in groups)
    if count != len(params):
        return [
            f"{where}: the file has state for {count} parameter(s), this optimizer {len(params)}"
        ]
    ids = [i for g in groups for i in g["params"]]
    if not isinstance(per_param, Mapping):
        return [f"{where}: 'state' must be a dict"]
    errors = []
    for key, entries in per_param.items():
        if key not in ids or not isinstance(entries, Mapping):
            errors.append(f"{where}: state for unknown parameter {key!r}")
            continue
        shape = params[ids.index(key)].shape
        for name, t in entries.items():
            # Moments (exp_avg, momentum_buffer) have the parameter's shape; counters are scalars.
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != shape:
                errors.append(
                    f"{where}: {name!r} has shape {tuple(t.shape)}, the parameter {tuple(shape)}"
                )
    return errors


def _optim_errors(optim, state: Any) -> list[str]:
    if not has(optim, "get_state", "set_state"):
        params = [p for g in getattr(optim, "param_groups", []) for p in g["params"]]
        if not params:  # a scheduler or another stateful object: its own loader checks it
            return []
        return _torch_optim_errors(state, params, "optim")
    if not isinstance(state, Mapping):
        return [f"optim: expected a dict param name -> optimizer state; got {type(state).__name__}"]
    live = pyro.get_param_store().get_state()["params"]
    errors = []
    for name, s in state.items():
        if name not in live:
            continue  # kept until the parameter exists (restore_optim)
        if isinstance(s, Mapping) and "scheduler" in s:
            s = s.get("optimizer")
        errors += _torch_optim_errors(s, [live[name]], f"optim {name!r}")
    return errors


def part_errors(payload, path: str, *, guide, optim, modules, generators, rng: bool) -> list[str]:
    """Every reason a part of ``payload`` would fail to restore into the given objects."""
    errors = _param_errors(payload, path)
    step = payload["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        errors.append(f"step: expected an int >= 0; got {step!r:.60}")
    if not isinstance(payload["extra"], Mapping):
        errors.append(f"extra: expected a dict; got {type(payload['extra']).__name__}")
    if isinstance(guide, torch.nn.Module) and payload["guide"] is not None:
        errors += [f"guide key {e}" for e in state_dict_errors(guide, payload["guide"])]
    for name, m in modules.items():
        state = payload["modules"][name]
        if has(m, "check_state_dict"):
            try:
                m.check_state_dict(state)
            except ValueError as err:
                errors.append(f"module {name!r}: {err}")
        elif isinstance(m, torch.nn.Module):
            errors += [f"module {name!r} key {e}" for e in state_dict_errors(m, state)]
    for name, g in generators.items():
        errors += _generator_errors(payload["generators"][name], g.device, f"generator {name!r}")
    if optim is not None and payload["optim"] is not None:
        errors += _optim_errors(optim, payload["optim"])
    if rng and payload["rng"] is not None:
        errors += rng_errors(payload["rng"])
    return errors
