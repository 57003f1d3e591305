"""The pieces of a checkpoint: RNG states, constraints and fingerprints as plain values.

Everything here turns live objects into tensors and plain values (which
``torch.load(weights_only=True)`` reads) and back; :mod:`pyro_bdl.checkpoint` does the I/O.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pyro.distributions import constraints

from pyro_bdl._caller import user_stacklevel


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: truncated, corrupt or not a checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of a different model, guide or likelihood than the one it is loaded into."""


class CheckpointWarning(UserWarning):
    """A checkpoint that restores, but not bit for bit (no RNG or optimizer state)."""


# ---------------------------------------------------------------------------------------------
# Random number generators


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]  # noqa: NPY002
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            # weights_only loads tensors, not NumPy arrays: keep the MT19937 key as int64.
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npst = state["numpy"]
    # The legacy global generator is the one np.random.seed (and pyro.set_rng_seed) seeds.
    np.random.set_state(  # noqa: NPY002
        (
            npst["kind"],
            npst["keys"].cpu().numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = list(state["cuda"])
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
    elif cuda or torch.cuda.is_available():
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(cuda)} device(s) but this process "
            f"has {torch.cuda.device_count() if torch.cuda.is_available() else 0}; the CUDA "
            "generators were not restored, so GPU sampling will not resume bit for bit.",
            CheckpointWarning,
            stacklevel=user_stacklevel(),
        )


# ---------------------------------------------------------------------------------------------
# Constraints as plain values (the param store keeps constraint objects, which weights_only
# cannot load)

_SINGLETONS = {
    name: c
    for name in dir(constraints)
    if isinstance(c := getattr(constraints, name), constraints.Constraint)
}
_BOUNDED = {
    "interval": (constraints.interval, ("lower_bound", "upper_bound")),
    "half_open_interval": (constraints.half_open_interval, ("lower_bound", "upper_bound")),
    "greater_than": (constraints.greater_than, ("lower_bound",)),
    "greater_than_eq": (constraints.greater_than_eq, ("lower_bound",)),
    "less_than": (constraints.less_than, ("upper_bound",)),
}


def constraint_spec(c: constraints.Constraint) -> dict[str, Any]:
    for name, singleton in _SINGLETONS.items():
        if c is singleton or (name == "real" and type(c) is type(constraints.real)):
            return {"name": name}
    for name, (factory, fields) in _BOUNDED.items():
        if type(c) is type(factory(*([0.0] * len(fields)))):  # type: ignore[operator]
            bounds = [getattr(c, f) for f in fields]
            if all(isinstance(b, (int, float)) for b in bounds):
                return {"name": name, "bounds": [float(b) for b in bounds]}
    if isinstance(c, constraints.independent):
        return {
            "name": "independent",
            "base": constraint_spec(c.base_constraint),
            "ndims": int(c.reinterpreted_batch_ndims),
        }
    return {"name": None, "repr": repr(c)}


def constraint_label(spec: Mapping[str, Any]) -> str:
    if spec["name"] is None:
        return str(spec["repr"])
    if spec["name"] == "independent":
        return f"independent({constraint_label(spec['base'])}, {spec['ndims']})"
    if "bounds" in spec:
        return f"{spec['name']}({', '.join(map(repr, spec['bounds']))})"
    return str(spec["name"])


def constraint_from_spec(spec: Mapping[str, Any], *, param: str, path: str):
    name = spec["name"]
    if name in _SINGLETONS:
        return _SINGLETONS[name]
    if name in _BOUNDED:
        return _BOUNDED[name][0](*spec["bounds"])  # type: ignore[operator]
    if name == "independent":
        base = constraint_from_spec(spec["base"], param=param, path=path)
        return constraints.independent(base, spec["ndims"])
    raise CheckpointError(
        f"cannot recreate param {param!r} from {path!r}: its constraint "
        f"{constraint_label(spec)} has no plain-value form. Create the parameter first (call "
        "the guide once, or pass example_args=... to load_checkpoint), then load."
    )


# ---------------------------------------------------------------------------------------------
# Fingerprint and plain-value check


def qualname(obj: object) -> str:
    # A guide function is named by itself, a guide object by its class.
    cls = obj if inspect.isroutine(obj) or isinstance(obj, type) else type(obj)
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def model_of(model, guide):
    """``model``, else the guide's model, looking through the handlers autoguides wrap it in."""
    if model is None and guide is not None:
        model = getattr(guide, "model", None)
    # Autoguides wrap the model in handlers (functools.partial objects); look through them.
    for _ in range(8):
        if not isinstance(model, functools.partial) or hasattr(model, "likelihood"):
            break
        model = next((a for a in reversed(model.args) if callable(a)), model.func)
    return model


def likelihood_of(model, guide) -> dict[str, Any]:
    model = model_of(model, guide)
    out: dict[str, Any] = {}
    # A point σ's noise_scale is its current estimate, a trained value the file restores, so only
    # a fixed σ (or one of a model without a noise kind) belongs to the fingerprint.
    fixed = getattr(model, "noise", None) in (None, "fixed")
    for attr in ("likelihood", "noise", "noise_scale") if fixed else ("likelihood", "noise"):
        value = getattr(model, attr, None)
        if isinstance(value, (str, int, float)):
            out[attr] = value
    return out


def module_fingerprint(obj) -> dict[str, Any]:
    """Tensor keys and shapes of a module's ``state_dict`` (other entries, such as
    ``_extra_state``, by type); the type of any other object."""
    if isinstance(obj, torch.nn.Module):
        return {
            k: list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            for k, v in obj.state_dict().items()
        }
    return {"<type>": qualname(obj)}


