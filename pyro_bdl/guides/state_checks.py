"""Checking a guide's ``state_dict`` whole, before any of it is copied.

``torch.nn.Module.load_state_dict`` copies entry by entry and reports a shape mismatch only once
it has copied every entry that fits, so the state of a guide of another configuration (an
:class:`~pyro_bdl.guides.AutoSWAG` of another rank, a Laplace guide fitted on a subnetwork of
another size) leaves some buffers overwritten before it raises. :class:`CheckedLoad` makes the
guides check every entry of themselves and their submodules first (keys, tensors, shapes, and a
guide's own consistency rules) and refuse the state, naming every mismatching key, before
anything changes. :func:`state_dict_errors` gives the same reasons without loading, for callers
that must check several parts before restoring any (:func:`pyro_bdl.checkpoint.load_checkpoint`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["CheckedLoad", "StateDictMismatchError", "shape_of", "state_dict_errors"]


class StateDictMismatchError(RuntimeError):
    """A ``state_dict`` that does not fit the module it is loaded into; nothing was loaded."""


def shape_of(value: Any) -> str:
    """The shape of a state entry for a message: its tuple, or its type when not a tensor."""
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def state_dict_errors(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str = "", *, strict: bool = True
) -> list[str]:
    """Every reason ``module.load_state_dict(state_dict)`` would refuse ``state_dict`` (or part of
    it), without changing anything; an empty list if it loads whole.

    Checked: every entry is a tensor of the live entry's shape (buffers a module lists in
    ``_resizable_state`` take any shape), and with ``strict`` no key is missing or unexpected;
    then the rules of every :class:`CheckedLoad` submodule (:meth:`CheckedLoad._state_errors`).
    """
    if not isinstance(state_dict, Mapping):
        return [f"the state must be a dict of tensors; got {type(state_dict).__name__}"]
    own = module.state_dict(prefix=prefix, keep_vars=True)
    resizable: set[str] = set()
    checked: list[tuple[CheckedLoad, str]] = []
    for name, sub in module.named_modules():
        sub_prefix = prefix + (name + "." if name else "")
        resizable.update(sub_prefix + r for r in getattr(sub, "_resizable_state", ()))
        if isinstance(sub, CheckedLoad):
            checked.append((sub, sub_prefix))
    errors = []
    for key, live in own.items():
        if key not in state_dict:
            # A module's extra state may postdate the state; its _upgrade_state fills it in.
            if strict and not key.endswith("_extra_state"):
                errors.append(f"{key!r}: missing from the state (this module has {shape_of(live)})")
            continue
        value = state_dict[key]
        if key.endswith("_extra_state"):
            continue  # whatever the module's get_extra_state returned
        if not isinstance(value, torch.Tensor):
            errors.append(f"{key!r}: the state holds a {type(value).__name__}, not a tensor")
        elif key not in resizable and not is_lazy(live) and value.shape != live.shape:
            errors.append(
                f"{key!r}: the state has shape {shape_of(value)}, this module {shape_of(live)}"
            )
    if strict:
        errors += [
            f"{key!r}: not in this module (unexpected)"
            for key in state_dict
            if isinstance(key, str) and key.startswith(prefix) and key not in own
        ]
    if not errors:  # consistency rules assume the entries themselves are well-formed
        for sub, sub_prefix in checked:
            errors += sub._state_errors(state_dict, sub_prefix)
    return errors


# Typed as Any: the guides' other bases (Pyro's) are untyped, and a typed nn.Module first in
# their MRO would make every attribute resolve through nn.Module.__getattr__ for mypy.
_Module: Any = nn.Module


class CheckedLoad(_Module):
    """Mixin for guides: ``load_state_dict`` checks the whole state before it copies any entry,
    and raises :class:`StateDictMismatchError` naming every mismatching key."""

    #: Buffers sized on demand (empty until a fit) that take the shapes stored in a state.
    _resizable_state: tuple[str, ...] = ()

    def _state_errors(self, state_dict: Mapping[str, Any], prefix: str) -> list[str]:
        """Rules beyond keys and shapes (entries that must agree with each other)."""
        return []

    def _upgrade_state(self, state_dict: dict, prefix: str) -> None:
        """Rewrite, in place, entries an older version saved under another meaning, so that the
        checks and the copy see the current form (nothing by default)."""

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ):
        # A copy for the upgrades (the user's dict stays as it was), keeping torch's metadata.
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = OrderedDict(state_dict)
        if metadata is not None:
            state_dict._metadata = metadata  # type: ignore[attr-defined]
        for name, sub in self.named_modules():
            if isinstance(sub, CheckedLoad):
                sub._upgrade_state(state_dict, f"{name}." if name else "")
        self._refuse(state_dict_errors(self, state_dict, strict=strict))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Reached also when the guide sits inside another module. torch passes strict=True here
        # whatever its caller asked (it sorts missing keys out afterwards), so the keys are
        # checked by load_state_dict above and only the entries present here.
        self._upgrade_state(state_dict, prefix)
        self._refuse(state_dict_errors(self, state_dict, prefix, strict=False))
        for name in self._resizable_state:
            if prefix + name in state_dict:
                self._buffers[name] = torch.empty_like(state_dict[prefix + name])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _refuse(self, errors: list[str]) -> None:
        if errors:
            raise StateDictMismatchError(
                f"cannot load this state_dict into {type(self).__name__}; nothing was loaded. "
                "Mismatching keys:\n  - " + "\n  - ".join(errors) + "\nLoad a state saved from "
                "a guide of the same model and options (rank, subnetwork and size), set up on the "
                "same model (call the guide once first)."
            )
