r"""One batched forward pass of a lifted network when its weights carry sample dimensions.

Under ``Trace_ELBO(vectorize_particles=True)``, ``Predictive(parallel=True)`` or any outer
``pyro.plate``, every weight site of a lifted network is drawn with leading batch dims, e.g.
``(K, 1, *param_shape)`` for K particles over a data plate at dim -1, which ``F.linear`` and
``F.conv2d`` cannot take. :func:`bayesianize` therefore gives the lifted module a forward that,
only while a plate is active, reads every lifted site once (Pyro caches the values for the
call), and, if any value is batched, runs the network's own forward once under
:func:`torch.func.vmap` over the flattened sample dims, each lifted layer reading its slice of
the weights from the same cache. Outside any plate the network's forward runs unchanged.

Conventions:

- The output gets the weights' batch dims with their trailing singleton dims removed (those are
  the inner plates the weights do not vary along), followed by the network's usual output shape:
  ``(K, B, C)`` for K particles of a ``(B, C)`` classifier, so a likelihood in the data plate
  broadcasts against the particle plate.
- Inputs, hidden (non-lifted) parameters and buffers are shared by all samples.
- Random operations in the forward (dropout) draw independently per sample.
- An object in the output other than a tensor or a plain constant (a transformer's key/value
  cache, built per sample inside ``vmap``) comes back as ``None``.
- BatchNorm must be in eval mode: its running statistics are one buffer shared by the samples,
  which K batched forwards cannot update at once (a clear error says so, and puts back what
  Pyro's unvectorized inspection passes before it wrote: :mod:`~pyro_bdl.nn.running_stats`).
- A forward that ``vmap`` cannot batch (Python branches on a tensor's value) is refused with the
  cause and the fix (``parallel=False``, ``vectorize_particles=False``), chained to vmap's error.
- Every lifted site is drawn before the forward, including those of layers the forward does not
  use.
- A network with a lifted recurrent layer (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) runs its forward
  once per sample in a loop instead: PyTorch's fused recurrent kernels have no ``vmap`` rule.
- Under ``Predictive(parallel=True)`` and ``WeighedPredictive(parallel=True)`` the weights' prior
  scores a conditioned value that lacks the singleton plate dims (:class:`PlateDimsRestored`):
  Pyro pads a posterior sample with the ``1`` s of the plates its site sits outside only up to
  the model's plate count minus the sample's dims, so a weight with as many dims as the model
  has plates keeps the shape ``(S, *event_shape)``: a ``(S, 8, 4)`` value met the
  ``(S, 1 | 8, 4)`` prior, scored ``(S, S)`` and broke the packing of ``WeighedPredictive``.

See docs/design/lifting.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import pyro.distributions as dist
import torch
from pyro.infer.predictive import _predictive_vectorize_plate_name
from pyro.poutine.messenger import Messenger
from pyro.poutine.plate_messenger import PlateMessenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from pyro_bdl.nn.running_stats import note_unvectorized_pass, refuse_training_mode

__all__ = [
    "PlateDimsRestored",
    "batched_forward",
    "install_batched_forward",
    "restore_plate_dims",
    "under_plate",
]

_SITES_ATTR = "_bdl_sites"


def under_plate() -> bool:
    """Whether any ``pyro.plate`` is active (the only case where weights can carry batch dims)."""
    return any(isinstance(m, PlateMessenger) for m in _PYRO_STACK)


def restore_plate_dims(value: torch.Tensor, batch_shape: torch.Size, event_dim: int):
    """``value`` reshaped to ``(*batch_shape, *event_shape)`` when its batch dims are
    ``batch_shape`` without some singleton dims (and so would broadcast to the wrong shape);
    otherwise ``value`` unchanged."""
    value_batch = value.shape[: value.dim() - event_dim]
    try:
        if torch.broadcast_shapes(value_batch, batch_shape) == batch_shape:
            return value
    except RuntimeError:
        pass
    if [d for d in value_batch if d != 1] != [d for d in batch_shape if d != 1]:
        return value
    return value.reshape(*batch_shape, *value.shape[value.dim() - event_dim :])


class PlateDimsRestored(dist.TorchDistribution):
    """``base`` scoring a value whose batch dims lack singleton plate dims as if it had them
    (see :func:`restore_plate_dims`); sampling, support and shapes are ``base``'s. The attribute
    ``base_dist`` lets :func:`~pyro_bdl.nn.spec.site_spec` find the lifted site behind it."""

    arg_constraints: dict = {}

    def __init__(self, base: dist.TorchDistribution):
        self.base_dist = base
        super().__init__(base.batch_shape, base.event_shape, validate_args=False)

    @property
    def support(self):  # type: ignore[override]
        return self.base_dist.support

    @property
    def has_rsample(self) -> bool:  # type: ignore[override]
        return self.base_dist.has_rsample

    def expand(self, batch_shape, _instance=None):
        return PlateDimsRestored(self.base_dist.expand(batch_shape))

    def sample(self, sample_shape=torch.Size()):
        return self.base_dist.sample(sample_shape)

    def rsample(self, sample_shape=torch.Size()):
        return self.base_dist.rsample(sample_shape)

    def log_prob(self, value):
        value = restore_plate_dims(value, self.batch_shape, len(self.event_shape))
        return self.base_dist.log_prob(value)


class _RestorePlateDims(Messenger):
    """Wraps every sample site's distribution in :class:`PlateDimsRestored`."""

    def _pyro_sample(self, msg) -> None:
        msg["fn"] = PlateDimsRestored(msg["fn"])


