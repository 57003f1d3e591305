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

__all__ = ["note_unvectorized_pass", "refuse_training_mode"]


def _training_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm)
        and sub.training
        and sub.track_running_stats
    ]


def _versions(module: nn.Module) -> tuple[int, ...]:
    """The identities and in-place version counters of everything a writer between two passes
    would change: the network's parameters and buffers, and the param store's (unconstrained)
    parameters (an optimiser step writes them in place, a load may replace them)."""
    store = pyro.get_param_store()
    tensors = [
        *module.parameters(),
        *(b for b in module.buffers() if b is not None),
        *(p for _, p in store.named_parameters()),
    ]
    return tuple(n for t in tensors for n in (id(t), t._version))


class _Run:
    """The normalisation buffers before a run of untrained passes, and the versions after its
    latest pass."""

    def __init__(self, module: nn.Module):
        # Imported here: pyro_bdl.infer imports the guides, which import pyro_bdl.nn.
        from pyro_bdl.infer.rollback import Rollback, norm_layer_buffers

        self.rollback = Rollback.saved(norm_layer_buffers([module]))
        self.after: tuple[int, ...] | None = None


#: One run per lifted network (weakly: a run never keeps a network alive).
_RUNS: weakref.WeakKeyDictionary[nn.Module, _Run] = weakref.WeakKeyDictionary()


def note_unvectorized_pass(module: nn.Module):
    """Call before an unvectorized forward of the lifted ``module``; call the returned function
    after it. Outside Pyro, or without training-mode BatchNorm, no run is kept."""
    if not _PYRO_STACK or not _training_layers(module):
        _RUNS.pop(module, None)
        return _nothing
    run = _RUNS.get(module)
    if run is None or run.after != _versions(module):
        run = _RUNS[module] = _Run(module)

    def done() -> None:
        run.after = _versions(module)

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
    if run is not None and run.after == _versions(module):
        run.rollback.restore()
    name = layers[0][0]
    raise RuntimeError(
        f"BatchNorm layer {name!r} is in training mode while the weights carry sample "
        "dims (vectorized particles or Predictive(parallel=True)): its running "
        "statistics are one buffer shared by all samples and cannot be updated from "
        "all of them at once. Call net.eval() before a parallel prediction, or train "
        "with Trace_ELBO(vectorize_particles=False). Nothing was updated: the running "
        "statistics are as before the call."
    )
