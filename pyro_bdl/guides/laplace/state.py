"""What the settings and the state of a Laplace guide must hold: one prior precision, and buffers
``fit`` sizes that describe one subnetwork of the size the guide's rule selects on its model,
with the guide's Hessian structure
(:meth:`~pyro_bdl.guides.state_checks.CheckedLoad.load_state_dict` reports every error)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pyro_bdl._validation import check_positive
from pyro_bdl.guides.state_checks import shape_of

__all__ = ["HESSIAN_STRUCTURES", "one_precision", "state_errors"]

#: Shapes of the GGN over the subnetwork (:mod:`~pyro_bdl.guides.laplace.posterior`), in the
#: order the packed extra state codes them.
HESSIAN_STRUCTURES = ("full", "kron", "diag")


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
    precision = get("prior_precision")
    if isinstance(precision, torch.Tensor) and tuple(precision.shape) not in ((), (count,)):
        errors.append(
            f"{prefix}prior_precision: expected shape () or ({count},); got {shape_of(precision)}"
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
