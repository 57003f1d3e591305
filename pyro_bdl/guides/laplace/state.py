"""What the settings and the state of a Laplace guide must hold: one prior precision, and buffers
``fit`` sizes that describe one subnetwork of the size the guide's rule selects on its model,
with the guide's Hessian structure
(:meth:`~pyro_bdl.guides.state_checks.CheckedLoad.load_state_dict` reports every error); and
how the rest of its state, a ``kron`` or ``diag`` posterior among it, is packed into one tensor
(:class:`PackedState`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pyro_bdl._validation import check_positive
from pyro_bdl.guides.laplace.posterior import DiagPosterior, KronPosterior, kron_blocks
from pyro_bdl.guides.state_checks import shape_of

__all__ = [
    "HESSIAN_STRUCTURES",
    "LIKELIHOOD_CODES",
    "NotFittedError",
    "PackedState",
    "one_precision",
    "state_errors",
]

#: Shapes of the GGN over the subnetwork (:mod:`~pyro_bdl.guides.laplace.posterior`), in the
#: order the packed extra state codes them.
HESSIAN_STRUCTURES = ("full", "kron", "diag")
#: The likelihoods a fit reads ("" before any fit), in the order the packed state codes them.
LIKELIHOOD_CODES = ("", "categorical", "bernoulli", "gaussian", "heteroscedastic")


class NotFittedError(RuntimeError, AttributeError):
    """Raised when a post-hoc posterior is used before it was fitted (also an
    ``AttributeError``, so that ``hasattr`` probing, as ``torch.jit`` does, reads a property of
    an unfitted guide as absent)."""


def state_errors(
    state_dict: Mapping[str, Any],
    prefix: str,
    *,
    hessian_structure: str,
    loc: torch.Tensor | None,
    rule: Any,
    layout: Any,
) -> list[str]:
    """The errors of ``state_dict`` (keys under ``prefix``) for a guide with this
    ``hessian_structure``, packed weights ``loc`` and subnetwork ``rule`` over ``layout``
    (``None`` where the guide has not seen its model yet)."""
    get = lambda name: state_dict.get(prefix + name)  # noqa: E731
    index = get("subnet_index")
    if not isinstance(index, torch.Tensor) or index.numel() == 0:
        return []  # an unfitted state: nothing sized
    errors, count = [], index.numel()
    if index.dtype != torch.long or index.dim() != 1:
        errors.append(f"{prefix}subnet_index: expected a 1-d LongTensor; got {index.dtype}")
    elif isinstance(loc, torch.Tensor) and not 0 <= int(index.min()) <= int(index.max()) < len(loc):
        errors.append(f"{prefix}subnet_index: indices outside [0, {len(loc)})")
    elif not bool((index[1:] > index[:-1]).all()):
        errors.append(
            f"{prefix}subnet_index: the indices must be sorted and without duplicates, as fit "
            "selects them"
        )
    extra = get("_extra_state")
    structure = "full"  # a state saved before the packed extra state held only "full"
    if isinstance(extra, torch.Tensor) and extra.numel() >= 8:
        code = float(extra[0])
        known = code in range(len(HESSIAN_STRUCTURES))
        structure = HESSIAN_STRUCTURES[int(code)] if known else f"unknown (code {code:g})"
    if structure != hessian_structure:
        errors.append(
            f"{prefix}_extra_state: the state holds a {structure!r} posterior; this guide "
            f"has hessian_structure={hessian_structure!r}"
        )
    dense = (count, count) if hessian_structure == "full" else (0,)
    expected: dict[str, tuple[int, ...]] = {"ggn": dense, "scale_tril": dense}
    if isinstance(loc, torch.Tensor):
        expected["map_loc"] = tuple(loc.shape)
    for name, shape in expected.items():
        value = get(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            errors.append(
                f"{prefix + name!r}: a subnetwork of {count} weights needs shape {shape}; "
                f"the state has {shape_of(value)}"
            )
        elif not _finite(value):
            errors.append(f"{prefix + name!r}: contains NaN or inf, which no fit gives")
    precision = get("prior_precision")
    if isinstance(precision, torch.Tensor) and tuple(precision.shape) not in ((), (count,)):
        errors.append(
            f"{prefix}prior_precision: expected shape () or ({count},); got {shape_of(precision)}"
        )
    elif isinstance(precision, torch.Tensor) and not (_finite(precision) and _positive(precision)):
        errors.append(
            f"{prefix}prior_precision: must be finite and > 0; got min {float(precision.min()):g}"
        )
    if rule is not None and layout is not None:
        try:
            size = rule.size_of(layout)
        except ValueError:
            size = None
        if size is not None and size != count:
            errors.append(
                f"{prefix + 'subnet_index'!r}: the state was fitted on a subnetwork of {count} "
                f"weights; this guide's rule (subnetwork={rule.kind!r}) selects {size}"
            )
    return errors


def _finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf (a tensor on the meta device has no values to check)."""
    return t.is_meta or bool(torch.isfinite(t).all())


def _positive(t: torch.Tensor) -> bool:
    return t.is_meta or bool((t > 0).all())