def _under_parallel_predictive() -> bool:
    return any(
        isinstance(m, PlateMessenger) and m.name == _predictive_vectorize_plate_name
        for m in _PYRO_STACK
    )


def install_batched_forward(module: nn.Module) -> None:
    """Give the lifted ``module`` the forward described in this module's docstring (idempotent).

    The forward is an instance attribute (a :func:`functools.partial` of a module-level function,
    so the network still pickles and deep-copies); its class and ``state_dict`` are unchanged.
    """
    current = module.__dict__.get("forward")
    if isinstance(current, functools.partial) and current.func is batched_forward:
        return
    object.__setattr__(module, "forward", functools.partial(batched_forward, module))


def _lifted_sites(module: nn.Module) -> list[Any]:
    """The :class:`~pyro_bdl.nn.SiteSpec` s of every lifted site under ``module``."""
    specs: dict[int, Any] = {}
    for sub in module.modules():
        for spec in getattr(sub, _SITES_ATTR, {}).values():
            specs.setdefault(id(spec), spec)
    return list(specs.values())


def _batched_leaf(leaf: Any, tensors: Any) -> Any:
    """A leaf of the vectorized output: the next batched tensor for a tensor, a plain constant
    as it is, and ``None`` for any other object the forward built per sample (a transformer's
    key/value cache), whose tensors cannot leave ``vmap``."""
    if isinstance(leaf, torch.Tensor):
        return next(tensors)
    return leaf if isinstance(leaf, (bool, int, float, str, type(None))) else None


def _vmapped(one: Callable[..., Any], in_dims: tuple[int | None, ...], flat: tuple) -> Any:
    """``one`` over the samples under :func:`torch.func.vmap`, its refusals explained."""
    try:
        return torch.func.vmap(one, in_dims=(in_dims,), randomness="different")(flat)
    except RuntimeError as err:
        # vmap's own refusals name vmap, and an in-place update of a tensor shared by the
        # samples with a per-sample one fails torch's broadcast check with the sample dim in
        # the shape; errors of the forward itself pass through unchanged.
        message = str(err)
        inplace = "doesn't match the broadcast shape" in message
        if "vmap" not in message.lower() and not inplace:
            raise
        cause = (
            "the forward updates in place a tensor that is the same for every sample with one "
            "that differs per sample (`result += lora(x)`, as PEFT's AdaLoRA does)"
            if inplace
            else "the forward branches in Python on a tensor's value (`if x.sum() > 0:`, "
            "`.item()`), which differs per sample"
        )
        raise RuntimeError(
            "the network's forward cannot run vectorized over the weight samples (vectorized "
            f"particles or Predictive(parallel=True)): torch.func.vmap refused it, most likely "
            f"because {cause}. Use Predictive(parallel=False) or "
            "Trace_ELBO(vectorize_particles=False), or write the branch as torch.where and the "
            f"update out of place. vmap said: {err}"
        ) from err


