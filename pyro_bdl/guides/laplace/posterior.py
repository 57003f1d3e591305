r"""The Laplace posterior over a subnetwork S as objects of tensors: the subnetwork Gaussian, the
three structures of its precision and their factorisation (docs/design/laplace.md).

With the GGN :math:`G` over S (computed at the model's noise σ₀ for a Gaussian likelihood;
``c`` = σ₀²/σ² rescales it to another σ) and a prior precision :math:`\lambda_S` per subnetwork
weight, the posterior over S is :math:`N(\theta_S^*, H^{-1})`, :math:`H = cG + \mathrm{diag}\,
\lambda_S`; every other weight stays at its MAP value. A structure :math:`H^{-1} = LL^\top`
(:class:`FullPosterior`: dense, Cholesky; :class:`KronPosterior`: Kronecker factors per layer;
:class:`DiagPosterior`: the exact diagonal) offers

- ``apply_scale(J)``: :math:`JL` for rows ``J`` (..., S), what the linearized predictive needs,
  never an S × S matrix for ``diag`` or ``kron``;
- ``sample(z)``: :math:`Lz` for standard normal ``z`` (..., S);
- ``variances()``: the marginal variances, diag :math:`H^{-1}`;
- ``logdet(lam, c)``: :math:`\log\det(cG + \mathrm{diag}\,\lambda)`, differentiable in
  ``lam`` and ``c`` (the marginal likelihood, :mod:`~pyro_bdl.guides.laplace.evidence`);
- ``quadratic(d)``: :math:`d^\top H d` (the density);
- ``with_prior(lam, c)``: the same curvature under another prior and σ;
- ``converted(fn)`` (``kron``, ``diag``; a guide holds a ``full`` one in its buffers): the
  same posterior with every tensor passed through ``fn`` (the conversion behind
  ``nn.Module.to()``, ``.double()``, ``.cuda()``).

The linearized predictive over these structures is
:mod:`~pyro_bdl.guides.laplace.predictive`.

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
    Ritter, Botev & Barber, "A Scalable Laplace Approximation for Neural Networks", ICLR 2018.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints

from pyro_bdl._caller import user_stacklevel
from pyro_bdl.curvature.jacobian import ParamSlot, fast_kind
from pyro_bdl.curvature.kfac import KronLayer
from pyro_bdl.layout import SiteLayout

__all__ = [
    "MATERIAL_JITTER",
    "DiagPosterior",
    "FullPosterior",
    "KronBlock",
    "KronPosterior",
    "RoundOffWarning",
    "StructuredNormal",
    "SubnetNormal",
    "accumulation_dtype",
    "check_accumulate_dtype",
    "check_blockwise",
    "cholesky_jitter",
    "kron_blocks",
    "posterior_factor",
]


# ---- the subnetwork Gaussian --------------------------------------------------------------


class SubnetNormal(TorchDistribution):
    r"""A Gaussian over the subnetwork coordinates ``index`` of a packed vector, a point mass at
    ``loc`` on all others: :math:`\theta = \mathrm{loc} + \mathrm{scatter}_S(L z)`.
    ``log_prob`` is the Gaussian density of the subnetwork coordinates."""

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: torch.Tensor, index: torch.Tensor, scale_tril: torch.Tensor):
        self.loc, self.index, self.scale_tril = loc, index, scale_tril
        super().__init__(torch.Size(), loc.shape[-1:], validate_args=False)

    def rsample(self, sample_shape=torch.Size()):
        shape = torch.Size(sample_shape)
        z = torch.randn(shape + self.index.shape, dtype=self.loc.dtype, device=self.loc.device)
        out = self.loc.expand(shape + self.loc.shape).clone()
        out[..., self.index] += self._draw(z).to(out.dtype)
        return out

    def _draw(self, z: torch.Tensor) -> torch.Tensor:
        """L z for standard normal ``z`` (..., S)."""
        return z.to(self.scale_tril.dtype) @ self.scale_tril.T

    def log_prob(self, value):
        # Computed in the factor's dtype (float64 by default), returned in the weights' dtype,
        # as a draw is: an ELBO combines it with the model's terms (TraceEnum_ELBO contracts
        # them in one dtype).
        d = (value - self.loc)[..., self.index].to(self.scale_tril.dtype)
        zero = torch.zeros_like(d)
        mvn = dist.MultivariateNormal(zero, scale_tril=self.scale_tril)
        return mvn.log_prob(d).to(self.loc.dtype)


class StructuredNormal(SubnetNormal):
    r"""A Gaussian over the subnetwork coordinates ``index`` of a packed vector, a point mass at
    ``loc`` on all others: :math:`\theta = \mathrm{loc} + \mathrm{scatter}_S(Lz)` with ``L``
    from a posterior structure (:class:`DiagPosterior`, :class:`FullPosterior`,
    :class:`KronPosterior`). ``log_prob`` is the Gaussian density
    of the subnetwork coordinates."""

    def __init__(self, loc: torch.Tensor, index: torch.Tensor, structure):
        self.loc, self.index, self.structure = loc, index, structure
        TorchDistribution.__init__(self, torch.Size(), loc.shape[-1:], validate_args=False)

    def _draw(self, z: torch.Tensor) -> torch.Tensor:
        return self.structure.sample(z)

    def log_prob(self, value):
        d = (value - self.loc)[..., self.index]
        s = self.index.numel()
        logdet = self.structure.logdet(self.structure.lam, self.structure.c)
        out = -0.5 * (self.structure.quadratic(d) - logdet + s * math.log(2 * math.pi))
        return out.to(self.loc.dtype)  # the weights' dtype, as SubnetNormal.log_prob


# ---- factorisation -------------------------------------------------------------------------


class RoundOffWarning(UserWarning):
    """Round-off, not the data or the prior, sets some posterior variances: a Cholesky
    factorisation needed a material jitter, or H_S is too ill-conditioned for its dtype."""


#: A jitter j added to a symmetric matrix with smallest eigenvalue e_min scales the variance
#: along each eigenvector k by e_k / (e_k + j) (of H_S; of Σ_S, by (e_k + j) / e_k), so every
#: marginal and linearized-predictive variance moves by at most j / e_min relative. Below 1% this
#: is under the Monte Carlo error of any predictive estimated from fewer than 10⁴ draws (1/√10⁴);
#: above it the jitter, not the data or the prior, sets some variances, and that is never silent.
MATERIAL_JITTER = 1e-2


def check_accumulate_dtype(dtype: object) -> None:
    """Refuse an ``accumulate_dtype`` that is neither ``None`` nor a floating-point dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"accumulate_dtype must be a float dtype; got {dtype!r}. Pass for example "
            "torch.float64, or None for the default."
        )


