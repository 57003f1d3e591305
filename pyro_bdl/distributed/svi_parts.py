"""The small pieces of :class:`~pyro_bdl.distributed.DataParallelSVI`'s step: argument checks,
checksums, the record of the parameters a step reads, the modules and normalisation layers it can
see, and the backward-pass count that the gradient buckets expect (docs/design/distributed.md)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch
from pyro.optim import PyroOptim
from pyro.poutine.messenger import Messenger
from torch import nn

from pyro_bdl.models import NetworkModel

SEED_RANGE = 2**31 - 1


def item(value) -> float:
    # Detach first: a callable loss may return a tensor that still requires grad.
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def check_seed(seed: object) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(
            f"seed must be an int or None; got {type(seed).__name__} {seed!r}. Pass a Python int, "
            "or None to draw one."
        )
    if seed is not None and not 0 <= seed < SEED_RANGE:
        raise ValueError(f"seed must lie in [0, 2**31 - 1); got {seed}. Pass a seed in that range.")


def grads_of(trained: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The gradients of ``trained``, made dense for the flat reduction (a sparse one is an
    embedding's, as the gradient buckets do), zeros where a parameter has none."""
    for _, p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            p.grad = p.grad.to_dense()
    return [p.grad for _, p in trained]  # type: ignore[misc]


class ParamRecorder(Messenger):
    """The parameters a pass reads, by name, in the order first read: what SVI takes from
    ``poutine.trace(param_only=True)``, without copying every site's message into a trace (a
    third less than the trace adds to each ``pyro.param`` call); and the sizes of the subsampled
    plates, whose N/B scale makes the ranks' average exact only when the ranks' B agree.

    :ivar dict params: ``{name: unconstrained tensor}`` after the pass.
    :ivar dict plates: ``{plate name: subsample size}`` of the plates with a subsample.
    """

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, torch.Tensor] = {}
        self.plates: dict[str, int] = {}

    def __enter__(self) -> ParamRecorder:
        self._values: dict[str, torch.Tensor] = {}
        self.params = {}
        self.plates = {}
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        # The param store ties each constrained value to its leaf tensor by a weak reference.
        self.params = {n: v.unconstrained() for n, v in self._values.items()}  # type: ignore[attr-defined]

    def _pyro_post_param(self, msg) -> None:
        self._values[msg["name"]] = msg["value"]

    def _pyro_post_sample(self, msg) -> None:
        for frame in msg["cond_indep_stack"]:
            if frame.full_size is not None and frame.size != frame.full_size:
                self.plates[frame.name] = frame.size

    def batch(self) -> tuple[int, int]:
        """(a checksum of the subsampled plates' names and sizes, the first one's size or 0):
        what the ranks compare."""
        plates = sorted(self.plates.items())
        return crc([f"{name}:{size}" for name, size in plates]), plates[0][1] if plates else 0


def backward_passes(loss) -> int:
    """Backward passes per step of ``loss``: Pyro's ELBOs call backward once per particle unless
    the particles are vectorised (a wrong count only loses the overlap, see overlap.py)."""
    particles = getattr(loss, "num_particles", 1)
    if getattr(loss, "vectorize_particles", False) or "Jit" in type(loss).__name__:
        return 1
    return particles if isinstance(particles, int) and particles > 0 else 1


def crc(names: list[str]) -> int:
    return zlib.crc32("\n".join(names).encode())


def optimizer_state(optim: PyroOptim, named: dict[str, torch.Tensor]):
    """What ``optim`` holds for the ``named`` parameters, as (a description, its tensors): which
    parameters have state, its keys, shapes, dtypes and plain values, and the names of loaded
    state no step has consumed yet. Equal descriptions on every rank let rank 0's tensors be
    broadcast; a step taken before wrapping leaves each rank's Adam moments different."""
    described: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, p in named.items():
        # One torch optimizer per parameter (PyroOptim, whose schedulers wrap theirs), or one
        # for all (FusedOptim).
        owner = optim.optim_objs.get(p, getattr(optim, "optimizer", None))
        optimizer = getattr(owner, "optimizer", owner)
        state = {} if optimizer is None else optimizer.state.get(p, {})
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                described.append(f"{name}.{key}:{tuple(value.shape)}:{value.dtype}")
                tensors.append(value)
            else:
                described.append(f"{name}.{key}={value!r}")
    waiting = getattr(optim, "_state_waiting_to_be_consumed", {})
    described += [f"loaded, not consumed: {name}" for name in sorted(waiting)]
    return described, tensors


def module_buffers(tops: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every buffer of ``tops`` (each listed once), by name: the frozen weights a lift hides,
    normalisation statistics, a guide's moments."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for i, top in enumerate(tops):
        for name, buffer in top.named_buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                found[f"{i}.{name}"] = buffer
    return found


def modules(model: Callable, guide: Callable) -> Iterator[nn.Module]:
    """The modules we can see: the guide, the model if it is a module, and the network of a
    :class:`~pyro_bdl.models.NetworkModel` (what ``models.classifier`` and ``regressor`` return)."""
    net = model.net if isinstance(model, NetworkModel) else None
    for candidate in (guide, model, net):
        if isinstance(candidate, nn.Module):
            yield candidate


def unsynced_batchnorms(modules: list[nn.Module]) -> dict[str, nn.Module]:
    found: dict[str, nn.Module] = {}
    for top in modules:
        for name, m in top.named_modules():
            is_bn = isinstance(m, nn.modules.batchnorm._BatchNorm)
            if is_bn and not isinstance(m, nn.SyncBatchNorm) and m.track_running_stats:
                found.setdefault(name or type(m).__name__, m)
    return found
