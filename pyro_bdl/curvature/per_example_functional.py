r"""Networks as functions of their weights: :func:`substitute`, and the brute-force
``torch.func.vmap(grad)`` squared per-example gradients (:func:`vmap_squared_gradients`) that
:class:`~pyro_bdl.curvature.PerExampleGradients` is tested against and falls back on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import grad, vmap

from pyro_bdl.curvature.layer_rules import accumulate_sums

__all__ = ["direct_targets", "module_per_example", "substitute", "vmap_squared_gradients"]


def direct_targets(module: nn.Module) -> list[str]:
    """Names of ``module``'s own trainable parameters and lifted (``PyroSample``) sites."""
    names = [n for n, p in module._parameters.items() if p is not None and p.requires_grad]
    samples = module.__dict__.get("_pyro_samples")
    if samples:
        names += [n for n in samples if n not in names]
    return names


@contextmanager
def substitute(module: nn.Module, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily replace parameters or lifted weight sites of ``module`` by given tensors.

    Works on plain and :func:`~pyro_bdl.bayesianize` -lifted modules alike (a lifted site is then
    read from ``values`` instead of being sampled), so a network can be called as a pure function
    of its weights, for example inside :func:`torch.func.vmap`.

    Usage::

        with substitute(bnn, {"0.weight": w0, "0.bias": b0}):
            out = bnn(x)

    :param module: the network.
    :param values: tensors keyed by dotted parameter (site) name.
    """
    modules = dict(module.named_modules())
    entries = []
    for name, value in values.items():
        mod_name, _, pname = name.rpartition(".")
        sub = modules.get(mod_name)
        if sub is None or pname not in direct_targets(sub) + list(sub._parameters):
            valid = [f"{m}.{p}" if m else p for m, s in modules.items() for p in direct_targets(s)]
            raise ValueError(
                f"substitute: {name!r} is not a parameter or weight site of "
                f"{type(module).__name__}; valid names are {', '.join(map(repr, valid))}."
            )
        entries.append((sub, pname, value))
    try:
        for sub, pname, value in entries:
            # An instance attribute shadows both nn.Module's parameter lookup and PyroModule's
            # PyroSample lookup (both live in __getattr__), without touching the module's state.
            sub.__dict__[pname] = value
        yield
    finally:
        for sub, pname, _ in entries:
            sub.__dict__.pop(pname, None)


def vmap_squared_gradients(
    loss_fn: Callable[..., torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *batch: torch.Tensor,
    chunk_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    r"""Brute force: :math:`\sum_i g_i` and :math:`\sum_i g_i^2` by ``torch.func.vmap(grad)``.

    ``loss_fn(params, *example)`` returns one example's scalar loss (each tensor of ``batch`` is
    sliced along dim 0). This is the oracle :class:`PerExampleGradients` is tested against and the
    fallback it uses for layers without a rule; it forms ``chunk_size`` × parameters at a time.

    Usage::

        def loss_fn(p, x, y):
            with substitute(net, p):
                return F.cross_entropy(net(x[None]), y[None])
        grads, squared = vmap_squared_gradients(loss_fn, dict(net.named_parameters()), x, y)

    :param int chunk_size: examples per vmap call (default: the whole batch).
    """
    if not batch:
        raise ValueError(
            "vmap_squared_gradients needs at least one batched tensor; got none. Pass the batch "
            "after params: vmap_squared_gradients(loss_fn, params, x, y)."
        )
    size = batch[0].shape[0]
    params = {k: v.detach() for k, v in params.items()}
    per_example = vmap(grad(loss_fn), in_dims=(None, *(0,) * len(batch)))
    sums: dict[str, list[torch.Tensor]] = {}
    step = chunk_size or size
    for lo in range(0, size, step):
        pe = per_example(params, *(t[lo : lo + step] for t in batch))
        for name, value in pe.items():
            accumulate_sums(sums, name, value)
    return {k: v[0] for k, v in sums.items()}, {k: v[1] for k, v in sums.items()}


def module_per_example(
    module: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    values: Mapping[str, torch.Tensor],
    delta: torch.Tensor,
    lo: int,
    hi: int,
) -> dict[str, torch.Tensor]:
    r"""Per-example gradients of :math:`\langle \delta_i, f(a_i; \theta)\rangle` for the examples
    ``lo:hi`` of one recorded call ``module(*args, **kwargs)``, by ``vmap(grad)``; :math:`\theta`
    are ``values`` (the module's own parameters or lifted sites, substituted for the call).

    Tensors whose dim 0 is the batch are sliced per example; the others are shared.
    """
    batch = args[0].shape[0]

    def split(t):
        if isinstance(t, torch.Tensor) and t.shape[:1] == (batch,):
            return t[lo:hi], 0
        return t, None

    pos_args = [split(t) for t in args]
    kw_names = list(kwargs)
    kw_args = [split(kwargs[k]) for k in kw_names]
    theta0 = {k: v.detach() for k, v in values.items()}

    def inner(theta, d, *flat):
        pos, kw = flat[: len(pos_args)], flat[len(pos_args) :]
        pos = [p.unsqueeze(0) if dim == 0 else p for p, (_, dim) in zip(pos, pos_args)]
        kws = {
            k: (v.unsqueeze(0) if dim == 0 else v) for k, v, (_, dim) in zip(kw_names, kw, kw_args)
        }
        for name, value in theta.items():
            module.__dict__[name] = value
        try:
            out = module.forward(*pos, **kws)
        finally:
            for name in theta:
                module.__dict__.pop(name, None)
        return (out * d.unsqueeze(0)).sum()

    in_dims = (None, 0, *(dim for _, dim in pos_args), *(dim for _, dim in kw_args))
    with torch.enable_grad():
        return vmap(grad(inner), in_dims=in_dims)(
            theta0, delta[lo:hi], *(t for t, _ in pos_args), *(t for t, _ in kw_args)
        )
