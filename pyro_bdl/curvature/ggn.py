r"""The generalized Gauss-Newton matrix of a network: over a subnetwork from its Jacobian, and its
diagonal over every weight.

With :math:`\Lambda_n` the Hessian of the negative log-likelihood with respect to the outputs of
example :math:`n` (its expectation, the Fisher, for a heteroscedastic Gaussian, whose Hessian is
indefinite: :func:`heteroscedastic_factor`) and :math:`L_n L_n^\top = \Lambda_n`
(:func:`output_hessian_factor`), the GGN is :math:`\sum_n J_n^\top \Lambda_n J_n =
\sum_n (L_n^\top J_n)^\top (L_n^\top J_n)`. :func:`subnet_ggn` accumulates it over a
subnetwork from :math:`J_S` (:func:`~pyro_bdl.curvature.jacobian.subnet_jacobian`);
:func:`diagonal_ggn` squares per-example gradients of :math:`L^\top f`, which diagonal Laplace
and the largest-variance subnetwork rule need (docs/design/laplace.md).

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
    Immer et al., "Improving predictions of Bayesian neural nets via local linearization",
    AISTATS 2021.
    Immer, Palumbo, Marx & Vogt, "Effective Bayesian Heteroscedastic Regression with Deep
    Neural Networks", NeurIPS 2023.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pyro_bdl._grad_mode import differentiates
from pyro_bdl.curvature.jacobian import (
    ParamSlot,
    as_matrix,
    batch_gradient,
    capture,
    exact,
    per_example_full,
    placements,
    widened,
)

__all__ = [
    "LIKELIHOODS",
    "Split",
    "diagonal_ggn",
    "heteroscedastic_factor",
    "linear_layer_ggn",
    "mean_and_log_variance",
    "output_hessian_factor",
    "residual_coefficients",
    "subnet_ggn",
]

#: ``"heteroscedastic"``: a Gaussian whose mean and variance both come from the network's
#: outputs through a :data:`Split` (:func:`heteroscedastic_factor`).
LIKELIHOODS = ("categorical", "bernoulli", "gaussian", "heteroscedastic")

#: ``outputs (B, K) -> (mean, log σ²)``, each with one entry per example: how a heteroscedastic
#: Gaussian reads its parameters from the network's outputs, row by row
#: (:func:`pyro_bdl.models.mean_log_variance`, or a model's own ``split``).
Split = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def mean_and_log_variance(outputs: torch.Tensor, split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, log σ²)``, each (B,), of a heteroscedastic Gaussian at the outputs (B, K)."""
    mean, log_var = split(outputs)
    rows = outputs.shape[0]
    if mean.numel() != rows or log_var.numel() != rows:
        raise ValueError(
            f"the split of a heteroscedastic Gaussian must give one mean and one log-variance "
            f"per example ({rows} each); got shapes {tuple(mean.shape)} and "
            f"{tuple(log_var.shape)}. Pass split=lambda out: (mean, log_var), each (B,)."
        )
    return mean.reshape(rows), log_var.reshape(rows)