def _unvectorized(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The plain forward, noted so that a refused vectorized pass after it can undo it."""
    done = note_unvectorized_pass(module)
    out = forward(*args, **kwargs)
    done()
    return out


def batched_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The lifted module's forward: the class's own forward, vectorized over sample dims of the
    weights when there are any (see this module's docstring)."""
    forward: Callable[..., Any] = functools.partial(type(module).forward, module)
    context = getattr(module, "_pyro_context", None)
    if context is None or not context.active or not under_plate():
        return _unvectorized(module, forward, args, kwargs)

    specs = _lifted_sites(module)
    # Only Predictive's plate brings the mis-shaped values, and no ELBO looks for a KL there.
    restore = _RestorePlateDims() if _under_parallel_predictive() else contextlib.nullcontext()
    with restore:
        # Reading a site draws it; Pyro caches the value for the rest of the call.
        drawn = [getattr(spec.module, spec.param_name) for spec in specs]
    keys, values, batch_shapes = [], [], []
    for spec, value in zip(specs, drawn):
        event = spec.shape
        batch = value.shape[: value.dim() - len(event)]
        if value.dim() < len(event) or value.shape[len(batch) :] != event:
            raise ValueError(
                f"lifted site {spec.name!r} has value shape {tuple(value.shape)}; expected "
                f"(*sample_dims, {', '.join(map(str, event))}). A guide or condition must give "
                "this weight its parameter's shape, with optional leading sample dims."
            )
        keys.append(spec.module._pyro_get_fullname(spec.param_name))
        values.append(value)
        batch_shapes.append(batch)
    batch = torch.broadcast_shapes(*batch_shapes) if batch_shapes else torch.Size()
    if not batch:
        return _unvectorized(module, forward, args, kwargs)

    lead = list(batch)
    while lead and lead[-1] == 1:
        lead.pop()
    num = math.prod(lead)
    cache = context.cache
    saved = {key: cache[key] for key in keys}
    try:
        if not lead:  # a single sample with singleton plate dims: the plain forward
            for key, spec, value in zip(keys, specs, values):
                cache[key] = value.reshape(spec.shape)
            return _unvectorized(module, forward, args, kwargs)
        refuse_training_mode(module)
        flat: list[torch.Tensor] = []
        in_dims: list[int | None] = []
        for spec, value, shape in zip(specs, values, batch_shapes):
            if math.prod(shape) == 1:  # shared by all samples
                flat.append(value.reshape(spec.shape))
                in_dims.append(None)
            else:
                value = value.expand(*batch, *spec.shape)
                flat.append(value.reshape(num, *spec.shape))
                in_dims.append(0)

        structure: list[tuple[list[Any], TreeSpec]] = []

        def one(weights: tuple[torch.Tensor, ...]) -> Any:
            for key, weight in zip(keys, weights):
                cache[key] = weight
            leaves, spec = tree_flatten(forward(*args, **kwargs))
            structure.append((leaves, spec))
            return tuple(t for t in leaves if isinstance(t, torch.Tensor))

        if any(isinstance(spec.module, nn.RNNBase) for spec in specs):
            outs = [
                one(tuple(w if d is None else w[i] for w, d in zip(flat, in_dims)))
                for i in range(num)
            ]
            stacked = tuple(torch.stack(samples) for samples in zip(*outs))
        else:
            stacked = _vmapped(one, tuple(in_dims), tuple(flat))
        tensors = iter(stacked)
        leaves, spec = structure[-1]
        out = tree_unflatten([_batched_leaf(leaf, tensors) for leaf in leaves], spec)
    finally:
        cache.update(saved)
    return tree_map(
        lambda t: t.reshape(*lead, *t.shape[1:]) if isinstance(t, torch.Tensor) else t, out
    )
