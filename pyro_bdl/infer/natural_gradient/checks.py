"""The checks a natural-gradient step makes before it changes anything: hyperparameters, inputs,
the loss, and the finiteness of a candidate update. Each refusal names the argument, what was
expected and what to do."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import nn

from pyro_bdl._validation import all_finite, check_callable, check_finite
from pyro_bdl.layout import SiteLayout

__all__ = [
    "as_float",
    "betas_ok",
    "check_betas_pair",
    "check_candidate",
    "check_hyperparameters",
    "check_inputs",
    "check_loss",
    "check_model",
    "check_not_meta",
    "check_range",
    "check_real",
    "check_reduce_fn",
    "first_non_finite",
    "layer_kinds",
    "lr_ok",
    "raise_if_moved",
    "state_names",
]


def as_float(value: object) -> float | None:
    """``value`` as a float if it is a real number (or a one-element tensor), else ``None``."""
    if type(value) is float:  # the common case, before the slower checks below
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def check_real(name: str, value: object) -> float:
    """``value`` as a float; a ``TypeError`` naming ``name`` if it is not a real number (``None``,
    a string, a bool), before the range checks, whose messages assume a number."""
    number = as_float(value)
    if number is None:
        raise TypeError(
            f"{name} must be a real number; got {type(value).__name__} {value!r}. Pass a Python "
            "float (float(x) converts a one-element tensor)."
        )
    return number


def lr_ok(lr: object) -> bool:
    """Whether the update can use the learning rate ``lr``: a finite number >= 0 (a schedule may
    end at 0), a one-element tensor included, as torch.optim takes it."""
    number = as_float(lr)
    return number is not None and math.isfinite(number) and number >= 0


def betas_ok(betas: object) -> bool:
    """Whether the update can use ``betas``: a pair of numbers (or one-element tensors) in
    [0, 1)."""
    pair = [as_float(b) for b in betas] if isinstance(betas, (tuple, list)) else []
    return len(pair) == 2 and all(b is not None and 0.0 <= b < 1.0 for b in pair)


def check_model(model: object) -> None:
    check_callable(
        "model",
        model,
        what="a callable Pyro model",
        fix="Pass the model, for example pyro_bdl.models.classifier(net, N).",
    )


def check_betas_pair(betas: object) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"betas must be a pair (beta1, beta2); got {betas!r}. Pass two numbers in [0, 1), or "
            "leave betas out for the method's default."
        )


def check_reduce_fn(reduce_fn: object) -> None:
    check_callable(
        "reduce_fn",
        reduce_fn,
        what="callable",
        optional=True,
        fix="Pass a function that sums a list of tensors over the ranks, or None on one process.",
    )


def check_hyperparameters(optimizer: torch.optim.Optimizer, step: int, method: str) -> None:
    """Refuse a learning rate or betas in ``optimizer.param_groups[0]`` that the update cannot
    use (set there by a scheduler or by hand): lr must be finite and >= 0 (a schedule may end at
    0), each beta in [0, 1)."""
    group = optimizer.param_groups[0]
    where = f"{method} step {step}: {method.lower()}.optimizer.param_groups[0]"
    if not lr_ok(group.get("lr")):
        raise ValueError(
            f"{where}['lr'] must be a finite number >= 0; got {group.get('lr')!r}. A "
            "learning-rate scheduler or an assignment set it; nothing was updated. Set a finite "
            f"lr, for example {method.lower()}.optimizer.param_groups[0]['lr'] = 1e-3."
        )
    betas = group.get("betas")
    if not betas_ok(betas):
        raise ValueError(
            f"{where}['betas'] must be a pair (beta1, beta2), each in [0, 1); got {betas!r}. "
            "Nothing was updated; set for example (0.9, 0.999)."
        )


def check_range(method: str, name: str, value: object, low: float, high: float, why: str) -> float:
    """Refuse a hyperparameter that is not a finite number in [``low``, ``high``], naming it, the
    range, the value and ``why`` the range (what breaks outside it); returns it as a float."""
    number = as_float(value)
    if number is None or not math.isfinite(number) or not low <= number <= high:
        raise ValueError(
            f"{method}: {name} must be a finite number in [{low:g}, {high:g}]; got {value!r}. {why}"
        )
    return number


def check_inputs(args: tuple, kwargs: dict, where: str) -> None:
    """Refuse NaN or inf in any floating-point tensor among the step's arguments (also inside
    tuples, lists and dicts), naming the argument, the count and the first index, before the
    model sees them (Pyro's own message names a distribution's parameter instead)."""
    stack: list[tuple[str, object]] = [(f"args[{i}]", a) for i, a in enumerate(args)]
    stack += [(f"{k}=", v) for k, v in kwargs.items()]
    while stack:
        label, value = stack.pop(0)
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex():
                try:
                    check_finite(f"the argument {label}", value)
                except ValueError as err:
                    raise ValueError(
                        f"{where}: {err} Nothing was updated; the batch was refused before the "
                        "model ran."
                    ) from None
        elif isinstance(value, (tuple, list)):
            stack += [(f"{label}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            stack += [(f"{label}[{k!r}]", v) for k, v in value.items()]


def check_loss(step: int, likelihood: float, kl: float, method: str) -> None:
    """Refuse a non-finite loss, naming its term (each site's likelihood is checked earlier, so a
    non-finite total here is an overflow of the sum, or the KL)."""
    for term, value in (("likelihood (the sum over the data sites)", likelihood), ("KL", kl)):
        if not math.isfinite(value):
            raise ValueError(
                f"{method} step {step}: the {term} term of the loss is not finite ({value}); "
                "nothing was updated. Lower the learning rate, check the data, or check the prior."
            )


def first_non_finite(tensor: torch.Tensor, layout: SiteLayout | None = None) -> str:
    """Where the first NaN or inf of ``tensor`` lies, for a message: the weight site and the
    index within it for a flat vector over the sites of ``layout``, else the index."""
    parts = zip(layout.names, layout.split(tensor)) if layout is not None else [("", tensor)]
    for site, part in parts:
        bad = ~torch.isfinite(part)
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            return f"in weight site {site!r} at index {index}" if site else f"at index {index}"
    return "in no single entry (a sum overflows)"


def check_not_meta(state, method: str, where: str) -> None:
    """Refuse a ``state`` (a :class:`~pyro_bdl.infer.natural_gradient.state.NaturalGradientState`
    or ``None``) moved to the meta device: it holds shapes without values, so nothing can be
    computed from it, loaded into it, or moved back from it."""
    if state is not None and state.mean.is_meta:
        raise ValueError(
            f"{where}: {method}'s state is on the meta device (shapes without values), so "
            "nothing can be computed from it or loaded into it, and it cannot be moved back; "
            f"nothing was changed. To resume, build a new {method} over the network on a real "
            "device and load the state_dict into it."
        )


def check_guide_reads(guide, state, method: str, where: str) -> None:
    """Refuse to go on once ``guide`` no longer reads ``state`` (set up): ``guide.to(...)``,
    ``.double()`` or ``.cuda()`` on the guide alone replaces its ``loc`` by a converted copy, which
    the updates of the state would never reach, so the guide would predict from a stale μ."""
    if state is not None and guide._buffers.get("loc") is not state.mean:
        name = method.lower()
        raise RuntimeError(
            f"{where}: {name}.guide no longer reads {method}'s state: the guide was moved or "
            "converted on its own (guide.to(...), .double(), .cuda()), so its loc is a copy that "
            f"{method}'s updates would not reach; nothing was changed. Move {method}, its guide "
            f"and the layers it trains together with {name}.to(...) (the same arguments)."
        )


def layer_kinds(layers: Iterable[nn.Module]) -> list[tuple[str, torch.dtype, torch.device]]:
    """(layer type, dtype, device) of every floating parameter and buffer of ``layers``."""
    return [
        (type(layer).__name__, t.dtype, t.device)
        for layer in layers
        for t in (*layer._parameters.values(), *layer._buffers.values())
        if t is not None and t.is_floating_point()
    ]


def raise_if_moved(
    err: BaseException, layers: Iterable[nn.Module], kinds: list, method: str, where: str
) -> None:
    """Raise the error that explains ``err`` (a refused pass) if ``layers`` no longer hold the
    ``kinds`` (:func:`layer_kinds`) they held when the state was set up or moved: after
    ``net.float()`` or ``net.to(device)`` on the network alone, torch's dtype or device error
    inside a layer names neither the cause nor the fix."""
    moved = [(now, then) for now, then in zip(layer_kinds(layers), kinds) if now != then]
    if not moved:
        return
    (layer, dtype, device), (_, was, was_on) = moved[0]
    raise RuntimeError(
        f"{where}: the network was converted or moved on its own since {method} last saw it (a "
        f"{layer} now holds {dtype} on {device}, not {was} on {was_on}: net.float(), "
        "net.to(...)); the call was refused and nothing was updated. Convert the method with "
        f"the network: {method.lower()}.to(...) with the same arguments moves its state, its "
        "guide and the layers it trains."
    ) from err


def state_names(hidden: list[str]) -> list[str]:
    """What each tensor of ``state_tensors`` is, for messages (``hidden``: the hidden
    parameters' names)."""
    names = ["weights", *(f"{h} (hidden)" for h in hidden)]
    out = [f"the mean of {names[0]}", f"the momentum of {names[0]}"]
    out += [f"the curvature of {names[0]}"]
    out += [f"{n}" for n in names[1:]]
    out += [f"the momentum of {n}" for n in names[1:]]
    return out + [f"the curvature of {n}" for n in names[1:]]


def check_candidate(
    tensors: list[torch.Tensor],
    var_sums: tuple[float, float],
    hidden: list[str],
    layout: SiteLayout | None,
    g_hat: torch.Tensor,
    method: str,
    step: int,
) -> None:
    """Refuse an update whose state (``tensors``, as ``state_tensors`` lists them) would be
    non-finite, or whose σ would not be finite and > 0 (the KL's sums ``var_sums``, Σσ² and
    Σ log σ², are finite only if every σ is), before it is committed: a NaN written into the
    curvature would refuse every later step. ``g_hat``: the weights' ĝ, for the message."""
    # The curvature of the weights needs no sum: σ, and so Σσ² and Σ log σ², is finite only
    # where it is.
    if all_finite(tensors[:2] + tensors[3:]) and all(map(math.isfinite, var_sums)):
        return
    bad = [
        (n, i, t)
        for i, (n, t) in enumerate(zip(state_names(hidden), tensors))
        if not bool(torch.isfinite(t).all())
    ]
    what, where = "the posterior scale σ (zero or inf, from the curvature)", ""
    if bad:
        what, i, tensor = bad[0]
        place = first_non_finite(tensor, layout if i < 3 else None)
        where = f" The first non-finite entry is {place}."
    raise FloatingPointError(
        f"{method} step {step}: the update would make {what} non-finite; the step was "
        f"refused and nothing was updated.{where} The batch's gradients are too large for the "
        f"state's float precision (largest |ĝ| {float(g_hat.abs().max()):.3g}): check the "
        "scale of the inputs (standardise them), or lower the learning rate."
    )