def one_precision(value: Any) -> float:
    """``prior_precision=`` as one positive float; refused with the ways to give more."""
    numel = value.numel() if isinstance(value, torch.Tensor) else 1
    if not isinstance(value, (int, float, torch.Tensor)) or isinstance(value, bool) or numel != 1:
        got = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(
            f"prior_precision must be one number λ > 0 (a float or a one-element tensor), the "
            f"precision of an isotropic prior over all weights; got {got}. For one precision "
            "per layer or per weight declare it in the prior given to pyro_bdl.bayesianize "
            "(and leave prior_precision=None), or tune it after fit with "
            "tune_prior_precision(prior_structure='layerwise' or 'diagonal')."
        )
    check_positive("prior_precision", value, fix="Pass λ = 1/prior_scale² > 0.")
    return float(value)


class PackedState:
    """The state of a Laplace guide beyond its buffers, packed into one float64 tensor (its
    ``nn.Module`` extra state), and the checks of a state before it loads: a mixin of
    :class:`~pyro_bdl.guides.laplace.guide.AutoSubnetLaplace`, whose attributes it reads."""

    hessian_structure: str
    _structure: Any
    _saved_state: torch.Tensor | None
    _stats: torch.Tensor | None
    _likelihood: str
    _noise: float | None
    _noise0: float | None
    layout: Any
    map_loc: torch.Tensor
    subnet_index: torch.Tensor

    def get_extra_state(self) -> torch.Tensor:
        """What ``fit`` and the tuning hold beside the buffers, packed into one float64 tensor
        (so that a state stays a dict of tensors): the Hessian structure, the likelihood, σ
        (the model's and a tuned one; 0 for none, as σ > 0), the fit statistics (zeros for
        none, as a fit sees at least one row), and for a ``kron`` or
        ``diag`` posterior its GGN scale c, its prior precisions and its diagonal or
        eigendecompositions (a ``full`` one lives in the buffers ``ggn`` and ``scale_tril``)."""
        if self._structure is None and self._saved_state is not None:
            return self._saved_state
        stats = self._stats if self._stats is not None else torch.zeros(4)
        head = [
            float(HESSIAN_STRUCTURES.index(self.hessian_structure)),
            float(LIKELIHOOD_CODES.index(self._likelihood)),
            0.0 if self._noise is None else self._noise,
            0.0 if self._noise0 is None else self._noise0,
        ]
        parts = [torch.tensor(head, dtype=torch.float64), stats.double().cpu()]
        post = self._structure
        if post is not None:
            lam = torch.as_tensor(post.lam, dtype=torch.float64).reshape(-1).cpu()
            body = [post.diag] if isinstance(post, DiagPosterior) else [*sum(post.eigen, ())]
            meta = torch.tensor([float(post.c), float(lam.numel())], dtype=torch.float64)
            parts += [meta, lam, *(t.double().reshape(-1).cpu() for t in body)]
        return torch.cat(parts)

    def set_extra_state(self, state: Any) -> None:
        if state is None:  # a state saved before the extra state existed: nothing to restore
            return
        values = state.tolist()[:8]
        self._likelihood = LIKELIHOOD_CODES[int(values[1])]
        self._noise = values[2] or None
        self._noise0 = values[3] or None
        stats = state[4:8].clone()
        self._stats = stats if values[4] > 0 else None
        self._structure = None  # rebuilt from the state on first use (it needs the layout)
        self._saved_state = state.clone()

    def _structure_from_state(self):
        """The ``kron``/``diag`` posterior from a loaded state (:meth:`set_extra_state`)."""
        state = self._saved_state
        if state is None or state.numel() <= 8:
            raise NotFittedError(
                f"the {self.hessian_structure!r} posterior is missing from the loaded state "
                "(saved by an older version); call guide.fit(data) again."
            )
        device = self.map_loc.device
        c, count = float(state[8]), int(state[9])
        lam = state[10 : 10 + count].to(device)
        lam = lam.reshape(()) if count == 1 else lam
        rest = state[10 + count :].to(device)
        if self.hessian_structure == "diag":
            return DiagPosterior(rest, lam, c)
        blocks = kron_blocks(self.layout, self.subnet_index)
        eigen, start = [], 0
        for block in blocks:
            out, k = block.positions.shape
            sizes = [(k,), (k, k), (out,), (out, out)]
            tensors = []
            for shape in sizes:
                n = math.prod(shape)
                t = rest[start : start + n].reshape(shape)
                # Column-major, as torch.linalg.eigh returns its eigenvectors: the products
                # then round as they did before saving.
                tensors.append(t.T.contiguous().T if t.dim() == 2 else t)
                start += n
            eigen.append(tuple(tensors))
        return KronPosterior(blocks, eigen, self.subnet_index.numel(), lam, c)

    def _upgrade_state(self, state_dict: dict, prefix: str) -> None:
        # A state saved before the extra state existed loads as before (a full posterior only).
        state_dict.setdefault(prefix + "_extra_state", None)

    def _state_errors(self, state_dict: Mapping[str, Any], prefix: str) -> list[str]:
        return state_errors(
            state_dict,
            prefix,
            hessian_structure=self.hessian_structure,
            loc=getattr(self, "loc", None),
            rule=getattr(self, "rule", None),
            layout=getattr(self, "layout", None),
        )
