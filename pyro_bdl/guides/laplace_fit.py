r"""The curvature passes of :meth:`~pyro_bdl.guides.AutoSubnetLaplace.fit`, one per Hessian
structure: the dense subnetwork GGN (``full``), its exact diagonal (``diag``) and the Kronecker
factors of whole layers (``kron``), each with the fit statistics of the data at the MAP
(:func:`~pyro_bdl.guides.laplace_marglik.fit_statistics`) that the marginal likelihood needs.

Every statistic is a sum over examples, so data-parallel ranks each pass their own rows and a
``reduce_fn`` (a sum over ranks, such as an all-reduce) adds them before anything is divided or
factorised: one call per curvature block (the GGN, the diagonal, each Kronecker factor) and one
for the statistics (docs/design/laplace.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pyro_bdl.curvature.ggn import (
    diagonal_ggn,
    linear_layer_ggn,
    output_hessian_factor,
    subnet_ggn,
)
from pyro_bdl.curvature.jacobian import subnet_jacobian
from pyro_bdl.curvature.kfac import kfac_sums
from pyro_bdl.curvature.memory import chunk_budget, chunk_rows, forward_rows
from pyro_bdl.guides.laplace_kron import KronBlock, kron_blocks
from pyro_bdl.guides.laplace_marglik import fit_statistics
from pyro_bdl.guides.laplace_model import Observation, eval_mode, head, network

__all__ = ["ReduceFn", "check_reduce_fn", "fit_diag", "fit_full", "fit_kron"]

#: Sums a tensor over data-parallel ranks and returns the sum (same shape and dtype).
ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def check_reduce_fn(reduce_fn: Any) -> None:
    if reduce_fn is not None and not callable(reduce_fn):
        raise TypeError(
            f"reduce_fn must be a callable summing a tensor over ranks (for example "
            f"pyro_bdl.distributed's all-reduce) or None; got {type(reduce_fn).__name__}."
        )


def _reduce(reduce_fn: ReduceFn | None, t: torch.Tensor) -> torch.Tensor:
    if reduce_fn is None:
        return t
    out = reduce_fn(t)
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        raise ValueError(
            f"reduce_fn must return a tensor of the shape it was given {tuple(t.shape)}; got "
            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}."
        )
    return out


def _stats(out: torch.Tensor, batch: tuple, obs: Observation) -> torch.Tensor:
    if len(batch) < 2 or not isinstance(batch[1], torch.Tensor):
        raise ValueError("fit needs the targets: pass data as (x, y) or a DataLoader of (x, y).")
    return fit_statistics(out, batch[1], obs.likelihood, obs.noise)


def _factor(obs: Observation):
    return lambda f: output_hessian_factor(f, obs.likelihood, obs.noise)


def _single_linear(guide, index) -> KronBlock | None:
    """The block of the subnetwork when it is exactly one whole ``Linear`` layer (weight, and
    bias if it has one), else ``None``."""
    try:
        blocks = kron_blocks(guide.layout, index)
    except ValueError:
        return None
    if len(blocks) != 1 or blocks[0].layer.kind != "linear":
        return None
    return blocks[0] if blocks[0].positions.numel() == index.numel() else None


def fit_full(guide, data: Any, first: tuple, obs: Observation, index, dtype, reduce_fn=None):
    """``(GGN over index (S × S, in dtype), statistics)`` from :math:`J_S` in row chunks sized by
    the guide's memory budget (:mod:`~pyro_bdl.curvature.memory`); when the subnetwork is one
    whole ``Linear`` layer (the last layer), from its inputs without :math:`J_S`
    (:func:`~pyro_bdl.curvature.ggn.linear_layer_ggn`)."""
    item = torch.finfo(dtype).bits // 8
    count = index.numel()
    budget = chunk_budget(count, obs.outputs, guide.batch_size, item, guide.chunk_memory)
    # Measured on the first rows; the weights and the data are not the chunk's memory.
    tensors = [t for t in first if isinstance(t, torch.Tensor)]
    net = network(guide._raw_model)
    owned = [*net.parameters(), *net.buffers()] if net is not None else []
    exclude = [guide.loc, *tensors, *owned]
    layer = _single_linear(guide, index)
    with eval_mode(guide._raw_model):
        at = lambda n: guide._forward(guide.loc, head(first, n), obs)  # noqa: E731
        if layer is not None:
            # Per row: the forward graph, one row of the O·k products, the layer input, the
            # gradients at the layer's output (O × C) and their products (O × O).
            o = layer.positions.shape[0]
            width = 2 * count + layer.positions.shape[1] + o * (o + obs.outputs)
            rows = forward_rows(
                at,
                budget,
                guide.batch_size,
                width * item,
                available=len(tensors[0]),
                exclude=exclude,
            )
            select_numbers = budget // 4 // (3 * item)
        else:
            rows, select_numbers = chunk_rows(
                at,
                index,
                budget,
                guide.batch_size,
                item,
                available=len(tensors[0]),
                exclude=exclude,
            )
    ggn = torch.zeros(count, count, dtype=dtype, device=guide.loc.device)
    stats = torch.zeros(4, dtype=torch.float64)
    with eval_mode(guide._raw_model):
        for batch in guide._batches(data, rows):
            forward, slots = guide._forward(guide.loc, batch, obs)
            out = None
            if layer is not None:
                module, bias = layer.layer.module, layer.layer.bias
                out = linear_layer_ggn(forward, module, bias, layer.positions, _factor(obs), ggn)
            if out is None:
                jac, out = subnet_jacobian(
                    forward, slots, index, return_outputs=True, select_numbers=select_numbers
                )
                subnet_ggn(jac, output_hessian_factor(out, obs.likelihood, obs.noise), out=ggn)
                del jac
            stats += _stats(out, batch, obs).cpu()
            del out, forward, slots
    return _reduce(reduce_fn, ggn), _reduce(reduce_fn, stats)


def fit_diag(guide, data: Any, obs: Observation, index=None, reduce_fn=None, stats=True):
    """``(diagonal of the GGN over index (all D weights when None), statistics or None)``:
    exact, from per-example gradients of :math:`L^\\top f` (:func:`diagonal_ggn`)."""
    diag = torch.zeros(guide.loc.numel(), dtype=torch.float64, device=guide.loc.device)
    total = torch.zeros(4, dtype=torch.float64)
    factor = _factor(obs)
    with eval_mode(guide._raw_model):
        for batch in guide._batches(data):
            forward, slots = guide._forward(guide.loc, batch, obs)
            seen: list[torch.Tensor] = []

            def record(f, seen=seen):
                seen.append(f.detach())
                return factor(f)

            diag += diagonal_ggn(forward, slots, record).double()
            if stats:
                total += _stats(seen[0], batch, obs).cpu()
    diag = _reduce(reduce_fn, diag if index is None else diag[index.to(diag.device)])
    return diag, (_reduce(reduce_fn, total) if stats else None)


def fit_kron(guide, data: Any, obs: Observation, index, reduce_fn=None):
    """``(blocks, A sums, G sums, statistics)`` of the layers in the subnetwork ``index``
    (:func:`~pyro_bdl.guides.laplace_kron.kron_blocks`, :func:`kfac_sums`), in float64."""
    blocks = kron_blocks(guide.layout, index)
    kw = dict(dtype=torch.float64, device=guide.loc.device)
    a_sums = [torch.zeros(b.positions.shape[1], b.positions.shape[1], **kw) for b in blocks]  # type: ignore[arg-type]
    g_sums = [torch.zeros(b.positions.shape[0], b.positions.shape[0], **kw) for b in blocks]  # type: ignore[arg-type]
    stats = torch.zeros(4, dtype=torch.float64)
    layers = [b.layer for b in blocks]
    with eval_mode(guide._raw_model):
        for batch in guide._batches(data):
            forward, _ = guide._forward(guide.loc, batch, obs)
            out = kfac_sums(forward, layers, _factor(obs), a_sums, g_sums)
            stats += _stats(out, batch, obs).cpu()
    a_sums = [_reduce(reduce_fn, a) for a in a_sums]
    g_sums = [_reduce(reduce_fn, g) for g in g_sums]
    return blocks, a_sums, g_sums, _reduce(reduce_fn, stats)
