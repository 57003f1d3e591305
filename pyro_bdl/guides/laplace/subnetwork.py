r"""Choosing the subnetwork of :class:`~pyro_bdl.guides.AutoSubnetLaplace`.

A rule maps the guide's :class:`~pyro_bdl.layout.SiteLayout` (the packed weight vector) to
sorted packed indices. Rules: ``"all"``, ``"last_layer"`` (every site whose
:attr:`~pyro_bdl.layout.Site.module` is the last site's layer), ``"random"``,
``"largest_variance"`` (the Wasserstein-optimal rule under a diagonal approximation: keep the S
weights with the largest marginal posterior variance, estimated by SWAG-diag or by diagonal
Laplace), a list of site names or globs, or explicit indices. Sizes are a count (``int``) or a
fraction of all weights (``float`` in (0, 1]).

Everything that can be checked without the model is checked when the guide is built; indices
and names are checked against the model before ``fit`` changes anything.

References:
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021 (section 4).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pyro_bdl.layout import SiteLayout

__all__ = ["RULES", "SubnetworkRule", "parse_subnetwork"]

#: The string rules; a list of names/globs or of indices is also accepted.
RULES = ("all", "last_layer", "random", "largest_variance")
VARIANCE_SOURCES = ("diagonal_laplace",)


@dataclass(frozen=True)
class SubnetworkRule:
    """A parsed ``subnetwork=`` argument (see :func:`parse_subnetwork`)."""

    kind: str  # one of RULES, "names" or "indices"
    size: int | float | None = None
    names: tuple[str, ...] = ()
    indices: torch.Tensor | None = None
    variances: Any = "diagonal_laplace"
    seed: int = 0

    @property
    def needs_diagonal_laplace(self) -> bool:
        return self.kind == "largest_variance" and isinstance(self.variances, str)

    def count(self, total: int) -> int:
        """S for a network of ``total`` weights."""
        if isinstance(self.size, float):
            return max(1, round(self.size * total))
        assert self.size is not None
        if self.size > total:
            raise ValueError(
                f"size must be at most the number of weights ({total}); got {self.size}. "
                f"Pass a smaller count, a fraction such as 0.1, or subnetwork='all'."
            )
        return self.size

    def size_of(self, layout: SiteLayout) -> int:
        """S, known before any variances are: checks the rule against the layout."""
        if self.kind in ("random", "largest_variance"):
            return self.count(layout.size)
        return int(self.select(layout).numel())

    def select(self, layout: SiteLayout, variances: torch.Tensor | None = None):
        """Sorted packed indices (a ``LongTensor``) of the subnetwork."""
        total = layout.size
        if self.kind == "all":
            return torch.arange(total)
        if self.kind == "last_layer":
            # The layer of the last site, or that site alone when it is not a lifted weight.
            last = layout[-1].module
            chosen = [s for s in layout if s.module is last] if last is not None else [layout[-1]]
            return torch.cat([layout.indices(s) for s in chosen])
        if self.kind == "names":
            parts = []
            for pattern in self.names:
                hits = [s for s in layout if fnmatch.fnmatchcase(s.name, pattern)]
                if not hits:
                    raise ValueError(
                        f"subnetwork name {pattern!r} matches no weight site; valid names: "
                        f"{', '.join(layout.names)}."
                    )
                parts += [layout.indices(s) for s in hits]
            return torch.cat(parts).unique()
        if self.kind == "indices":
            assert self.indices is not None
            if int(self.indices.max()) >= total:
                raise ValueError(
                    f"subnetwork indices must be < the number of weights ({total}); got max "
                    f"{int(self.indices.max())}. Index into the packed vector of all weight sites."
                )
            return self.indices.sort().values
        count = self.count(total)
        if self.kind == "random":
            g = torch.Generator().manual_seed(self.seed)
            return torch.randperm(total, generator=g)[:count].sort().values
        assert self.kind == "largest_variance" and variances is not None
        return variances.detach().cpu().topk(count).indices.sort().values

    def external_variances(self, layout: SiteLayout) -> torch.Tensor | None:
        """The packed marginal variances given as a mapping or by an object such as
        :class:`~pyro_bdl.guides.AutoSWAG` (``marginal_variances()``); ``None`` otherwise."""
        source = self.variances
        if isinstance(source, str):
            return None
        if hasattr(source, "marginal_variances"):
            source = source.marginal_variances()
        if not isinstance(source, Mapping):
            raise TypeError(
                "variances must be 'diagonal_laplace', a mapping site name -> tensor, or an "
                f"object with marginal_variances() (AutoSWAG); got {type(source).__name__}."
            )
        parts = []
        for s in layout:
            if s.name not in source:
                raise ValueError(
                    f"variances lacks site {s.name!r}; it has {', '.join(map(repr, source))}. "
                    "Pass the variances of every weight site of this model."
                )
            v = torch.as_tensor(source[s.name]).detach()
            if v.numel() != s.numel:
                raise ValueError(
                    f"variances[{s.name!r}] must have {s.numel} entries (shape "
                    f"{tuple(s.shape)}); got shape {tuple(v.shape)}. Pass one variance per weight "
                    "of the site."
                )
            parts.append(v.reshape(-1).to(torch.float64).cpu())
        flat = torch.cat(parts)
        if not torch.isfinite(flat).all() or (flat < 0).any():
            bad = int((~torch.isfinite(flat) | (flat < 0)).sum())
            raise ValueError(
                f"variances must be finite and >= 0; got {bad} entries that are negative, NaN or "
                "inf. Check the SWAG moments (collect more, or train with a lower learning rate)."
            )
        return flat


def _parse_size(size: object) -> int | float:
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise TypeError(
            f"size must be an int count or a float fraction in (0, 1]; got "
            f"{type(size).__name__} {size!r}. Pass for example size=1000 or size=0.1."
        )
    if isinstance(size, float) and not 0.0 < size <= 1.0:
        raise ValueError(
            f"size as a fraction must lie in (0, 1]; got {size!r}. Pass for example 0.1, or an int "
            "count."
        )
    if isinstance(size, int) and size < 1:
        raise ValueError(f"size must be >= 1; got {size}. Use at least one weight.")
    return size


def _parse_indices(value: Any) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1:
        raise ValueError(
            f"subnetwork indices must be a 1-d list or tensor; got shape {tuple(t.shape)}. Pass "
            "the packed weight indices as a flat list or a 1-d LongTensor."
        )
    if t.numel() == 0:
        raise ValueError("subnetwork indices are empty; select at least one weight.")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(
            f"subnetwork indices must be integers; got dtype {t.dtype}. Use a list of ints or "
            "a LongTensor of packed weight indices (for a boolean mask over the packed weights, "
            "mask.nonzero().flatten())."
        )
    t = t.to(torch.long).cpu()
    if (t < 0).any():
        raise ValueError(
            f"subnetwork indices must be >= 0; got {int(t.min())} (negative indices are not "
            "accepted: index the packed vector from 0)."
        )
    uniq, counts = t.unique(return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][:5].tolist()
        raise ValueError(f"subnetwork indices contain duplicates, for example {dup}; remove them.")
    return t


def parse_subnetwork(
    subnetwork: Any, *, size: object = None, variances: Any = "diagonal_laplace", seed: int = 0
) -> SubnetworkRule:
    """Check a ``subnetwork=`` argument and return its :class:`SubnetworkRule`."""
    if isinstance(subnetwork, str):
        if subnetwork not in RULES:
            raise ValueError(
                f"unknown subnetwork rule {subnetwork!r}; expected one of "
                f"{', '.join(map(repr, RULES))}, a list of parameter names, or a list of indices."
            )
        if subnetwork in ("random", "largest_variance"):
            if size is None:
                raise ValueError(
                    f"subnetwork={subnetwork!r} needs size= (a count such as 1000 or a "
                    "fraction such as 0.1)."
                )
            size = _parse_size(size)
        elif size is not None:
            raise ValueError(
                f"size is only used with 'random' or 'largest_variance'; got size={size} with "
                f"subnetwork={subnetwork!r}. Drop size, or pick one of those rules."
            )
        if isinstance(variances, str) and variances not in VARIANCE_SOURCES:
            raise ValueError(
                f"unknown variances {variances!r}; expected 'diagonal_laplace', a mapping site "
                "-> tensor, or an AutoSWAG guide (its marginal_variances())."
            )
        return SubnetworkRule(subnetwork, size=size, variances=variances, seed=seed)  # type: ignore[arg-type]
    if (
        isinstance(subnetwork, (list, tuple))
        and subnetwork
        and all(isinstance(n, str) for n in subnetwork)
    ):
        return SubnetworkRule("names", names=tuple(subnetwork))
    if isinstance(subnetwork, (list, tuple, torch.Tensor)):
        if isinstance(subnetwork, (list, tuple)) and any(isinstance(n, str) for n in subnetwork):
            raise TypeError(
                f"subnetwork must be all names or all indices, not a mixture; got "
                f"{list(subnetwork)[:5]!r}. Pass site names only, or packed indices only."
            )
        if isinstance(subnetwork, (list, tuple)) and any(
            isinstance(n, (float, bool)) for n in subnetwork
        ):
            raise TypeError(
                f"subnetwork indices must be integers; got {subnetwork[:5]!r}. Use ints."
            )
        return SubnetworkRule("indices", indices=_parse_indices(subnetwork))
    raise TypeError(
        f"subnetwork must be one of {', '.join(map(repr, RULES))}, a list of parameter names, "
        f"or a list/LongTensor of indices; got {type(subnetwork).__name__}."
    )
