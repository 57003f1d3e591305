"""The one mechanism that undoes a refused step (docs/design/README.md: a refused step changes
nothing): what a pass changed outside the optimiser's own state, the buffers of the network's
layers (BatchNorm's running statistics and ``num_batches_tracked``), torch's random streams and the
param store entries a first pass created.

:class:`Rollback` saves and restores known buffers and the random streams around every step (the
ELBO, VOGN and IVON, and the data-parallel steps of :mod:`pyro_bdl.distributed`);
:class:`BufferRecorder` and :class:`ParamStoreRecorder` undo a first pass over modules and
parameters not known in advance.

A forward pass in training mode writes the batch's statistics into BatchNorm before any loss is
seen, so a check of the loss comes too late to keep a NaN batch out of them. Copying the buffers
(a few KB) and the generator state before the pass, and back on a refusal, costs a fraction of a
percent of a step; the common path never copies back.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, cast

import pyro
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from pyro_bdl.nn.spec import constant_buffer_names

__all__ = ["BufferRecorder", "ParamStoreRecorder", "Rollback", "norm_layer_buffers", "refused"]


class Rollback:
    """Saves and restores some buffers of some layers, the random streams, and any tensors an
    owner updates in place (an optimiser's state, given to :meth:`save`).

    :param buffers: ``(module, buffer name)`` pairs (see :meth:`BufferRecorder.written`). Buffers
        are looked up by name at every :meth:`save`, so a buffer replaced by a new tensor
        (``module.running_mean = ...``) is still the one restored.
    """

    def __init__(self, buffers: Iterable[tuple[nn.Module, str]]):
        self._entries = list(buffers)
        self._buffers = _Copies()  # the buffers of the last save, and their copies
        self._cpu_rng: torch.Tensor | None = None
        self._cuda_rng: list[torch.Tensor] | None = None
        self._state = _Copies()  # the tensors given to save(), and their copies

    @classmethod
    def saved(cls, buffers: Iterable[tuple[nn.Module, str]] = ()) -> Rollback:
        """A rollback of ``buffers`` (none: the random streams only), saved now."""
        rollback = cls(buffers)
        rollback.save()
        return rollback

    @torch.inference_mode(False)
    def save(self, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Copy the buffers and ``tensors`` (into storage kept between steps) and the generator
        states. The storage is made outside inference mode, also when the caller runs under
        ``torch.inference_mode()`` (an evaluation first): a later save outside it writes there."""
        # ``_buffers`` directly: a PyroModule's __getattr__ costs microseconds per lookup.
        buffers = [module._buffers[name] for module, name in self._entries]
        self._buffers.save(cast(list[torch.Tensor], buffers))  # written() lists no None buffer
        self._state.save(tensors)
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @torch.no_grad()
    def restore(self) -> None:
        """Put back what :meth:`save` copied."""
        for (module, name), tensor in zip(self._entries, self._buffers.live):
            if module._buffers.get(name) is not tensor:  # the pass assigned a new tensor
                module._buffers[name] = tensor
        self._buffers.restore()
        self._state.restore()
        if self._cpu_rng is not None:
            torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)


class _Copies:
    """Copies of some tensors, in storage reused while the same tensors are saved again.

    The pairs are grouped by dtype and device: on CUDA ``torch._foreach_copy_`` is one
    multi-tensor kernel only when every source shares the first one's dtype, and a mixed list
    (BatchNorm's float statistics with its int64 ``num_batches_tracked``) falls back to one copy
    per tensor, a launch each (124 per ResNet-18 step). One call per group keeps it a few kernels.
    """

    def __init__(self) -> None:
        self.live: list[torch.Tensor] = []
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (live, copies)

    @torch.no_grad()
    @torch.inference_mode(False)  # as Rollback.save
    def save(self, tensors: Sequence[torch.Tensor]) -> None:
        live = list(tensors)
        if len(live) == len(self.live) and all(map(operator.is_, live, self.live)):
            for originals, copies in self._groups:
                torch._foreach_copy_(copies, originals)
            return
        self.live = live
        groups: dict[tuple[torch.dtype, torch.device], tuple[list, list]] = {}
        for t in live:
            originals, copies = groups.setdefault((t.dtype, t.device), ([], []))
            originals.append(t)
            copies.append(t.detach().clone())
        self._groups = list(groups.values())

    @torch.no_grad()
    def restore(self) -> None:
        for originals, copies in self._groups:
            torch._foreach_copy_(originals, copies)


