"""VOGN's first look at a model: one traced pass that yields the site layout, the hidden
parameters, the prior and the per-example losses that initialise s, checked before anything of
VOGN's (or BatchNorm's running statistics) changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide.initialization import InitMessenger

from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.infer.rollback import BufferRecorder
from pyro_bdl.infer.vogn_model import Hidden, inspect_model, observed_sites
from pyro_bdl.infer.vogn_prior import VOGNPrior
from pyro_bdl.infer.vogn_update import VOGNState
from pyro_bdl.layout import SiteLayout
from pyro_bdl.nn.lift import init_to_network

__all__ = ["Prepared", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """What the first pass found.

    :ivar layout: the weight sites in the flat vector μ.
    :ivar hidden: the hidden (point-estimate) parameters.
    :ivar prior: the prior VOGN uses.
    :ivar tape: the tape that recorded the pass (its layers are the ones to hook from then on).
    :ivar observed: the observed sites of the pass, weights at their initial values.
    :ivar statistics: the buffers of every layer as they were before the pass.
    :ivar params_added: the param store entries the pass created.
    """

    layout: SiteLayout
    hidden: list[Hidden]
    prior: VOGNPrior
    tape: PerExampleGradients
    observed: list[dict]
    statistics: BufferRecorder
    params_added: frozenset[str] = frozenset()

    def initial_state(self) -> VOGNState:
        """μ at the lifted weights' initial values, everything else zero."""
        specs = [s.spec for s in self.layout if s.spec is not None]
        mean = torch.cat([spec.init_value.detach().reshape(-1) for spec in specs]).clone()
        params: list[torch.Tensor] = [h.param for h in self.hidden]
        return VOGNState(
            mean=mean,
            momentum=torch.zeros_like(mean),
            curvature=torch.zeros_like(mean),
            hidden=params,
            hidden_momentum=[torch.zeros_like(p) for p in params],
            hidden_curvature=[torch.zeros_like(p) for p in params],
        )

    def restore_statistics(self) -> None:
        """Put back the buffers (BatchNorm's running statistics) that the pass changed; only
        once the pass's backward is done, which reads them."""
        self.statistics.restore()

    def undo(self) -> None:
        """Undo the pass (VOGN's first step was refused): the buffers, and the param store entries
        that PyroModule registered for the layers' parameters."""
        self.statistics.restore()
        _forget(self.params_added)


def _forget(names) -> None:
    store = pyro.get_param_store()
    for name in names:
        if name in store:
            del store[name]


def prepare(
    model: Callable,
    args: tuple,
    kwargs: dict,
    *,
    dataset_size: int,
    prior_precision: float | None,
    chunk_size: int | None,
    check: Callable[[SiteLayout, list[Hidden]], None] | None = None,
) -> Prepared:
    """Trace ``model`` at the weights' initial values while a tape records every layer; check the
    model (and, with ``check``, anything else about its layout) and read its prior.

    The pass is a training pass: it updates BatchNorm's running statistics, which are put back on
    any refusal, whatever raised (and by :meth:`Prepared.restore_statistics`). The random streams
    are left as they were found (a subsampling plate draws indices), so that a run resumed from a
    state_dict continues bit for bit.

    :raises ValueError: for a model VOGN cannot fit (including
        :class:`~pyro_bdl.priors.NonGaussianPriorError`).
    """
    recorder = BufferRecorder()
    store = pyro.get_param_store()
    known = set(store.keys())
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    tape = PerExampleGradients(None, chunk_size=chunk_size)
    try:
        with recorder, tape:
            trace = poutine.trace(InitMessenger(init_to_network)(model)).get_trace(*args, **kwargs)
        layout, hidden = inspect_model(trace, list(tape.calls), dataset_size)
        like = layout[0].spec.init_value  # type: ignore[union-attr]
        prior = VOGNPrior.read(layout, prior_precision, like)
        if check is not None:
            check(layout, hidden)
    except BaseException:
        # Whatever refused the pass (bad data, a model error, a check), nothing stays changed.
        recorder.restore()
        _forget(set(store.keys()) - known)
        raise
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    observed = observed_sites(trace, set(layout.names))
    added = frozenset(set(store.keys()) - known)
    return Prepared(layout, hidden, prior, tape, observed, recorder, added)
