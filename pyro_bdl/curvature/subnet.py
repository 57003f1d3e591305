r"""The Jacobian and GGN over a subnetwork of the weights, computed directly.

For outputs :math:`f(x, \theta) \in \mathbb{R}^C` and a subnetwork :math:`S` of the packed weight
vector, :func:`subnet_jacobian` returns :math:`J_S = \partial f / \partial \theta_S` of shape
``(B, C, S)`` without ever forming a ``B × C × D`` tensor over all ``D`` weights. For ``Linear``
and ``Conv2d`` layers a forward hook keeps the layer's input :math:`a`, one backward pass per
output gives the gradient :math:`g` at the layer's output, and the per-example derivative with
respect to weight :math:`W_{ij}` is :math:`g_i a_j` (summed over positions for convolutions and
sequence dims), evaluated only at the selected entries. Any other parameter falls back to one
backward pass per (example, output) pair that reads the gradient of that tensor only.

Memory is :math:`O(B \cdot C \cdot S)` for the result plus the forward graph of the network; the
GGN :math:`\sum_n J_{S,n}^\top \Lambda_n J_{S,n}` adds :math:`S^2`. The same hooks give the
diagonal GGN over all weights (:func:`diagonal_ggn`), which diagonal Laplace and the
largest-variance subnetwork rule need.

Usage::

    slots = [ParamSlot(net[0].weight, net[0], "weight"), ParamSlot(net[0].bias, net[0], "bias")]
    jac = subnet_jacobian(lambda: net(x), slots, torch.tensor([0, 5, 7]))

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ParamSlot",
    "TensorMemoryTracker",
    "cholesky_jitter",
    "diagonal_ggn",
    "jacobian_row_bytes",
    "linearized_predictive",
    "log_marginal",
    "output_hessian_factor",
    "subnet_ggn",
    "subnet_jacobian",
    "tune_grid",
]

LIKELIHOODS = ("categorical", "bernoulli", "gaussian")


class ParamSlot(NamedTuple):
    """One weight tensor of the packed vector.

    :ivar value: the tensor the forward pass uses (it must require grad).
    :ivar module: the layer that uses it (``None``: use the generic fallback).
    :ivar str name: its name in ``module`` (``"weight"`` or ``"bias"`` take the fast path).
    """

    value: torch.Tensor
    module: nn.Module | None
    name: str


def _fast_kind(slot: ParamSlot) -> str | None:
    """``"linear"``/``"conv"`` when the per-example derivative has a closed form from hooks."""
    m = slot.module
    if slot.name not in ("weight", "bias") or m is None:
        return None
    if isinstance(m, nn.Linear):
        return "linear"
    if (
        isinstance(m, nn.Conv2d)
        and m.groups == 1
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    ):
        return "conv"
    return None


def _input_factor(kind: str, module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """The layer input as (B, K, T), so that the per-example weight gradient is
    ``Σ_t g[b,:,t] a[b,:,t]ᵀ`` with ``g`` from :func:`_grad_factor`."""
    if kind == "linear":
        return a.reshape(a.shape[0], -1, a.shape[-1]).transpose(1, 2)
    assert isinstance(module, nn.Conv2d)
    return F.unfold(
        a,
        module.kernel_size,
        dilation=module.dilation,
        padding=module.padding,  # type: ignore[arg-type]
        stride=module.stride,
    )


def _grad_factor(kind: str, g: torch.Tensor) -> torch.Tensor:
    """The gradient at the layer output as (B, O, T)."""
    if kind == "linear":
        return g.reshape(g.shape[0], -1, g.shape[-1]).transpose(1, 2)
    return g.flatten(2)


def _select(slot: ParamSlot, a, g, local: torch.Tensor, budget: int = 1 << 20):
    """Per-example derivatives at the flat entries ``local`` of ``slot``: shape (B, len(local)),
    from :func:`_input_factor` and :func:`_grad_factor`."""
    if slot.name == "bias":
        return g.sum(-1)[:, local]
    k = a.shape[1]
    out = []
    # Chunk the columns: each of the three temporaries below holds B × chunk × T ≤ ``budget``
    # numbers (for chunks of at least one column), not B × S × T.
    chunk = max(1, budget // (a.shape[0] * a.shape[2]))
    for part in local.split(chunk):
        rows, cols = part // k, part % k
        out.append((g[:, rows, :] * a[:, cols, :]).sum(-1))
    return torch.cat(out, 1)


def _per_example_full(slot: ParamSlot, kind: str, a, g) -> torch.Tensor:
    """Per-example gradient of the whole tensor, (B, numel); callers chunk the batch."""
    a, g = _input_factor(kind, slot.module, a), _grad_factor(kind, g)  # type: ignore[arg-type]
    if slot.name == "bias":
        return g.sum(-1)
    return torch.einsum("bot,bkt->bok", g, a).flatten(1)


@contextlib.contextmanager
def _capture(modules: Sequence[nn.Module]) -> Iterator[dict[nn.Module, list]]:
    """Forward hooks recording ``(input, output)`` of every call of ``modules``."""
    calls: dict[nn.Module, list] = {m: [] for m in modules}

    def hook(module, inputs, output):
        calls[module].append((inputs[0].detach(), output))

    handles = [m.register_forward_hook(hook) for m in calls]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _layout(slots: Sequence[ParamSlot], index: torch.Tensor):
    """For each slot: (slot, fast kind, local flat indices, positions in ``index``)."""
    out, offset = [], 0
    for slot in slots:
        n = slot.value.numel()
        mask = (index >= offset) & (index < offset + n)
        pos = mask.nonzero().squeeze(-1)
        if pos.numel():
            out.append((slot, _fast_kind(slot), index[pos] - offset, pos))
        offset += n
    return out


def _as_matrix(out: torch.Tensor) -> torch.Tensor:
    if out.dim() == 1:
        return out.unsqueeze(-1)
    if out.dim() != 2:
        raise ValueError(
            f"the network outputs must have shape (B, C) or (B,); got {tuple(out.shape)}. "
            "Flatten the outputs per example."
        )
    return out


def subnet_jacobian(
    forward: Callable[[], torch.Tensor],
    slots: Sequence[ParamSlot],
    index: torch.Tensor,
    *,
    return_outputs: bool = False,
    select_numbers: int = 1 << 20,
):
    r"""Jacobian of the outputs with respect to the packed weights at ``index``: (B, C, S).

    The packed vector is the concatenation of ``slot.value.reshape(-1)`` in order. Examples must
    be independent (BatchNorm in eval mode). One backward pass per output for ``Linear``/``Conv2d``
    weights; one per (example, output) for anything else.

    :param forward: runs the network and returns its outputs, (B, C) or (B,) (taken as C = 1).
    :param slots: the weight tensors, in packing order.
    :param torch.Tensor index: packed indices of the subnetwork (any order, no duplicates).
    :param bool return_outputs: also return the detached outputs (B, C).
    :param int select_numbers: numbers in each of the three temporaries that pick the selected
        entries of a layer (B × columns × positions); bounds their memory.
    """
    index = index.to(torch.long)
    layout = _layout(slots, index.cpu())
    fast_modules = list({id(s.module): s.module for s, k, _, _ in layout if k}.values())
    with _capture(fast_modules) as calls:  # type: ignore[arg-type]
        out = _as_matrix(forward())
    b, c = out.shape
    jac = out.new_zeros(b, c, index.numel())
    pairs = [(m, call) for m in fast_modules for call in calls[m]]
    zs = [z for _, (_, z) in pairs]
    fallback = [(s, loc, pos) for s, k, loc, pos in layout if not k]
    unfolded: dict[int, torch.Tensor] = {}
    for j in range(c):
        if zs:
            v = torch.zeros_like(out)
            v[:, j] = 1
            grads = torch.autograd.grad(
                out, zs, grad_outputs=v, retain_graph=True, allow_unused=True
            )
            g_of = {id(z): g for z, g in zip(zs, grads)}
            for slot, kind, loc, pos in layout:
                if not kind:
                    continue
                for a, z in calls[slot.module]:  # type: ignore[index]
                    g = g_of[id(z)]
                    if g is None:
                        continue
                    # The unfolded input does not depend on the output: build it once.
                    if id(z) not in unfolded:
                        unfolded[id(z)] = _input_factor(kind, slot.module, a)  # type: ignore[arg-type]
                    part = _select(
                        slot,
                        unfolded[id(z)],
                        _grad_factor(kind, g),
                        loc.to(a.device),
                        select_numbers,
                    )
                    jac[:, j, pos.to(jac.device)] += part
        for i in range(b if fallback else 0):
            values = [s.value for s, _, _ in fallback]
            grads = torch.autograd.grad(out[i, j], values, retain_graph=True, allow_unused=True)
            for (_, loc, pos), g in zip(fallback, grads):
                if g is not None:
                    jac[i, j, pos.to(jac.device)] = g.reshape(-1)[loc.to(g.device)]
    return (jac, out.detach()) if return_outputs else jac


def output_hessian_factor(
    outputs: torch.Tensor, likelihood: str, noise_scale: float | None = None
) -> torch.Tensor:
    r"""A factor :math:`L` (B, C, C) with :math:`L L^\top = \Lambda`, the Hessian of the negative
    log-likelihood with respect to the outputs.

    Categorical: :math:`\Lambda = \mathrm{diag}(p) - pp^\top`, :math:`L = \mathrm{diag}(\sqrt p)
    - p\sqrt p^\top`; Bernoulli (C = 1): :math:`\sqrt{p(1-p)}`; Gaussian: :math:`I/\sigma`.
    """
    out = _as_matrix(outputs).detach()
    b, c = out.shape
    if likelihood == "categorical":
        p = out.softmax(-1)
        sq = p.sqrt()
        return torch.diag_embed(sq) - p.unsqueeze(-1) * sq.unsqueeze(-2)
    if likelihood == "bernoulli":
        p = out.sigmoid()
        return (p * (1 - p)).sqrt().unsqueeze(-1)
    if likelihood == "gaussian":
        if noise_scale is None:
            raise ValueError("a Gaussian likelihood needs noise_scale (the observation noise σ).")
        eye = torch.eye(c, dtype=out.dtype, device=out.device)
        return (eye / noise_scale).expand(b, c, c)
    raise ValueError(
        f"unknown likelihood {likelihood!r}; expected one of {', '.join(map(repr, LIKELIHOODS))}."
    )


def subnet_ggn(
    jac: torch.Tensor, factor: torch.Tensor, *, dtype=None, out: torch.Tensor | None = None
) -> torch.Tensor:
    r""":math:`\sum_n J_n^\top \Lambda_n J_n` (S, S) from ``jac`` (B, C, S) and ``factor``
    (B, C, K), accumulated in ``dtype`` (default: ``jac``'s, or ``out``'s). With ``out`` the sum
    is added to it in place (no second S × S matrix) and ``out`` is returned."""
    dtype = out.dtype if out is not None else dtype or jac.dtype
    m = torch.einsum("bck,bcs->bks", factor.to(dtype), jac.to(dtype)).reshape(-1, jac.shape[-1])
    if out is not None:
        return out.addmm_(m.T, m)
    return m.T @ m


def jacobian_row_bytes(
    forward_one: Callable[[], torch.Tensor],
    slots: Sequence[ParamSlot],
    index: torch.Tensor,
    *,
    exclude: Sequence[torch.Tensor] = (),
) -> int:
    """Peak bytes :func:`subnet_jacobian` allocates for the rows ``forward_one`` runs (forward
    graph, layer-output gradients, unfolded inputs, rows of J_S; small entry-picking
    temporaries), so callers can size row chunks from a budget. ``exclude``: weights, data."""
    with TensorMemoryTracker(exclude=exclude) as mem:
        subnet_jacobian(forward_one, slots, index, select_numbers=1 << 14)
    return max(mem.peak, 1)


def diagonal_ggn(
    forward: Callable[[], torch.Tensor],
    slots: Sequence[ParamSlot],
    factor_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    batch_chunk: int = 16,
) -> torch.Tensor:
    r"""Diagonal of :math:`\sum_n J_n^\top \Lambda_n J_n` over every packed weight: shape (D,).

    ``factor_fn(outputs)`` returns :math:`L` (B, C, K) with :math:`LL^\top = \Lambda`; the
    diagonal is :math:`\sum_{n,k} (\partial (L_{n,:,k}^\top f_n) / \partial\theta)^2`, squared
    per example. Per-example gradients are formed ``batch_chunk`` examples at a time.
    """
    every = torch.arange(sum(s.value.numel() for s in slots))
    layout = _layout(slots, every)
    fast_modules = list({id(s.module): s.module for s, k, _, _ in layout if k}.values())
    with _capture(fast_modules) as calls:  # type: ignore[arg-type]
        out = _as_matrix(forward())
    factor = factor_fn(out).detach()
    diag = torch.zeros(every.numel(), dtype=out.dtype, device=out.device)
    pairs = [(m, call) for m in fast_modules for call in calls[m]]
    zs = [z for _, (_, z) in pairs]
    fallback = [(s, pos) for s, k, _, pos in layout if not k]
    b = out.shape[0]
    for k in range(factor.shape[-1]):
        v = factor[:, :, k]
        if zs:
            grads = torch.autograd.grad(
                out, zs, grad_outputs=v, retain_graph=True, allow_unused=True
            )
            g_of = {id(z): g for z, g in zip(zs, grads)}
            for slot, kind, _, pos in layout:
                if not kind:
                    continue
                for start in range(0, b, batch_chunk):
                    rows = slice(start, start + batch_chunk)
                    per_example = None
                    # Weight sharing: sum the calls per example before squaring.
                    for a, z in calls[slot.module]:  # type: ignore[index]
                        g = g_of[id(z)]
                        if g is None:
                            continue
                        part = _per_example_full(slot, kind, a[rows], g[rows])
                        per_example = part if per_example is None else per_example + part
                    if per_example is not None:
                        diag[pos.to(diag.device)] += per_example.square().sum(0)
        for i in range(b if fallback else 0):
            values = [s.value for s, _ in fallback]
            grads = torch.autograd.grad(
                (out[i] * v[i]).sum(), values, retain_graph=True, allow_unused=True
            )
            for (_, pos), g in zip(fallback, grads):
                if g is not None:
                    diag[pos.to(diag.device)] += g.reshape(-1).square()
    return diag


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages that operations allocate while active (CPU or GPU).

    A storage is counted once, from the first operation that returns it until the last tensor
    object on it is freed; ``exclude`` lists tensors whose storages (parameters, data) are not
    counted even when an operation returns a view of them. ``peak`` is the largest total seen.
    Tensors created by factory calls outside PyTorch operators (``torch.tensor`` from Python
    data) are missed, which is negligible here.

    Usage::

        with TensorMemoryTracker(exclude=list(net.parameters())) as mem:
            guide.fit((x, y))
        print(mem.peak)
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        super().__init__()
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.current -= self._sizes.pop(ptr)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._excluded:
            return
        if ptr not in self._refs:
            self._refs[ptr] = 0
            self._sizes[ptr] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._refs[ptr] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._track(t)
        return result


def cholesky_jitter(
    matrix: torch.Tensor, *, what: str = "matrix", retries: int = 6
) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric positive-definite ``matrix``, adding jitter
    ``10⁻¹⁰ … 10⁻⁵ × mean(diag)`` to the diagonal when the plain factorisation fails.

    :raises ValueError: naming ``what`` and its smallest eigenvalue when every retry fails.
    """
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) == 0:
        return factor
    scale = float(matrix.diagonal().abs().mean()) or 1.0
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    for k in range(retries):
        jitter = scale * 10.0 ** (k - 10)
        factor, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if int(info) == 0:
            return factor
    smallest = float(torch.linalg.eigvalsh(matrix.double()).min())
    raise ValueError(
        f"{what} is not positive definite (smallest eigenvalue {smallest:.3e}, still failing "
        f"with jitter {jitter:.1e}); increase prior_precision, accumulate in float64 "
        "(accumulate_dtype=torch.float64), or choose a smaller subnetwork."
    )