def heteroscedastic_factor(outputs: torch.Tensor, split: Split) -> torch.Tensor:
    r"""A factor :math:`L` (B, K, 2) of the Fisher of a heteroscedastic Gaussian with respect to
    the network's outputs :math:`f` (B, K): :math:`LL^\top = D^\top \mathrm{diag}(1/\sigma^2,
    \tfrac12) D`, :math:`D = \partial(\mu, v)/\partial f` the Jacobian (2 × K per example) of
    ``split``, :math:`v = \log\sigma^2`.

    The negative log-likelihood :math:`\tfrac12 v + (y-\mu)^2 / 2e^{v}` has, in :math:`(\mu,
    v)`, the Hessian :math:`\begin{pmatrix}e^{-v} & (y-\mu)e^{-v}\\ (y-\mu)e^{-v} &
    (y-\mu)^2 e^{-v}/2\end{pmatrix}`, indefinite at every :math:`y \ne \mu` (determinant
    :math:`-(y-\mu)^2 e^{-2v}/2 < 0`), and under a nonlinear ``split`` a second term
    weighted by the gradient, :math:`(1 - (y-\mu)^2/\sigma^2)/2`, which has either sign. Its
    expectation under the model's own :math:`y \sim N(\mu, \sigma^2)` is the Fisher
    :math:`\mathrm{diag}(1/\sigma^2, \tfrac12)`, positive definite and free of y (the
    gradient term has mean zero), and the Fisher is the GGN of the Gaussian in its natural
    parameters (Immer et al. 2023): with it the GGN :math:`\sum_n J_n^\top L_n L_n^\top J_n` is
    positive semi-definite, as every structure's factorisation needs. With
    :math:`\sigma^2 = \mathrm{softplus}(s) + \epsilon` of the output s, :math:`L =
    \mathrm{diag}(1/\sigma, \sigma^{2\prime}/(\sqrt2\,\sigma^2))`; with
    :math:`\sigma^2 = e^s`, :math:`\mathrm{diag}(1/\sigma, 1/\sqrt2)`.

    :math:`D` comes from two backward passes through ``split`` on the (B, K) outputs, which
    assumes, as every split does, that row n of the outputs gives example n's parameters alone.
    """
    with torch.enable_grad():
        out = widened(as_matrix(outputs).detach()).requires_grad_(True)
        mean, log_var = mean_and_log_variance(out, split)
        rows = []
        for part in (mean, log_var):
            grad = torch.autograd.grad(part.sum(), out, retain_graph=True, allow_unused=True)[0]
            rows.append(torch.zeros_like(out) if grad is None else grad)
    inv_sigma = (-0.5 * log_var.detach()).exp()
    return torch.stack([rows[0] * inv_sigma[:, None], rows[1] * math.sqrt(0.5)], -1)


def output_hessian_factor(
    outputs: torch.Tensor,
    likelihood: str,
    noise_scale: float | None = None,
    *,
    split: Split | None = None,
) -> torch.Tensor:
    r"""A factor :math:`L` (B, C, K) with :math:`L L^\top = \Lambda`, the Hessian of the negative
    log-likelihood with respect to the outputs.

    Categorical: :math:`\Lambda = \mathrm{diag}(p) - pp^\top`, :math:`L = \mathrm{diag}(\sqrt p)
    - p\sqrt p^\top`; with two classes :math:`\Lambda` has rank one and :math:`L` is its one
    column :math:`\sqrt{p_1 p_2}\,(1, -1)^\top` (B, 2, 1), so that every consumer runs one
    backward pass per example instead of two; Bernoulli (C independent logits, C = 1 for a
    binary classifier): :math:`L = \mathrm{diag}(\sqrt{p(1-p)})`; Gaussian: :math:`I/\sigma`;
    heteroscedastic Gaussian (mean and variance from the outputs through ``split``): the
    factor of its Fisher, :func:`heteroscedastic_factor` (B, K, 2).
    """
    if likelihood == "heteroscedastic":
        if split is None:
            raise ValueError(
                "a heteroscedastic Gaussian likelihood needs split, the map outputs -> (mean, "
                "log σ²); got None. Pass split=pyro_bdl.models.mean_log_variance or the model's "
                "own split."
            )
        return heteroscedastic_factor(outputs, split)
    out = widened(as_matrix(outputs).detach())
    b, c = out.shape
    if likelihood == "categorical" and c == 2:
        # p₁p₂ = σ(d)σ(-d) with d = f₁ - f₂: no cancellation however confident the network.
        d = out[:, 0] - out[:, 1]
        root = (d.sigmoid() * (-d).sigmoid()).sqrt()
        return torch.stack([root, -root], -1).unsqueeze(-1)
    if likelihood == "categorical":
        p = out.softmax(-1)
        sq = p.sqrt()
        return torch.diag_embed(sq) - p.unsqueeze(-1) * sq.unsqueeze(-2)
    if likelihood == "bernoulli":
        p = out.sigmoid()
        return torch.diag_embed((p * (1 - p)).sqrt())
    if likelihood == "gaussian":
        if noise_scale is None:
            raise ValueError(
                "a Gaussian likelihood needs noise_scale (the observation noise σ); got None. "
                "Pass noise_scale=σ, the model's fixed observation noise."
            )
        eye = torch.eye(c, dtype=out.dtype, device=out.device)
        return (eye / noise_scale).expand(b, c, c)
    raise ValueError(
        f"unknown likelihood {likelihood!r}; expected one of {', '.join(map(repr, LIKELIHOODS))}."
    )


