r"""Checkpoints that resume training bit for bit.

A checkpoint holds everything a training loop needs to continue exactly where it stopped: Pyro's
param store, the guide's and any module's ``state_dict`` (SWAG, Laplace and VOGN keep their
posteriors in buffers), the optimizer state, the step counter, the caller's data-order state and
every random number generator (Python ``random``, NumPy, torch CPU and CUDA).

Guarantees:

* The file holds tensors and plain values only, so it loads with
  ``torch.load(path, weights_only=True)``; anything else is refused when saving, naming its key.
* It is written atomically: a temporary file in the same folder, ``fsync``, then ``os.replace``.
  A crash while writing leaves the previous checkpoint untouched and no partial file behind.
* A small fingerprint (param names, shapes and constraints; guide class; likelihood; module
  keys and shapes) is checked before anything is restored, and a checkpoint of a different
  model, guide or likelihood is refused with the mismatching keys named.

**The lazy set-up rule.** Pyro's guides create their parameters the first time they run and draw
random numbers while doing so (initialisation, the first sample). Restoring the RNG *before* that
set-up lets the set-up consume the restored stream, and the resumed run drifts from the
uninterrupted one. So the order is: build the model, guide and optimizer; set the guide up (call
it once on a batch); restore the state; restore the RNG last. :func:`load_checkpoint` does this
itself when given ``example_args``.

Usage::

    save_checkpoint("run.ckpt", guide=guide, optim=optim, step=step, extra={"epoch": epoch})
    state = load_checkpoint("run.ckpt", guide=guide, optim=optim, example_args=(x0, y0))
    step = state["step"]
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from pyro.optim.optim import is_scheduler

from pyro_bdl.checkpoint._parts import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    check_path,
    check_plain,
    check_targets,
    compare,
    constraint_from_spec,
    constraint_spec,
    has,
    likelihood_of,
    module_fingerprint,
    optim_state,
    params_fingerprint,
    qualname,
    rng_state,
    set_rng_state,
)

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "load_checkpoint",
    "save_checkpoint",
]

_FORMAT = "pyro_bdl.checkpoint"
_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Writing


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open folders; the rename is still atomic there.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_save(payload: dict[str, Any], path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    # Same folder as the target, so os.replace is a rename within one file system (atomic).
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)


def save_checkpoint(
    path: str | os.PathLike,
    *,
    guide=None,
    optim=None,
    modules: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    model=None,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> None:
    r"""Write a checkpoint of the current training state to ``path``, atomically.

    Pyro's whole param store is always saved; the other parts are saved when given.

    Usage::

        save_checkpoint("run.ckpt", guide=guide, optim=optim, modules={"net": bnn},
                        generators={"data": data_gen}, step=step, extra={"epoch": epoch})

    :param path: the file to write (its folder must exist); an existing file is replaced only
        once the new one is complete on disk.
    :param guide: the guide; its class is fingerprinted and, if it is a module, its
        ``state_dict`` (buffers included) is saved.
    :param optim: a :class:`pyro.optim.PyroOptim` (``get_state``) or any object with
        ``state_dict`` (a torch optimizer).
    :param dict modules: name -> object with ``state_dict`` (the lifted network for its
        BatchNorm statistics, a :class:`~pyro_bdl.infer.VOGN` object, an LR scheduler). SWAG and
        Laplace guides keep their posteriors in the guide's own buffers.
    :param dict generators: name -> :class:`torch.Generator` the caller uses for data order.
    :param model: the model, for the likelihood in the fingerprint (default ``guide.model``).
    :param int step: the number of steps done; :func:`load_checkpoint` returns it.
    :param dict extra: any further plain values or tensors (epoch, position in the epoch, the
        current permutation); returned by :func:`load_checkpoint`.
    :param bool rng: save every RNG (Python, NumPy, torch CPU and CUDA). Without it a resumed
        run is not bit-exact, and loading warns.
    :raises TypeError: for a part that is not tensors and plain values, naming where it sits.
    """
    path = check_path(path)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int >= 0; got {type(step).__name__} {step!r}.")
    if step < 0:
        raise ValueError(f"step must be >= 0 (the number of steps done); got {step}.")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict of plain values; got {type(extra).__name__}.")
    check_targets(optim, modules, generators)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"cannot write checkpoint {path!r}: the folder {folder!r} does not exist. Create it "
            "first (os.makedirs(folder, exist_ok=True))."
        )
    store = pyro.get_param_store().get_state()
    values = {name: v.detach() for name, v in store["params"].items()}
    specs = {name: constraint_spec(c) for name, c in store["constraints"].items()}
    modules = dict(modules or {})
    guide_state = guide.state_dict() if isinstance(guide, torch.nn.Module) else None
    payload: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "fingerprint": {
            "params": params_fingerprint(values, specs),
            "guide": None if guide is None else qualname(guide),
            "guide_state": None if guide_state is None else module_fingerprint(guide),
            "likelihood": likelihood_of(model, guide),
            "modules": {name: module_fingerprint(m) for name, m in modules.items()},
        },
        "param_store": {"values": values, "constraints": specs},
        "guide": guide_state,
        "modules": {name: m.state_dict() for name, m in modules.items()},
        "optim": None if optim is None else optim_state(optim),
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
        "step": step,
        "extra": dict(extra or {}),
        "rng": rng_state() if rng else None,
        "torch_version": str(torch.__version__),
    }
    # Check every part before writing anything, so a bad part leaves no file behind.
    for key, value in payload.items():
        check_plain(value, key)
    _atomic_save(payload, path)


# ---------------------------------------------------------------------------------------------
# Reading


_KEYS = ("fingerprint", "param_store", "guide", "modules", "optim", "generators", "step", "rng")


def _read(path: str, map_location) -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: the file does not exist. Check the path (or start the "
            "run from step 0)."
        )
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path!r}: the file is truncated or corrupt, or holds more "
            f"than tensors and plain values ({type(err).__name__}: {reason}). Resume from an "
            "earlier checkpoint; save_checkpoint writes atomically, so files it wrote are whole."
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(
            f"{path!r} is not a pyro_bdl checkpoint (no {_FORMAT!r} header). Write checkpoints "
            "with pyro_bdl.checkpoint.save_checkpoint."
        )
    if payload.get("version") != _VERSION or any(k not in payload for k in _KEYS):
        raise CheckpointError(
            f"{path!r} is a pyro_bdl checkpoint of format version {payload.get('version')!r} "
            f"with keys {sorted(payload)}; this version reads version {_VERSION}."
        )
    return payload


def _mismatches(payload, guide, model, modules, generators) -> tuple[list[str], list[str]]:
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


def _restore_params(payload, path: str) -> None:
    live = pyro.get_param_store().get_state()["params"]
    saved = payload["param_store"]
    new, new_constraints = {}, {}
    with torch.no_grad():
        for name, value in saved["values"].items():
            if name in live:
                # In place: the guide's modules and the optimizers hold these very tensors.
                live[name].copy_(value)
            else:
                new[name] = value.detach().clone().requires_grad_()
                new_constraints[name] = constraint_from_spec(
                    saved["constraints"][name], param=name, path=path
                )
    if new:
        pyro.get_param_store().set_state({"params": new, "constraints": new_constraints})


def _restore_optim(optim, state) -> None:
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


def load_checkpoint(
    path: str | os.PathLike,
    *,
    guide=None,
    optim=None,
    modules: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    model=None,
    example_args: tuple | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    rng: bool = True,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    r"""Restore a checkpoint written by :func:`save_checkpoint` into freshly built objects.

    The order is the one bit-exact resume needs: (1) set the guide up by calling it on
    ``example_args`` (Pyro guides create their parameters lazily and draw random numbers while
    doing so); (2) compare the fingerprint and refuse a different model, guide or likelihood,
    before anything changes; (3) restore the param store, guide, modules, optimizer and
    generators; (4) restore every RNG last.

    Usage::

        guide, optim = AutoNormal(model), pyro.optim.Adam({"lr": 1e-3})
        state = load_checkpoint("run.ckpt", guide=guide, optim=optim, modules={"net": bnn},
                                example_args=(x_train[:8], y_train[:8]))
        for step in range(state["step"], num_steps): ...

    :param path: the checkpoint file.
    :param guide: the guide to restore. A Pyro autoguide that has not run yet needs
        ``example_args`` (or one call by the caller before loading).
    :param optim: the optimizer to restore (as in :func:`save_checkpoint`).
    :param dict modules: name -> object with ``load_state_dict``; names must be in the file.
    :param dict generators: name -> :class:`torch.Generator` to restore.
    :param model: the model, for the likelihood check (default ``guide.model``).
    :param tuple example_args: positional arguments for one set-up call of the guide.
    :param dict example_kwargs: keyword arguments for that call.
    :param bool rng: restore every RNG (default); warns if the file has none.
    :param map_location: where the file's tensors are loaded (default ``"cpu"``; they are then
        copied into the live tensors, wherever those are).
    :returns: a dict with ``step``, ``extra`` (as saved), ``rng_restored`` and
        ``optim_restored`` (bools).
    :raises FileNotFoundError: if ``path`` does not exist.
    :raises CheckpointError: if the file is truncated, corrupt or not a checkpoint.
    :raises CheckpointMismatchError: if it belongs to a different model, guide or likelihood;
        the message lists the mismatching keys.
    """
    path = check_path(path)
    check_targets(optim, modules, generators)
    modules, generators = dict(modules or {}), dict(generators or {})
    if example_args is not None:
        if not isinstance(example_args, tuple):
            raise TypeError(
                f"example_args must be a tuple of the guide's arguments; got "
                f"{type(example_args).__name__}. Write example_args=(x_batch, y_batch)."
            )
        if guide is None:
            raise ValueError("example_args sets the guide up, but no guide was given; pass guide=.")
    elif getattr(guide, "prototype_trace", False) is None:
        raise ValueError(
            f"the guide {type(guide).__name__} has not created its parameters yet (Pyro guides "
            "do so on their first call, drawing random numbers). Pass example_args=(x_batch, "
            "y_batch) so load_checkpoint sets it up before restoring the RNG."
        )
    payload = _read(path, map_location)

    # (1) Lazy set-up first: it consumes random numbers, which step (4) then overwrites.
    if example_args is not None:
        with poutine.block():
            guide(*example_args, **dict(example_kwargs or {}))

    # (2) Refuse a different model before changing anything.
    bad, unused = _mismatches(payload, guide, model, modules, generators)
    if bad:
        shown = "\n  - ".join(bad[:20]) + (
            f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        )
        raise CheckpointMismatchError(
            f"{path!r} was saved from a different model, guide or likelihood; mismatching "
            f"keys:\n  - {shown}\nLoad it into the architecture and guide it was saved from."
        )
    if unused:
        warnings.warn(
            f"{path!r} holds state for {', '.join(unused)}, which were not passed to "
            "load_checkpoint and are not restored.",
            CheckpointWarning,
            stacklevel=2,
        )

    # (3) State.
    _restore_params(payload, path)
    if isinstance(guide, torch.nn.Module) and payload["guide"] is not None:
        guide.load_state_dict(payload["guide"])
    for name, m in modules.items():
        m.load_state_dict(payload["modules"][name])
    for name, g in generators.items():
        g.set_state(payload["generators"][name].cpu())
    optim_restored = optim is not None and payload["optim"] is not None
    if optim_restored:
        _restore_optim(optim, payload["optim"])
    elif optim is not None:
        warnings.warn(
            f"{path!r} holds no optimizer state: the optimizer restarts, so the resumed run "
            "will not be bit-exact.",
            CheckpointWarning,
            stacklevel=2,
        )

    # (4) RNG last, after everything that might draw random numbers.
    rng_restored = rng and payload["rng"] is not None
    if rng_restored:
        set_rng_state(payload["rng"])
    elif rng:
        warnings.warn(
            f"{path!r} was saved without RNG state (rng=False): the resumed run will not be "
            "bit-exact.",
            CheckpointWarning,
            stacklevel=2,
        )
    return {
        "step": payload["step"],
        "extra": payload["extra"],
        "rng_restored": rng_restored,
        "optim_restored": optim_restored,
    }