def norm_layer_buffers(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
    """The ``(layer, buffer name)`` pairs of the normalisation layers with running statistics
    inside ``modules``, once each: the state a training-mode forward pass changes."""
    seen: dict[int, tuple[nn.Module, str]] = {}
    for top in modules:
        for m in top.modules():
            if isinstance(m, _NormBase) and m.track_running_stats:
                for name, b in m.named_buffers(recurse=False):
                    seen.setdefault(id(b), (m, name))
    return list(seen.values())


class BufferRecorder:
    """While active, copies the buffers of every module before its first forward call (a global
    forward pre-hook), so that a pass over modules not known in advance can be undone; the
    buffers :func:`~pyro_bdl.bayesianize` added and no pass writes are left out.

    :ivar snapshots: ``{module: {buffer name: copy}}`` of the modules called so far.
    """

    def __init__(self) -> None:
        self.snapshots: dict[nn.Module, dict[str, torch.Tensor]] = {}
        # The tensor and its in-place version counter before the pass, to see what it wrote.
        self._seen: dict[tuple[nn.Module, str], tuple[torch.Tensor, int]] = {}
        self._handle: Any = None

    def _hook(self, module: nn.Module, inputs) -> None:
        if module not in self.snapshots:
            # What bayesianize added and no pass writes is skipped: a frozen base model would
            # otherwise be copied whole on the first step.
            constant = constant_buffer_names(module)
            buffers = {
                k: b for k, b in module._buffers.items() if b is not None and k not in constant
            }
            self.snapshots[module] = {k: b.detach().clone() for k, b in buffers.items()}
            for k, b in buffers.items():
                self._seen[(module, k)] = (b, b._version)

    def __enter__(self) -> BufferRecorder:
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def written(self) -> list[tuple[nn.Module, str]]:
        """The buffers a pass like the recorded one may change: those it wrote (in place or by
        assignment), and every buffer of a normalisation layer (which writes its running
        statistics only in training mode). Constant buffers, such as the initial values that
        :func:`~pyro_bdl.bayesianize` keeps, are left out: copying them would cost a step as
        much as the weights."""
        out = []
        for (module, name), (tensor, version) in self._seen.items():
            now = getattr(module, name, None)
            if isinstance(module, _NormBase) or now is not tensor or tensor._version != version:
                out.append((module, name))
        return out

    @torch.no_grad()
    def restore(self) -> None:
        """Put every recorded buffer back as it was before its module's first call."""
        for module, buffers in self.snapshots.items():
            for k, b in buffers.items():
                getattr(module, k).copy_(b)


class ParamStoreRecorder:
    """The entries of Pyro's param store that a pass creates (PyroModule registers a layer's
    parameters on first use), so that a refused first pass can forget them.

    :ivar frozenset added: the names created between construction and :meth:`stop`.
    """

    def __init__(self) -> None:
        self._known = set(pyro.get_param_store().keys())
        self.added: frozenset[str] = frozenset()
        self._stopped = False

    def stop(self) -> frozenset[str]:
        """Record the entries created since construction; returns them."""
        self.added = frozenset(set(pyro.get_param_store().keys()) - self._known)
        self._stopped = True
        return self.added

    def forget(self) -> None:
        """Delete the entries created since construction (recorded at :meth:`stop`, or now)."""
        store = pyro.get_param_store()
        for name in self.added if self._stopped else self.stop():
            if name in store:
                del store[name]


def refused(err: BaseException, where: str) -> None:
    """Note on an error raised from inside a step (by the model, the data, a collective) where it
    happened and that the step was undone; our own refusals say so in their message already."""
    if isinstance(err, Exception) and "nothing was updated" not in str(err):
        err.add_note(f"{where} was refused and undone: nothing was updated.")
