r"""How :class:`~pyro_bdl.guides.AutoSWAG` reads a state dict: the counter mirror, and checkpoints
written before the diagonal statistic became Welford's M2.

Such a checkpoint stores the running second moment θ̄₂ (key ``swag_sq_mean``) instead of
M2 = Σ_t (θ_t − θ̄)² (key ``swag_m2``). Both describe the same T snapshots, so the old one is
converted on load, M2 = T · max(θ̄₂ − θ̄², 0) in float64: exactly the Σ_diag the checkpoint's
writer sampled from (it already carried that formula's float32 cancellation, which only new
collections avoid). A checkpoint that cannot be converted unambiguously is refused before
anything is loaded. The method and its conventions: docs/design/swag.md.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["convert_second_moment", "sync_counter"]

OLD_KEY, NEW_KEY = "swag_sq_mean", "swag_m2"


def convert_second_moment(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """Load-state-dict pre-hook: replace ``prefix + "swag_sq_mean"`` by the equivalent
    ``prefix + "swag_m2"`` in ``state_dict`` (in place; :meth:`torch.nn.Module.load_state_dict`
    hands its pre-hooks its own copy of the user's dict). Does nothing without the old key.

    :raises ValueError: when the old key comes with the new one, or without the mean and the
        counter it is converted with; nothing has been loaded then.
    """
    old = prefix + OLD_KEY
    if old not in state_dict:
        return
    needed = {prefix + "swag_mean", prefix + "swag_num_collected"}
    missing = sorted(needed - set(state_dict))
    if prefix + NEW_KEY in state_dict or missing:
        problem = (
            f"it also has {prefix + NEW_KEY!r}"
            if prefix + NEW_KEY in state_dict
            else f"it lacks {missing}, which the conversion needs"
        )
        raise ValueError(
            f"cannot load this AutoSWAG state dict: {old!r} (the second moment θ̄₂ of an older "
            f"version) is converted to the sum of squared deviations {prefix + NEW_KEY!r}, but "
            f"{problem}. Nothing was loaded. Pass the checkpoint as it was saved, or collect "
            "the SWAG statistics again."
        )
    sq_mean, mean = state_dict[old], state_dict[prefix + "swag_mean"]
    if sq_mean.shape != mean.shape:
        raise ValueError(
            f"cannot load this AutoSWAG state dict: {old!r} has shape {tuple(sq_mean.shape)} "
            f"but 'swag_mean' has {tuple(mean.shape)}. Nothing was loaded. The checkpoint is "
            "corrupt or comes from another model."
        )
    count = int(state_dict[prefix + "swag_num_collected"])
    variance = (sq_mean.double() - mean.double().square()).clamp_min_(0.0)
    state_dict[prefix + NEW_KEY] = variance.mul_(count).to(sq_mean.dtype)
    del state_dict[old]


def sync_counter(module: nn.Module, incompatible_keys) -> None:
    """Post-hook: the Python mirror of the counter buffer follows a loaded state dict."""
    counter = getattr(module, "swag_num_collected", None)
    if isinstance(counter, torch.Tensor):
        module._num_collected = int(counter)  # type: ignore[assignment]