def accumulation_dtype(requested: torch.dtype | None, weights: torch.dtype) -> torch.dtype:
    """The dtype H_S and Σ_S are accumulated and factorised in: ``requested``, else float64.

    Σ_S = (GGN + λ_S)⁻¹ is as ill-conditioned as trace(GGN)/λ_S, which a small prior precision
    λ_S = λ·S/D makes far larger than 1/u₃₂ ≈ 10⁷: in float32 the posterior's small eigenvalues
    (the directions only the prior constrains) drown in round-off and the marginal variances come
    out wrong by orders of magnitude, while float64 keeps them to κ·u₆₄. The Jacobians stay in the
    network's dtype ``weights``; only their products are accumulated in float64, which made the
    fit of a 13k-weight MLP 1.5–1.9× slower than float32 on one CPU thread (S = 500–2000). Pass
    ``accumulate_dtype=torch.float32`` to trade that robustness for speed; a material jitter is
    then reported by :class:`RoundOffWarning`.
    """
    return requested if requested is not None else torch.promote_types(weights, torch.float64)


def cholesky_jitter(
    matrix: torch.Tensor, *, what: str = "matrix", retries: int = 6
) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric positive-definite ``matrix``, adding jitter
    ``10⁻¹⁰ … 10⁻⁵ × mean(diag)`` to the diagonal when the plain factorisation fails.

    :raises ValueError: naming ``what`` and its smallest eigenvalue when every retry fails.
    :warns RoundOffWarning: when the jitter that succeeded exceeds :data:`MATERIAL_JITTER` times the
        matrix's smallest eigenvalue (or that eigenvalue is not positive), with the sizes and the
        fix; the spectrum is computed (in float64) only on this path.
    """
    return _cholesky(matrix, what, retries)[0]


def _cholesky(matrix: torch.Tensor, what: str, retries: int = 6) -> tuple[torch.Tensor, float]:
    """:func:`cholesky_jitter`, returning ``(factor, jitter added)``."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) == 0:
        return factor, 0.0
    scale = float(matrix.diagonal().abs().mean()) or 1.0
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    for k in range(retries):
        jitter = scale * 10.0 ** (k - 10)
        factor, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if int(info) == 0:
            del eye
            _warn_if_material(matrix, jitter, what)
            return factor, jitter
    smallest = float(torch.linalg.eigvalsh(matrix.double()).min())
    raise ValueError(
        f"{what} is not positive definite (smallest eigenvalue {smallest:.3e}, still failing "
        f"with jitter {jitter:.1e}); increase prior_precision, accumulate in float64 "
        "(accumulate_dtype=torch.float64), or choose a smaller subnetwork."
    )


