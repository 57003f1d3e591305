"""VOGN's first look at a model: one traced pass that yields the site layout, the hidden
parameters, the prior and the per-example losses that initialise s, checked before anything of
VOGN's (or BatchNorm's running statistics) changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyro.poutine as poutine
import torch
from pyro.infer.autoguide.initialization import InitMessenger
from torch import nn

from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.infer.vogn_model import Hidden, inspect_model, observed_sites
from pyro_bdl.infer.vogn_prior import VOGNPrior
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
    """

    layout: SiteLayout
    hidden: list[Hidden]
    prior: VOGNPrior
    tape: PerExampleGradients
    observed: list[dict]
    statistics: dict[nn.Module, dict[str, torch.Tensor]]

    def restore_statistics(self) -> None:
        """Put back the buffers (BatchNorm's running statistics) that the pass changed; only
        once the pass's backward is done, which reads them."""
        _restore(self.statistics)


@torch.no_grad()
def _restore(snapshots: dict[nn.Module, dict[str, torch.Tensor]]) -> None:
    for module, buffers in snapshots.items():
        for k, b in buffers.items():
            getattr(module, k).copy_(b)


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
    a refusal (and by :meth:`Prepared.restore_statistics`). The random streams are left as they
    were found (a subsampling plate draws indices), so that a run resumed from a state_dict
    continues bit for bit.

    :raises ValueError: for a model VOGN cannot fit (including
        :class:`~pyro_bdl.priors.NonGaussianPriorError`).
    """
    snapshots: dict[nn.Module, dict[str, torch.Tensor]] = {}

    def snapshot(module, inputs):
        if module not in snapshots:
            snapshots[module] = {k: b.clone() for k, b in module.named_buffers(recurse=False)}

    handle = nn.modules.module.register_module_forward_pre_hook(snapshot)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    tape = PerExampleGradients(None, chunk_size=chunk_size)
    try:
        with tape:
            trace = poutine.trace(InitMessenger(init_to_network)(model)).get_trace(*args, **kwargs)
    finally:
        handle.remove()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    try:
        layout, hidden = inspect_model(trace, list(tape.calls), dataset_size)
        like = layout[0].spec.init_value  # type: ignore[union-attr]
        prior = VOGNPrior.read(layout, prior_precision, like)
        if check is not None:
            check(layout, hidden)
    except (ValueError, TypeError):
        _restore(snapshots)
        raise
    observed = observed_sites(trace, set(layout.names))
    return Prepared(layout, hidden, prior, tape, observed, snapshots)
