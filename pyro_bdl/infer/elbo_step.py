"""``loss_and_grads`` of :class:`~pyro_bdl.infer.TraceSuffStat_ELBO`: Trace_ELBO's, except that a
refused step (a non-finite loss, or anything the model or guide raises) changes nothing: the
network's buffers (BatchNorm's running statistics), torch's random state and the parameters'
gradients are put back before the error propagates, so ``SVI.step`` never reaches the optimiser
and a retry with good data continues the run as if the bad batch had not come.

The first step learns which buffers a pass writes (a global forward pre-hook, that step only);
later steps copy just those (a few KB) and the generator state before the passes. A refused first
call of an autoguide also undoes its set-up (its parameters and param store entries), so that the
retry initialises it as an uninterrupted first step would.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyro
import torch

from pyro_bdl.infer.rollback import BufferRecorder, Rollback, refused

__all__ = ["StepGuard", "guarded_loss_and_grads"]


@dataclass
class StepGuard:
    """Per-ELBO bookkeeping: the layers to save (known after the first step) and the steps done.

    :ivar int steps: ``loss_and_grads`` calls that completed (SVI steps taken with this ELBO).
    :ivar current: the step under way (``None`` outside ``loss_and_grads``), for error messages.
    """

    rollback: Rollback | None = None
    steps: int = 0
    current: int | None = None


def _leaf(value: torch.Tensor) -> torch.Tensor:
    unconstrained = getattr(value, "unconstrained", None)
    return unconstrained() if callable(unconstrained) else value


def guarded_loss_and_grads(elbo, guard: StepGuard, model, guide, args, kwargs) -> float:
    """Trace_ELBO's loss and backward pass over ``elbo.num_particles`` particles, undone on any
    error (with several particles, the gradients of the earlier ones are restored too)."""
    recorder = BufferRecorder() if guard.rollback is None else None
    cpu_rng = torch.get_rng_state() if recorder is not None else None
    cuda_rng = (
        torch.cuda.get_rng_state_all()
        if recorder is not None and torch.cuda.is_initialized()
        else None
    )
    if recorder is not None:
        recorder.__enter__()
    else:
        assert guard.rollback is not None
        guard.rollback.save()
    # An autoguide sets itself up (parameters, param store entries) on its first call; a refused
    # first call undoes that too, so that the retry initialises it as the first call would have.
    fresh_guide = getattr(guide, "prototype_trace", False) is None
    store = pyro.get_param_store()
    known = set(store.keys()) if fresh_guide or recorder is not None else None
    grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    guard.current = guard.steps + 1
    loss = 0.0
    try:
        for model_trace, guide_trace in elbo._get_traces(model, guide, args, kwargs):
            loss_particle, surrogate = elbo._differentiable_loss_particle(model_trace, guide_trace)
            loss += loss_particle / elbo.num_particles
            params = [
                _leaf(site["value"])
                for trace in (model_trace, guide_trace)
                for site in trace.nodes.values()
                if site["type"] == "param"
            ]
            if params and getattr(surrogate, "requires_grad", False):
                if grads is None and elbo.num_particles > 1:
                    grads = [(p, None if p.grad is None else p.grad.clone()) for p in params]
                (surrogate / elbo.num_particles).backward(retain_graph=elbo.retain_graph)
    except BaseException as err:
        refused(err, f"TraceSuffStat_ELBO step {guard.current}")
        if recorder is not None:
            recorder.__exit__()
            recorder.restore()
            if cpu_rng is not None:
                torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        else:
            assert guard.rollback is not None
            guard.rollback.restore()
        for p, g in grads or ():
            p.grad = g
        for name in set(store.keys()) - known if known is not None else ():
            del store[name]
        if fresh_guide:
            guide.prototype_trace = None
        raise
    finally:
        guard.current = None
    if recorder is not None:
        recorder.__exit__()
        guard.rollback = Rollback(recorder.written())
    guard.steps += 1
    return loss
