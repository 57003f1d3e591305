r"""BatchNorm's running statistics under vectorized passes: the refusal of a training-mode layer,
and the state that refusal puts back.

A vectorized pass (``Trace_ELBO(vectorize_particles=True)``, ``Predictive(parallel=True)``) cannot
update running statistics that are one buffer shared by all samples, so a lifted network with a
training-mode BatchNorm refuses it (:func:`refuse_training_mode`) before its forward runs. But
Pyro runs the model unvectorized first to inspect it (the guess of ``max_plate_nesting``, the
shapes of the return sites), and in training mode those passes have already moved
``running_mean``, ``running_var`` and ``num_batches_tracked`` when the vectorized pass refuses.

So the lifted network keeps a :class:`~pyro_bdl.infer.rollback.Rollback` of its normalisation
buffers, saved before the first of a run of unvectorized passes inside Pyro during which nothing
was trained, and a refusal restores it. "Nothing was trained" is read from the version counters
of the network's and the param store's parameters and of the buffers themselves: they are equal
at the start of a pass to what they were at the end of the previous one exactly when no optimiser
step, load or other writer came in between. Inspection passes (and an ``evaluate_loss``, a
sequential prediction or an autoguide's set-up, which train nothing either) are undone with the
refused pass; a training step is never undone, since its optimiser step starts a new run.
"""

from __future__ import annotations

import weakref

import pyro
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["note_unvectorized_pass", "refuse_training_mode"]


def _is_training_norm(sub: nn.Module) -> bool:
    return isinstance(sub, _BatchNorm) and sub.training and sub.track_running_stats


def _training_layers(module: nn.Module) -> list[nn.Module]:
    # modules(), not named_modules(): only a refusal needs a layer's dotted name.
    return [sub for sub in module.modules() if _is_training_norm(sub)]


_Holders = list[dict]


def _walk(module: nn.Module) -> tuple[list[nn.Module], _Holders]:
    """The training-mode normalisation layers and every layer's non-empty parameter and buffer
    dicts, in one walk over the modules (this runs on every forward inside Pyro). A dict left
    out because it is empty and filled later is in the next pass's walk, whose fingerprint then
    differs."""
    layers: list[nn.Module] = []
    holders: _Holders = []
    # A plain stack over the children's dicts: modules() builds a memo set and a generator per
    # layer. A layer reachable twice is listed twice, which changes nothing compared.
    stack: list[nn.Module | None] = [module]
    while stack:
        sub = stack.pop()
        if sub is None:
            continue
        if sub._parameters:
            holders.append(sub._parameters)
        if sub._buffers:
            holders.append(sub._buffers)
        if _is_training_norm(sub):
            layers.append(sub)
        stack.extend(sub._modules.values())
    return layers, holders


def _versions(holders: _Holders) -> list[int]:
    """The identities and in-place version counters of everything a writer between two passes
    would change: the network's parameters and buffers (read from ``holders``, the layers' live
    dicts, so a replaced tensor shows), and the param store's (unconstrained) parameters (an
    optimiser step writes them in place, a load may replace them)."""
    # Plain loops: this runs twice per forward pass inside Pyro, over every tensor.
    fingerprint: list[int] = []
    append = fingerprint.append
    for tensors in holders:
        for t in tensors.values():
            if t is not None:
                append(id(t))
                append(t._version)
    for _, p in pyro.get_param_store().named_parameters():
        append(id(p))
        append(p._version)
    return fingerprint


def _unchanged(holders: _Holders, versions: list[int] | None) -> bool:
    """``_versions(holders) == versions``, stopping at the first difference (after a training
    step, one of the first normalisation layer's parameters)."""
    if versions is None:
        return False
    i, n = 0, len(versions)
    for tensors in holders:
        for t in tensors.values():
            if t is not None:
                if i + 1 >= n or versions[i] != id(t) or versions[i + 1] != t._version:
                    return False
                i += 2
    for _, p in pyro.get_param_store().named_parameters():
        if i + 1 >= n or versions[i] != id(p) or versions[i + 1] != p._version:
            return False
        i += 2
    return i == n


class _Run:
    """The normalisation buffers before a run of untrained passes, and the versions after its
    latest pass.

    :ivar layers: the identities of the training-mode layers when the run began; a later run
        over the same layers saves into this run's storage (:meth:`restart`).
    """

    def __init__(self, module: nn.Module, layers: tuple[int, ...]):
        # Imported here: pyro_bdl.infer imports the guides, which import pyro_bdl.nn.
        from pyro_bdl.infer.rollback import Rollback, norm_layer_buffers

        self.rollback = Rollback.saved(norm_layer_buffers([module]))
        self.layers = layers
        self.after: list[int] | None = None

    def restart(self) -> None:
        """Begin a new run (every training step does): save the buffers again, into the copies
        of the previous run (one fused copy, not a new tensor per buffer)."""
        self.rollback.save()
        self.after = None


#: One run per lifted network (weakly: a run never keeps a network alive).
_RUNS: weakref.WeakKeyDictionary[nn.Module, _Run] = weakref.WeakKeyDictionary()


def note_unvectorized_pass(module: nn.Module):
    """Call before an unvectorized forward of the lifted ``module``; call the returned function
    after it. Outside Pyro, or without training-mode BatchNorm, no run is kept."""
    layers, holders = _walk(module) if _PYRO_STACK else ([], [])
    if not layers:
        _RUNS.pop(module, None)
        return _nothing
    run = _RUNS.get(module)
    if run is None or not _unchanged(holders, run.after):
        ids = tuple(id(sub) for sub in layers)
        if run is not None and run.layers == ids:
            run.restart()
        else:
            run = _RUNS[module] = _Run(module, ids)

    def done() -> None:
        # The same layers' dicts: a layer added during the pass only makes the next pass's
        # fingerprint differ, which starts a new run (the safe side).
        run.after = _versions(holders)

    return done


def _nothing() -> None:
    return None


def refuse_training_mode(module: nn.Module) -> None:
    """Refuse a vectorized forward of ``module`` while a BatchNorm layer is in training mode,
    putting its running statistics back as they were before the unvectorized passes that
    preceded it untrained (see the module docstring).

    :raises RuntimeError: naming the layer and the fix.
    """
    layers = _training_layers(module)
    if not layers:
        return
    run = _RUNS.pop(module, None)
    if run is not None and _unchanged(_walk(module)[1], run.after):
        run.rollback.restore()
    name = next(n for n, sub in module.named_modules() if sub is layers[0])
    raise RuntimeError(
        f"BatchNorm layer {name!r} is in training mode while the weights carry sample "
        "dims (vectorized particles or Predictive(parallel=True)): its running "
        "statistics are one buffer shared by all samples and cannot be updated from "
        "all of them at once. Call net.eval() before a parallel prediction, or train "
        "with Trace_ELBO(vectorize_particles=False). Nothing was updated: the running "
        "statistics are as before the call."
    )