def linearized_predictive(
    outputs: torch.Tensor,
    jl: torch.Tensor,
    likelihood: str,
    *,
    link: str = "probit",
    num_samples: int = 1000,
    noise: float | None = None,
):
    r"""Predictive of the linearized network with :math:`f_{lin} \sim N(f, (JL)(JL)^\top)`.

    :param outputs: the MAP outputs f, (B, C) or (B,).
    :param jl: :math:`J_S L` (B, C, S), with :math:`LL^\top = \Sigma_S`.
    :returns: class probabilities (B, C) (categorical), P(y = 1) (B,) (Bernoulli), or
        ``(mean, variance)`` including σ² (Gaussian; ``link`` unused).
    """
    f = _as_matrix(outputs)
    if likelihood == "gaussian":
        assert noise is not None
        var = jl.square().sum(-1) + noise**2
        if outputs.dim() == 1:
            return f.squeeze(-1), var.squeeze(-1)
        return f, var
    if link == "mc":
        z = torch.randn(num_samples, jl.shape[-1], dtype=jl.dtype, device=jl.device)
        samples = f + torch.einsum("bcs,ks->kbc", jl, z)
        if likelihood == "bernoulli":
            return samples.sigmoid().mean(0).squeeze(-1)
        return samples.softmax(-1).mean(0)
    if likelihood == "bernoulli":
        var = jl.square().sum(-1)
        return (f / (1 + math.pi / 8 * var).sqrt()).sigmoid().squeeze(-1)
    # Mean variance of the pairwise differences f_i − f_j: 2 tr(P Σ_f P) / (C − 1), P centring.
    centred = jl - jl.mean(1, keepdim=True)
    var = 2.0 / max(f.shape[1] - 1, 1) * centred.square().sum((1, 2))
    return (f / (1 + math.pi / 8 * var).sqrt().unsqueeze(-1)).softmax(-1)