def _placeholder(a: Any, b: Any) -> bool:
    # An empty buffer is a placeholder that its module resizes when it loads (a Laplace guide's
    # covariance before fit()), so any stored shape fits it, and the other way round.
    return isinstance(a, list) and isinstance(b, list) and (0 in a or 0 in b)


def params_fingerprint(params, constraint_specs) -> dict[str, Any]:
    return {
        name: {"shape": list(v.shape), "constraint": constraint_label(constraint_specs[name])}
        for name, v in params.items()
    }


def show(value: Any) -> str:
    if isinstance(value, dict) and "shape" in value:
        return f"shape {tuple(value['shape'])} {value['constraint']}"
    if isinstance(value, list):
        return f"shape {tuple(value)}"
    return repr(value)


def compare(saved: Mapping[str, Any], now: Mapping[str, Any], label: str, out: list[str]):
    for key in sorted(set(saved) | set(now), key=str):
        if str(key).endswith("_extra_state"):
            continue  # a module's own encoding, of a size that varies (checked when it loads)
        if key not in now:
            out.append(f"{label} {key!r}: only in the file")
        elif key not in saved:
            out.append(f"{label} {key!r}: only in this process")
        elif saved[key] != now[key] and not _placeholder(saved[key], now[key]):
            out.append(
                f"{label} {key!r}: the file has {show(saved[key])}, this process {show(now[key])}"
            )


# Exact types: subclasses (NumPy scalars subclass float, TorchVersion subclasses str) pickle
# as globals that torch.load(weights_only=True) refuses.
_PLAIN = {type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device}


def check_plain(value: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` cannot read, naming where it sits."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return
    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            if type(k) not in (str, int):
                raise TypeError(
                    f"{where} has a key {k!r} of type {type(k).__name__}; checkpoints hold only "
                    "tensors and plain values, with str or int keys. Convert the key."
                )
            check_plain(v, f"{where}[{k!r}]")
        return
    if type(value) in (list, tuple, set):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; checkpoints hold only tensors and plain values "
        "(None, bool, int, float, str, lists, tuples, dicts) so that they load with "
        "torch.load(weights_only=True). Convert it (torch.as_tensor for arrays, float() for "
        "NumPy scalars) or leave it out."
    )


def has(obj, *methods: str) -> bool:
    return all(callable(getattr(obj, m, None)) for m in methods)


def check_targets(optim, modules, generators) -> None:
    if optim is not None and not (
        has(optim, "get_state", "set_state") or has(optim, "state_dict", "load_state_dict")
    ):
        raise TypeError(
            f"optim must be a pyro.optim.PyroOptim (get_state/set_state) or have "
            f"state_dict/load_state_dict; got {type(optim).__name__}. Pass the optimizer the run "
            "steps with (svi.optim), or leave optim out."
        )
    if modules is not None:
        if not isinstance(modules, Mapping):
            raise TypeError(
                f"modules must be a dict name -> module; got {type(modules).__name__}. "
                "Write modules={'net': net}."
            )
        for name, m in modules.items():
            if not isinstance(name, str) or not has(m, "state_dict", "load_state_dict"):
                raise TypeError(
                    f"modules[{name!r}] must be keyed by a str and have state_dict and "
                    f"load_state_dict; got {type(m).__name__}. Write modules={{'net': net}}."
                )
    if generators is not None:
        if not isinstance(generators, Mapping) or not all(
            isinstance(k, str) and isinstance(g, torch.Generator) for k, g in generators.items()
        ):
            raise TypeError(
                "generators must be a dict name -> torch.Generator (for example the generator "
                f"that shuffles the data); got {generators!r}. Write generators={{'data': g}}."
            )


def check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a str or os.PathLike; got {type(path).__name__} {path!r}. Pass a file "
            "name such as 'run.ckpt'."
        )
    return os.fspath(path)


def check_map_location(map_location: Any) -> Any:
    """Refuse a ``map_location`` that :func:`torch.load` cannot use, or the ``meta`` device,
    which would load shapes without values (nothing could be restored from them)."""
    fix = "Pass the device the run continues on, e.g. 'cpu' or 'cuda:0' (or torch.device)."
    if map_location is None or callable(map_location):
        return map_location
    if isinstance(map_location, Mapping):
        if all(isinstance(k, str) and isinstance(v, str) for k, v in map_location.items()):
            for device in map_location.values():
                check_map_location(device)
            return map_location
        raise TypeError(
            f"map_location as a dict must map saved locations to devices, str -> str (as "
            f"torch.load takes it); got {dict(map_location)!r}. {fix}"
        )
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            f"map_location must be a device (str or torch.device), a dict str -> str or a "
            f"callable (storage, location) -> storage; got {type(map_location).__name__} "
            f"{map_location!r}. {fix}"
        )
    try:
        device = torch.device(map_location)
    except RuntimeError:
        raise ValueError(f"map_location {map_location!r} is not a device. {fix}") from None
    if device.type == "meta":
        raise ValueError(
            f"map_location={map_location!r} would load the checkpoint's tensors as meta tensors, "
            f"which hold shapes but no values, so nothing could be restored from them. {fix}"
        )
    return map_location


def optim_state(optim) -> Any:
    if has(optim, "get_state", "set_state"):
        # A PyroOptim only knows the optimizers it has created; state loaded but not yet
        # consumed by a step would otherwise be lost by a save right after a load.
        waiting = dict(getattr(optim, "_state_waiting_to_be_consumed", {}))
        return {**waiting, **optim.get_state()}
    return optim.state_dict()
