r"""Kronecker-factored (KFAC) Laplace over whole ``Linear``/``Conv2d`` layers of a subnetwork
(docs/design/laplace.md).

Each layer's GGN block is :math:`G \otimes A` (:mod:`pyro_bdl.curvature.kfac`), over the layer's
weights and folded bias laid out as the rows of :math:`[W, b]`. With the eigendecompositions
:math:`A = Q_A\,\mathrm{diag}(a)\,Q_A^\top` and :math:`G = Q_G\,\mathrm{diag}(g)\,Q_G^\top`, a
prior precision λ on every weight of the layer is added exactly:

.. math:: cG\otimes A + \lambda I = (Q_G\otimes Q_A)\,\mathrm{diag}(c\,g_i a_j + \lambda)\,
          (Q_G\otimes Q_A)^\top,

so the log-determinant is :math:`\sum_{ij}\log(c\,g_i a_j + \lambda)` and a Jacobian row
:math:`J` of the layer (out × k) maps to :math:`JL` as
:math:`(Q_G^\top J Q_A) / \sqrt{c\,g a^\top + \lambda}`, never forming the D × D matrix. Layers
are independent (block-diagonal), as in Ritter et al. 2018 and laplace-torch.

References:
    Ritter, Botev & Barber, "A Scalable Laplace Approximation for Neural Networks", ICLR 2018.
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature", ICML 2015.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyro_bdl.curvature.jacobian import ParamSlot, fast_kind
from pyro_bdl.curvature.kfac import KronLayer
from pyro_bdl.layout import SiteLayout

__all__ = [
    "KronBlock",
    "KronPosterior",
    "check_blockwise",
    "kron_blocks",
    "unsupported_layer_error",
]


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

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(A, G)`` of every block, rebuilt from the eigendecompositions."""
        return [(qa * ea @ qa.T, qg * eg @ qg.T) for ea, qa, eg, qg in self.eigen]

    def apply_scale(self, jac: torch.Tensor) -> torch.Tensor:
        dtype = self.eigen[0][1].dtype
        out = jac.new_zeros(jac.shape, dtype=dtype)
        for block, (_, qa, _, qg), prec in zip(self.blocks, self.eigen, self.precisions):
            j = jac[..., block.positions].to(dtype)
            out[..., block.positions] = (qg.T @ j @ qa) * prec.rsqrt()
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