def log_marginal(evals: torch.Tensor, theta: torch.Tensor, prior_s: torch.Tensor) -> torch.Tensor:
    r"""The λ-dependent part of the Laplace log marginal likelihood over the subnetwork,
    :math:`-\tfrac12\lambda_S\lVert\theta_S^*\rVert^2 + \tfrac S2\log\lambda_S
    - \tfrac12\sum_k\log(e_k + \lambda_S)`, with :math:`e` the GGN's eigenvalues."""
    s = theta.numel()
    return (
        -0.5 * prior_s * theta.square().sum()
        + 0.5 * s * torch.log(prior_s)
        - 0.5 * torch.log(evals + prior_s).sum()
    )


def tune_grid(
    score: Callable[[torch.Tensor], torch.Tensor], grid: torch.Tensor, *, refine: bool = True
) -> float:
    """The grid value maximising ``score``, refined on a finer log grid between its neighbours;
    warns when the best value sits at the edge of a grid of two or more values (one value just
    sets λ)."""
    values = torch.stack([score(v) for v in grid])
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, -math.inf))
    i = int(values.argmax())
    if len(grid) > 1 and i in (0, len(grid) - 1):
        meaning = (
            "the data prefer the MAP limit (almost no posterior width)"
            if i == len(grid) - 1
            else "the data prefer the widest posterior the grid allows"
        )
        warnings.warn(
            f"the best prior precision {float(grid[i]):.3g} sits at the edge of the grid "
            f"[{float(grid[0]):.3g}, {float(grid[-1]):.3g}]: {meaning}; widen the grid to "
            "look further.",
            UserWarning,
            stacklevel=3,
        )
    if not refine or len(grid) < 3:
        return float(grid[i])
    lo, hi = grid[max(i - 1, 0)].log(), grid[min(i + 1, len(grid) - 1)].log()
    fine = torch.linspace(float(lo), float(hi), 21, dtype=torch.float64).exp()
    fine_values = torch.stack([score(v) for v in fine])
    return float(fine[int(fine_values.argmax())])