def _warn_if_material(matrix: torch.Tensor, jitter: float, what: str) -> None:
    evals = torch.linalg.eigvalsh(matrix.double())
    smallest, largest = float(evals[0]), float(evals[-1])
    del evals
    if smallest > 0 and jitter <= MATERIAL_JITTER * smallest:
        return
    if smallest > 0:
        size = (
            f"{jitter / smallest:.1e} × its smallest eigenvalue {smallest:.3e} (largest "
            f"{largest:.3e}): variances change by up to {100 * jitter / smallest:.3g}%"
        )
    else:
        size = (
            f"while its smallest eigenvalue is {smallest:.3e} ≤ 0 in {matrix.dtype} (largest "
            f"{largest:.3e}): round-off, not the data or the prior, set the variances along it"
        )
    fix = (
        "accumulate in float64 (accumulate_dtype=torch.float64, the default)"
        if matrix.dtype != torch.float64
        else "choose a smaller subnetwork"
    )
    warnings.warn(
        f"{what}: the Cholesky factorisation needed a jitter of {jitter:.1e} on the diagonal, "
        f"{size}. Raise prior_precision, or {fix}.",
        RoundOffWarning,
        stacklevel=user_stacklevel(),
    )


def posterior_factor(ggn: torch.Tensor, prior_s: float | torch.Tensor) -> torch.Tensor:
    """Lower factor of Σ_S = (GGN + diag λ_S)⁻¹, with at most three S × S matrices alive
    besides ``ggn``; ``prior_s`` is one precision for every subnetwork weight or one each.

    :warns RoundOffWarning: when a factorisation needed a material jitter
        (:func:`cholesky_jitter`), or when H_S's condition number κ, bounded below by the
        ratio of its largest to smallest squared Cholesky pivot, makes the relative error of
        Σ_S, about κ·u in a dtype of unit round-off u, exceed :data:`MATERIAL_JITTER`.
    """
    precision = ggn.clone()
    precision.diagonal().add_(prior_s if isinstance(prior_s, float) else prior_s.to(precision))
    chol, jitter = _cholesky(precision, "H_S = GGN + λ_S I")
    del precision
    if not jitter:  # a jitter was judged by the spectrum already
        _warn_if_ill_conditioned(chol)
    cov = torch.cholesky_inverse(chol)
    del chol
    return cholesky_jitter(cov, what="the covariance Σ_S")


def _warn_if_ill_conditioned(chol: torch.Tensor) -> None:
    pivots = chol.diagonal().square()
    kappa = float(pivots.max() / pivots.min())
    eps = torch.finfo(chol.dtype).eps
    if kappa * eps > MATERIAL_JITTER:
        warnings.warn(
            f"H_S = GGN + λ_S I has condition number at least {kappa:.1e} in {chol.dtype}, "
            f"so round-off can change the posterior variances by about {kappa * eps:.1e} "
            "relative. Raise prior_precision, or accumulate in float64 "
            "(accumulate_dtype=torch.float64, the default).",
            RoundOffWarning,
            stacklevel=user_stacklevel(),
        )


