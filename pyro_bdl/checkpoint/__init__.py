r"""Checkpoints that resume training bit for bit.

A checkpoint holds everything a training loop needs to continue exactly where it stopped: Pyro's
param store, the guide's and any module's ``state_dict`` (SWAG and Laplace keep their posteriors
in the guide's buffers, VOGN in its own ``state_dict``), the optimizer state, the step counter,
the caller's data-order state and every random number generator (Python ``random``, NumPy, torch
CPU and CUDA).

Guarantees:

* The file holds tensors and plain values only, so it loads with
  ``torch.load(path, weights_only=True)``; anything else is refused when saving, naming its key.
* It is written atomically: a temporary file in the same folder (``.<name>.tmp-<pid>-<random>``),
  ``fsync``, then ``os.replace``. A crash while writing leaves the previous checkpoint untouched;
  a process killed mid-write leaves its temporary file, which the next save of the same target
  removes (it removes only those whose writing process is gone).
* A small fingerprint (param names, shapes and constraints; guide class; likelihood; module
  keys and shapes) is checked before anything is restored, and a checkpoint of a different
  model, guide or likelihood is refused with the mismatching keys named. Then every part is
  checked the way it will be restored (RNG and generator states on scratch generators, state
  dicts against the live modules, optimizer states against their parameters): a refused load
  changes nothing.
* It is read with ``torch.load(weights_only=True)`` only: a file holding any other pickled
  object is refused without running it.
* It holds a checksum of every tensor's bytes and of the plain values, verified on reading: a
  file damaged after it was written (a flipped bit on disk or in a copy) is refused naming the
  entry. Files from before checksums have none and load unchecked.

**The lazy set-up rule.** Pyro's guides create their parameters the first time they run and draw
random numbers while doing so (initialisation, the first sample). Restoring the RNG *before* that
set-up lets the set-up consume the restored stream, and the resumed run drifts from the
uninterrupted one. So the order is: build the model, guide and optimizer; set the guide up (call
it once on a batch); restore the state; restore the RNG last. :func:`load_checkpoint` does this
itself when given ``example_args``. A module that reads the model lazily too (it has
``needs_setup`` and ``setup(*args)``, as :class:`~pyro_bdl.infer.VOGN` does) is set up the same way,
and one that can check a state against its model (``check_state_dict``) does so before anything is
restored.

Usage::

    save_checkpoint("run.ckpt", guide=guide, optim=optim, step=step, extra={"epoch": epoch})
    state = load_checkpoint("run.ckpt", guide=guide, optim=optim, example_args=(x0, y0))
    step = state["step"]
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import pyro
import pyro.poutine as poutine
import torch

from pyro_bdl._caller import user_stacklevel
from pyro_bdl._grad_mode import differentiates
from pyro_bdl.checkpoint._checks import part_errors
from pyro_bdl.checkpoint._files import FORMAT, VERSION, atomic_save, read
from pyro_bdl.checkpoint._parts import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    check_map_location,
    check_path,
    check_plain,
    check_targets,
    constraint_spec,
    has,
    likelihood_of,
    model_of,
    module_fingerprint,
    optim_state,
    params_fingerprint,
    qualname,
    rng_state,
    set_rng_state,
)
from pyro_bdl.checkpoint._restore import mismatches, restore_optim, restore_params
from pyro_bdl.checkpoint._upgrade import rename_legacy_params, upgrade_payload

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "load_checkpoint",
    "save_checkpoint",
]


# ---------------------------------------------------------------------------------------------
# Writing


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
        raise TypeError(
            f"step must be an int >= 0; got {type(step).__name__} {step!r}. Pass the number of "
            "steps done as a Python int (int(x) converts a whole float or a one-element tensor)."
        )
    if step < 0:
        raise ValueError(
            f"step must be >= 0 (the number of steps done); got {step}. Pass 0 before the first "
            "step."
        )
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(
            f"extra must be a dict of plain values; got {type(extra).__name__}. Wrap it in a "
            "dict, for example extra={'epoch': 3}."
        )
    check_targets(optim, modules, generators)
    if getattr(guide, "prototype_trace", False) is None:
        # Its state is incomplete until then (an AutoEnsemble's members wait unpacked, outside
        # its state_dict), and the set-up guide a load needs refuses such a file as another's.
        raise ValueError(
            f"the guide {type(guide).__name__} has not seen the model yet (Pyro guides create "
            "their state on their first call), so the checkpoint would miss that state and "
            "could not be loaded back into the set-up guide a resume needs. Call it once with "
            "the model's training arguments (guide(x_batch, y_batch)) before saving."
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"cannot write checkpoint {path!r}: the folder {folder!r} does not exist. Create it "
            "first (os.makedirs(folder, exist_ok=True))."
        )
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"cannot write checkpoint {path!r}: it is a folder. Pass a file name inside it, such "
            f"as {os.path.join(path, 'run.ckpt')!r}."
        )
    store = pyro.get_param_store().get_state()
    values = {name: v.detach() for name, v in store["params"].items()}
    specs = {name: constraint_spec(c) for name, c in store["constraints"].items()}
    modules = dict(modules or {})
    guide_state = guide.state_dict() if isinstance(guide, torch.nn.Module) else None
    payload: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
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
    atomic_save(payload, path)


# ---------------------------------------------------------------------------------------------
# Reading


# Outside inference mode whatever the caller's: the optimizer states and the param-store entries
# it creates would otherwise be inference tensors, which the next optimizer step cannot update
# in place; and the guide's set-up call runs as a training step would (inference tensors among
# example_args are copied).
@differentiates
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
    generators; (4) restore every RNG last. It restores the same state under
    ``torch.no_grad()`` or ``torch.inference_mode()``: the restored tensors are never inference
    tensors, so training resumes after it.

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
    :param tuple example_args: positional arguments for one set-up call of the guide and of
        every module that has not seen the model yet (``needs_setup``, such as a VOGN that has
        not stepped; needed then). If the file is then refused, every RNG is put back as it was
        before that call (the guide stays set up, as after one call of its own).
    :param dict example_kwargs: keyword arguments for that call.
    :param bool rng: restore every RNG (default); warns if the file has none.
    :param map_location: where the file's tensors are loaded, as :func:`torch.load` takes it: a
        device (``"cpu"``, the default; ``"cuda:0"``; a :class:`torch.device`), a dict of saved
        location -> device, or a callable ``(storage, location) -> storage``. A checkpoint saved
        on one device loads on another: the loaded values are copied into the live tensors
        wherever those are (the guide's parameters, the modules, the optimizer state), and
        param-store entries that do not exist yet are created on ``map_location``; RNG states
        always go back to the CPU tensors torch keeps them in. ``"meta"`` is refused (it loads
        no values).
    :returns: a dict with ``step``, ``extra`` (as saved), ``rng_restored`` and
        ``optim_restored`` (bools).
    :raises FileNotFoundError: if ``path`` does not exist.
    :raises TypeError, ValueError: if ``map_location`` is not a device, dict or callable, or is
        the ``meta`` device.
    :raises CheckpointError: if the file is truncated, corrupt or not a checkpoint.
    :raises CheckpointMismatchError: if it belongs to a different model, guide or likelihood;
        the message lists the mismatching keys.
    """
    path = check_path(path)
    map_location = check_map_location(map_location)
    check_targets(optim, modules, generators)
    modules, generators = dict(modules or {}), dict(generators or {})
    lazy = {
        n: m for n, m in modules.items() if has(m, "setup") and getattr(m, "needs_setup", False)
    }
    if example_args is not None:
        if not isinstance(example_args, tuple):
            raise TypeError(
                f"example_args must be a tuple of the guide's arguments; got "
                f"{type(example_args).__name__}. Write example_args=(x_batch, y_batch)."
            )
        if guide is None and not lazy:
            raise ValueError(
                "example_args sets the guide (or a module such as VOGN) up, but no guide was "
                "given and every module is set up already; pass guide=, or leave example_args out."
            )
    elif getattr(guide, "prototype_trace", False) is None:
        raise ValueError(
            f"the guide {type(guide).__name__} has not created its parameters yet (Pyro guides "
            "do so on their first call, drawing random numbers). Pass example_args=(x_batch, "
            "y_batch) so load_checkpoint sets it up before restoring the RNG."
        )
    elif lazy:
        raise ValueError(
            f"module {next(iter(lazy))!r} has not seen the model yet (it reads it on its first "
            "step), so the state cannot be checked against it. Pass example_args=(x_batch, "
            "y_batch) so load_checkpoint sets it up first."
        )
    payload = read(path, map_location)

    # (1) Lazy set-up first: it consumes random numbers, which step (4) then overwrites.
    before = rng_state() if example_args is not None else None
    if example_args is not None:
        kwargs = dict(example_kwargs or {})
        for m in lazy.values():
            m.setup(*example_args, **kwargs)
        if guide is not None:
            with poutine.block():
                guide(*example_args, **kwargs)

    if guide is not None:
        upgrade_payload(payload, guide)  # a guide that stores its parameters in a newer form
    rename_legacy_params(payload, model_of(model, guide))  # a point σ saved as plain "sigma"

    # (2) Refuse a different model or a damaged part before changing anything.
    try:
        unused = _check(payload, path, guide, model, optim, modules, generators, rng)
    except BaseException:
        if before is not None:
            set_rng_state(before)  # the set-up drew random numbers: a refusal gives them back
        raise
    if unused:
        warnings.warn(
            f"{path!r} holds state for {', '.join(unused)}, which were not passed to "
            "load_checkpoint and are not restored.",
            CheckpointWarning,
            stacklevel=user_stacklevel(),
        )

    # (3) State.
    restore_params(payload, path)
    if isinstance(guide, torch.nn.Module) and payload["guide"] is not None:
        guide.load_state_dict(payload["guide"])
    for name, m in modules.items():
        m.load_state_dict(payload["modules"][name])
    for name, g in generators.items():
        g.set_state(payload["generators"][name].cpu())
    optim_restored = optim is not None and payload["optim"] is not None
    if optim_restored:
        restore_optim(optim, payload["optim"])
    elif optim is not None:
        warnings.warn(
            f"{path!r} holds no optimizer state: the optimizer restarts, so the resumed run "
            "will not be bit-exact.",
            CheckpointWarning,
            stacklevel=user_stacklevel(),
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
            stacklevel=user_stacklevel(),
        )
    return {
        "step": payload["step"],
        "extra": payload["extra"],
        "rng_restored": rng_restored,
        "optim_restored": optim_restored,
    }


def _check(payload, path, guide, model, optim, modules, generators, rng) -> list[str]:
    """Raise if ``payload`` cannot be restored whole; returns the parts nobody asked for."""
    try:
        bad, unused = mismatches(payload, guide, model, modules, generators)
        # Every part checked the way it will be restored, so no restore fails halfway.
        refused = (
            []
            if bad
            else part_errors(
                payload,
                path,
                guide=guide,
                optim=optim,
                modules=modules,
                generators=generators,
                rng=rng,
            )
        )
    except (KeyError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(
            f"{path!r} is damaged: a part of it does not have the form save_checkpoint writes "
            f"({type(err).__name__}: {err}); nothing was changed. Resume from another checkpoint."
        ) from err
    if bad:
        shown = "\n  - ".join(bad[:20]) + (
            f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        )
        raise CheckpointMismatchError(
            f"{path!r} was saved from a different model, guide or likelihood; mismatching "
            f"keys:\n  - {shown}\nLoad it into the architecture and guide it was saved from."
        )
    if refused:
        raise CheckpointMismatchError(
            f"{path!r} cannot be restored; nothing was changed:\n  - " + "\n  - ".join(refused)
        )
    return unused