def residual_coefficients(factor: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
    r"""Coefficients :math:`c_n` (B, K) with :math:`L_n c_n = r_n` for every example, or ``None``
    when some residual is not in the span of its factor's columns.

    Then the gradient :math:`\sum_n J_n^\top r_n` is :math:`\sum_n \sum_k c_{nk}\,
    J_n^\top L_{n,:,k}`: each example's share of the backward passes of the columns of
    :math:`L`, weighted, so that the gradient costs no backward pass of its own (examples are
    independent, so a layer output's gradient splits by example). The categorical residual
    :math:`p - y` sums to zero like every column of its :math:`\Lambda`, the span of :math:`L`;
    a Gaussian's or a Bernoulli's :math:`L` is invertible unless a probability rounds to 0 or 1,
    when ``None`` sends the caller to a backward pass of the residual itself.

    :param factor: :math:`L` (B, C, K).
    :param residual: :math:`r` (B, C).
    """
    # L and r come from probabilities rounded in their own dtype: a part of r outside the span
    # of L of the size of that round-off (r = p - y loses eps·1 absolutely) is noise, and so is a
    # singular value of L that small (the rounded null direction of a categorical Λ).
    noise = 64 * torch.finfo(torch.promote_types(factor.dtype, residual.dtype)).eps
    lhs, rhs = factor.double(), residual.double().unsqueeze(-1)
    coef = torch.linalg.pinv(lhs, atol=noise, rtol=0.0) @ rhs
    error = (lhs @ coef - rhs).norm(dim=(1, 2))
    if bool((error > noise * (1 + rhs.norm(dim=(1, 2)))).any()):
        return None
    return coef.squeeze(-1)


def subnet_ggn(
    jac: torch.Tensor,
    factor: torch.Tensor,
    *,
    dtype=None,
    out: torch.Tensor | None = None,
    block: int = 512,
) -> torch.Tensor:
    r""":math:`\sum_n J_n^\top \Lambda_n J_n` (S, S) from ``jac`` (B, C, S) and ``factor``
    (B, C, K), accumulated in ``dtype`` (default: ``jac``'s, or ``out``'s). With ``out`` the sum
    is added to it in place (no second S × S matrix) and ``out`` is returned. Columns are taken
    ``block`` at a time, so that each product stays one large matrix multiplication."""
    dtype = out.dtype if out is not None else dtype or widened(jac).dtype
    with exact(jac.device):
        return _subnet_ggn(jac, factor, dtype, out, block)


def _subnet_ggn(jac, factor, dtype, out, block: int) -> torch.Tensor:
    m = torch.einsum("bck,bcs->bks", factor.to(dtype), jac.to(dtype)).reshape(-1, jac.shape[-1])
    if out is None:
        out = m.new_zeros(m.shape[1], m.shape[1])
    # The sum is symmetric: only the blocks on and above the diagonal are products, the others
    # their transposes, which saves up to half the S × BK × S multiply-adds.
    count = m.shape[1]
    for i in range(0, count, block):
        rows = slice(i, i + block)
        upper = m[:, rows].T @ m[:, i:]
        out[rows, i:] += upper
        out[i + block :, rows] += upper[:, block:].T
    return out


def linear_layer_ggn(
    forward: Callable[[], torch.Tensor],
    module: torch.nn.Module,
    bias: bool,
    positions: torch.Tensor,
    factor_fn: Callable[[torch.Tensor], torch.Tensor],
    out: torch.Tensor,
    *,
    residual_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grad: torch.Tensor | None = None,
) -> torch.Tensor | None:
    r"""Add the exact GGN of one ``Linear`` layer (weights ``[W, b]``, O × k) to ``out`` (S × S,
    in place, in its dtype) and return the detached outputs (B, C); ``None`` (nothing added) when
    the layer is not called exactly once on inputs of shape (B, k).

    The layer's Jacobian is :math:`J_n = G_n (I_O \otimes \tilde a_n^\top)` with
    :math:`\tilde a_n = [a_n; 1]` its input and :math:`G_n = \partial f_n / \partial z_n`,
    so with :math:`\tilde\Lambda_n = G_n^\top \Lambda_n G_n = \sum_k g_{nk} g_{nk}^\top`,
    :math:`g_{nk} = G_n^\top L_{n,:,k}`,

    .. math:: H = \sum_n \tilde\Lambda_n \otimes \tilde a_n \tilde a_n^\top,

    K batched backward passes to the layer's output and O products of k × B × S instead of one
    of S × BK × S.
    ``positions`` (O, k [+1]) are the subnetwork positions of the entries of ``[W, b]``.
    With ``residual_fn`` (outputs (B, C) -> :math:`r` (B, C)) the gradient
    :math:`\sum_n J_n^\top r_n` is added to ``grad`` (S,) from one more backward pass to the
    layer's output, which the forward pass already built.
    """
    with capture([module]) as calls:
        f = as_matrix(forward())
    if len(calls[module]) != 1 or calls[module][0][0].dim() != 2:
        return None
    a, z = calls[module][0]
    factor = factor_fn(f).detach()
    g = torch.stack(
        [
            torch.autograd.grad(f, z, grad_outputs=factor[:, :, k].to(f), retain_graph=True)[0]
            for k in range(factor.shape[-1])
        ],
        -1,
    )
    with exact(out.device):
        _linear_products(g, a, z, f, bias, positions, out, residual_fn, grad)
    return widened(f.detach())


def _linear_products(g, a, z, f, bias, positions, out, residual_fn, grad) -> None:
    """The sums of :func:`linear_layer_ggn` (and its gradient) from the layer's output
    gradients ``g`` (B, O, K), input ``a`` and output ``z``, in ``out``'s dtype."""
    dtype = out.dtype
    g = g.to(dtype)
    phi = a.to(dtype)
    if bias:
        phi = torch.cat([phi, phi.new_ones(phi.shape[0], 1)], 1)
    flat = positions.reshape(-1).to(out.device)
    if residual_fn is not None and grad is not None:
        r = residual_fn(f.detach())
        gz = torch.autograd.grad(f, z, grad_outputs=r.to(f), retain_graph=True)[0]
        grad.index_add_(0, flat, (gz.to(grad.dtype).T @ phi.to(grad.dtype)).reshape(-1))
    lam = g @ g.transpose(1, 2)  # (B, O, O)
    b, o, k = phi.shape[0], lam.shape[1], phi.shape[1]
    block = out.new_empty(o * k, o * k)
    for i in range(o):
        scaled = (lam[:, i, :, None] * phi[:, None, :]).reshape(b, o * k)
        block[i * k : (i + 1) * k] = phi.T @ scaled
    out.index_put_((flat[:, None], flat[None, :]), block, accumulate=True)


@differentiates
def diagonal_ggn(
    forward: Callable[[], torch.Tensor],
    slots: Sequence[ParamSlot],
    factor_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    batch_chunk: int = 16,
    residual_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grad: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Diagonal of :math:`\sum_n J_n^\top \Lambda_n J_n` over every packed weight: shape (D,).

    ``factor_fn(outputs)`` returns :math:`L` (B, C, K) with :math:`LL^\top = \Lambda`; the
    diagonal is :math:`\sum_{n,k} (\partial (L_{n,:,k}^\top f_n) / \partial\theta)^2`, squared
    per example. Per-example gradients are formed ``batch_chunk`` examples at a time.
    With ``residual_fn`` (outputs (B, C) -> :math:`r` (B, C)) the gradient
    :math:`\sum_n J_n^\top r_n` is added to ``grad`` (D,), taken as one more column of the
    same backward passes. ``forward`` runs with autograd on, also when called under
    ``torch.no_grad()`` or ``torch.inference_mode()``.
    """
    every = torch.arange(sum(s.value.numel() for s in slots))
    placed = placements(slots, every)
    fast_modules = list({id(s.module): s.module for s, k, _, _ in placed if k}.values())
    with capture(fast_modules) as calls:  # type: ignore[arg-type]
        out = as_matrix(forward())
    factor = factor_fn(out).detach()
    diag = torch.zeros(every.numel(), dtype=widened(out).dtype, device=out.device)
    pairs = [(m, call) for m in fast_modules for call in calls[m]]
    zs = [z for _, (_, z) in pairs]
    fallback = [(s, pos) for s, k, _, pos in placed if not k]
    b = out.shape[0]
    columns = [factor[:, :, k] for k in range(factor.shape[-1])]
    coef = None
    if residual_fn is not None and grad is not None:
        r = residual_fn(out.detach())
        # The gradient is a weighted sum of the columns' passes when r lies in their span (the
        # categorical residual always does): then it costs no backward pass of its own.
        coef = residual_coefficients(factor, r)
        if coef is None:
            columns.append(r.to(out))
    for k, v in enumerate(columns):
        # A column past L's is the residual: summed, not squared, per example.
        square = k < factor.shape[-1]
        # Weights of this column's per-example gradients in the gradient, if folded in.
        weights = coef[:, k].to(diag.dtype) if square and coef is not None else None
        if zs:
            grads = torch.autograd.grad(
                out, zs, grad_outputs=v.to(out), retain_graph=True, allow_unused=True
            )
            g_of = {id(z): g for z, g in zip(zs, grads)}
            for slot, kind, _, pos in placed:
                if not kind:
                    continue
                if not square or weights is not None:
                    assert grad is not None
                    # A gradient: summed over the batch, no per-example tensor.
                    for a, z in calls[slot.module]:  # type: ignore[index]
                        g = g_of[id(z)]
                        if g is not None:
                            if weights is not None:
                                g = widened(g) * weights.to(g.device).reshape(
                                    -1, *[1] * (g.dim() - 1)
                                ).to(widened(g).dtype)
                            part = batch_gradient(slot, kind, a, g).to(grad.dtype)
                            grad[pos.to(grad.device)] += part
                    if not square:
                        continue
                for start in range(0, b, batch_chunk):
                    rows = slice(start, start + batch_chunk)
                    per_example = None
                    # Weight sharing: sum the calls per example before squaring.
                    for a, z in calls[slot.module]:  # type: ignore[index]
                        g = g_of[id(z)]
                        if g is None:
                            continue
                        part = per_example_full(slot, kind, a[rows], g[rows])
                        per_example = part if per_example is None else per_example + part
                    if per_example is not None:
                        diag[pos.to(diag.device)] += per_example.square().sum(0)
        values = [s.value for s, _ in fallback]
        for i in range(b if fallback and square else 0):
            grads = torch.autograd.grad(
                (out[i] * v[i]).sum(), values, retain_graph=True, allow_unused=True
            )
            for (_, pos), g in zip(fallback, grads):
                if g is None:
                    continue
                g = widened(g.reshape(-1))
                diag[pos.to(diag.device)] += g.square()
                if weights is not None and grad is not None:
                    grad[pos.to(grad.device)] += (weights[i] * g).to(grad.dtype)
        if fallback and not square:
            assert grad is not None
            grads = torch.autograd.grad(
                (out * v).sum(), values, retain_graph=True, allow_unused=True
            )
            for (_, pos), g in zip(fallback, grads):
                if g is not None:
                    grad[pos.to(grad.device)] += g.reshape(-1).to(grad.dtype)
    return diag