# ---- the structures ----------------------------------------------------------------------


#: A tensor conversion, as ``nn.Module._apply`` passes it (``.to()``, ``.double()``, ...).
Convert = Callable[[torch.Tensor], torch.Tensor]


def _convert(fn: Convert, value):
    """``fn(value)`` for a tensor; a Python number (a scalar λ or c) as it is."""
    return fn(value) if isinstance(value, torch.Tensor) else value


class DiagPosterior:
    r"""Diagonal Laplace: :math:`H = c\,\mathrm{diag}(h) + \mathrm{diag}\,\lambda` with ``h`` the
    diagonal of the GGN (exact, from per-example output gradients)."""

    name = "diag"

    def __init__(self, diag: torch.Tensor, lam: torch.Tensor, c: float | torch.Tensor = 1.0):
        self.diag, self.lam, self.c = diag, lam, c
        self.precision = c * diag + lam

    def with_prior(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> DiagPosterior:
        return DiagPosterior(self.diag, lam, c)

    def converted(self, fn: Convert) -> DiagPosterior:
        return DiagPosterior(fn(self.diag), _convert(fn, self.lam), _convert(fn, self.c))

    def apply_scale(self, jac: torch.Tensor) -> torch.Tensor:
        return jac.to(self.precision) * self.precision.rsqrt()

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        return z.to(self.precision) * self.precision.rsqrt()

    def variances(self) -> torch.Tensor:
        return self.precision.reciprocal()

    def logdet(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> torch.Tensor:
        return torch.log(c * self.diag + lam).sum()

    def quadratic(self, d: torch.Tensor) -> torch.Tensor:
        return (d.to(self.precision).square() * self.precision).sum(-1)


class FullPosterior:
    r"""Dense Laplace: :math:`H = cG + \mathrm{diag}\,\lambda`, factorised by
    :func:`posterior_factor` (``scale_tril`` when known)."""

    name = "full"

    def __init__(
        self,
        ggn: torch.Tensor,
        lam: torch.Tensor,
        c: float | torch.Tensor = 1.0,
        scale_tril: torch.Tensor | None = None,
    ):
        self.ggn, self.lam, self.c = ggn, lam, c
        if scale_tril is None:
            lam_d = lam.detach().to(ggn) if isinstance(lam, torch.Tensor) else lam
            scale_tril = posterior_factor(float(c) * ggn, lam_d)
        self.scale_tril = scale_tril

    def with_prior(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> FullPosterior:
        return FullPosterior(self.ggn, lam, c)

    def apply_scale(self, jac: torch.Tensor) -> torch.Tensor:
        return jac.to(self.scale_tril) @ self.scale_tril

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        return z.to(self.scale_tril) @ self.scale_tril.T

    def variances(self) -> torch.Tensor:
        return self.scale_tril.square().sum(-1)

    def logdet(self, lam: torch.Tensor, c: float | torch.Tensor = 1.0) -> torch.Tensor:
        precision = c * self.ggn + torch.diag_embed(lam.expand(self.ggn.shape[0]))
        return 2 * torch.linalg.cholesky(precision).diagonal().log().sum()

    def quadratic(self, d: torch.Tensor) -> torch.Tensor:
        white = torch.linalg.solve_triangular(
            self.scale_tril, d.to(self.scale_tril).unsqueeze(-1), upper=False
        )
        return white.squeeze(-1).square().sum(-1)


@dataclass(frozen=True)
class KronBlock:
    """One layer of a Kronecker-factored subnetwork: the :class:`KronLayer` and the positions in
    the subnetwork (sorted packed indices) of its ``[W, b]`` entries, shape (out, k [+1])."""

    layer: KronLayer
    positions: torch.Tensor


def unsupported_layer_error(site_name: str, what: str) -> ValueError:
    return ValueError(
        f"hessian_structure='kron' needs Linear or Conv2d layers (groups=1, zero padding) whose "
        f"weight and bias are in the subnetwork whole; weight site {site_name!r} {what}. Use "
        "hessian_structure='diag' or 'full', or a subnetwork of such layers (for example "
        "subnetwork='last_layer' or a list of their site names)."
    )


def kron_blocks(layout: SiteLayout, index: torch.Tensor) -> list[KronBlock]:
    """The :class:`KronBlock` of every layer the subnetwork ``index`` (sorted) touches.

    :raises ValueError: naming the first site that KFAC cannot treat: not the weight or bias of
        a ``Linear``/``Conv2d``, constrained, tied, partly selected, or a bias without its weight.
    """
    index = index.cpu()
    by_module: dict[int, dict[str, object]] = {}
    for site in layout:
        taken = int(((index >= site.start) & (index < site.stop)).sum())
        if taken == 0:
            continue
        module = site.module
        if module is None:
            raise unsupported_layer_error(site.name, "is not a parameter of a layer")
        kind = fast_kind(ParamSlot(torch.empty(0), module, site.param_name or ""))
        if kind is None:
            raise unsupported_layer_error(
                site.name, f"belongs to a {type(module).__name__}, which KFAC does not treat"
            )
        if site.spec is not None and site.spec.alias_layers:
            raise unsupported_layer_error(site.name, "is tied into several layers")
        if site.transform is not None:
            raise unsupported_layer_error(site.name, "is constrained (not a plain weight)")
        if taken != site.numel:
            raise unsupported_layer_error(
                site.name, f"is only partly in the subnetwork ({taken} of {site.numel} entries)"
            )
        by_module.setdefault(id(module), {"module": module, "kind": kind})[str(site.param_name)] = (
            site
        )
    blocks = []
    for entry in by_module.values():
        weight, bias = entry.get("weight"), entry.get("bias")
        if weight is None:
            assert bias is not None
            raise unsupported_layer_error(bias.name, "is a bias whose layer weight is not included")  # type: ignore[attr-defined]
        out = weight.shape[0]  # type: ignore[attr-defined]
        packed = layout.indices(weight).reshape(out, -1)  # type: ignore[arg-type]
        if bias is not None:
            packed = torch.cat([packed, layout.indices(bias).reshape(out, 1)], 1)  # type: ignore[arg-type]
        layer = KronLayer(entry["module"], entry["kind"], bias is not None)  # type: ignore[arg-type]
        blocks.append(KronBlock(layer, torch.searchsorted(index, packed)))
    return blocks


def consecutive(positions: torch.Tensor) -> slice | None:
    """The slice that ``positions`` cover, read row-major, when they are consecutive integers;
    ``None`` otherwise."""
    flat = positions.reshape(-1)
    start = int(flat[0])
    if flat.numel() > 1 and not bool((flat.diff() == 1).all()):
        return None
    return slice(start, start + flat.numel())


class KronPosterior:
    r"""KFAC Laplace over :class:`KronBlock` s: per block the eigenbases and eigenvalues of
    ``A`` and ``G`` (``G`` already divided by N), the prior ``lam`` (one value per subnetwork
    weight, constant within a block) and the GGN scale ``c``."""

    name = "kron"

    def __init__(self, blocks, eigen, count: int, lam: torch.Tensor, c=1.0):
        self.blocks, self.eigen, self.count, self.lam, self.c = blocks, eigen, count, lam, c
        self.precisions = [self._precision(i, lam, c) for i in range(len(blocks))]

    @classmethod
    def from_factors(cls, blocks, a_sums, g_sums, rows: float, lam: torch.Tensor, count: int):
        """Eigendecompose :math:`A` and :math:`G = \\sum gg^\\top / N` (``rows`` = N)."""
        eigen = []
        for a, g in zip(a_sums, g_sums):
            ea, qa = torch.linalg.eigh(a)
            eg, qg = torch.linalg.eigh(g / rows)
            eigen.append((ea.clamp_min(0), qa, eg.clamp_min(0), qg))
        return cls(blocks, eigen, count, lam, 1.0)

    def _precision(self, i: int, lam: torch.Tensor, c) -> torch.Tensor:
        ea, _, eg, _ = self.eigen[i]
        return c * torch.outer(eg, ea) + lam.expand(self.count)[self.blocks[i].positions]

    def with_prior(self, lam: torch.Tensor, c=1.0) -> KronPosterior:
        return KronPosterior(self.blocks, self.eigen, self.count, lam, c)

    def converted(self, fn: Convert) -> KronPosterior:
        blocks = [KronBlock(b.layer, fn(b.positions)) for b in self.blocks]
        eigen = [tuple(fn(t) for t in parts) for parts in self.eigen]
        lam, c = _convert(fn, self.lam), _convert(fn, self.c)
        return KronPosterior(blocks, eigen, self.count, lam, c)

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(A, G)`` of every block, rebuilt from the eigendecompositions."""
        return [(qa * ea @ qa.T, qg * eg @ qg.T) for ea, qa, eg, qg in self.eigen]

    def apply_scale(self, jac: torch.Tensor) -> torch.Tensor:
        dtype = self.eigen[0][1].dtype
        out = jac.new_zeros(jac.shape, dtype=dtype)
        for block, (_, qa, _, qg), prec in zip(self.blocks, self.eigen, self.precisions):
            span = consecutive(block.positions)
            if span is None:
                j = jac[..., block.positions].to(dtype)
                out[..., block.positions] = (qg.T @ j @ qa) * prec.rsqrt()
                continue
            # A whole layer's entries side by side (the usual case): views, not a gather and a
            # scatter of every Jacobian row.
            # (Qgᵀ J Qa)ᵀ = (J Qa)ᵀ Qg: both products fold every leading dimension into the
            # rows of one matrix product, not one small product per Jacobian row.
            j = jac[..., span].unflatten(-1, block.positions.shape).to(dtype)
            scaled = ((j @ qa).transpose(-1, -2) @ qg).transpose(-1, -2) * prec.rsqrt()
            out[..., span] = scaled.flatten(-2)
        return out

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        dtype = self.eigen[0][1].dtype
        out = z.new_zeros(z.shape, dtype=dtype)
        for block, (_, qa, _, qg), prec in zip(self.blocks, self.eigen, self.precisions):
            w = z[..., block.positions].to(dtype) * prec.rsqrt()
            out[..., block.positions] = qg @ w @ qa.T
        return out

    def variances(self) -> torch.Tensor:
        dtype = self.eigen[0][1].dtype
        out = torch.zeros(self.count, dtype=dtype, device=self.eigen[0][1].device)
        for block, (_, qa, _, qg), prec in zip(self.blocks, self.eigen, self.precisions):
            out[block.positions] = qg.square() @ prec.reciprocal() @ qa.square().T
        return out

    def logdet(self, lam: torch.Tensor, c=1.0) -> torch.Tensor:
        return sum(self._precision(i, lam, c).log().sum() for i in range(len(self.blocks)))  # type: ignore[return-value]

    def quadratic(self, d: torch.Tensor) -> torch.Tensor:
        dtype = self.eigen[0][1].dtype
        total = d.new_zeros(d.shape[:-1], dtype=dtype)
        for block, (_, qa, _, qg), prec in zip(self.blocks, self.eigen, self.precisions):
            u = qg.T @ d[..., block.positions].to(dtype) @ qa
            total = total + (u.square() * prec).sum((-2, -1))
        return total


def check_blockwise(prior: torch.Tensor, blocks) -> None:
    """Refuse prior precisions that vary within a Kronecker block (KFAC adds one λ per layer
    exactly, not a diagonal)."""
    if prior.dim() == 0:
        return
    for block in blocks:
        values = prior[block.positions]
        if not torch.all(values == values.reshape(-1)[0]):
            raise ValueError(
                f"hessian_structure='kron' adds one prior precision per layer; the declared "
                f"prior of {type(block.layer.module).__name__} varies within it (from "
                f"{float(values.min()):.3g} to {float(values.max()):.3g}). Pass "
                "prior_precision=λ, or use hessian_structure='full' or 'diag'."
            )
