"""Reading checkpoints that an older version of a guide wrote in another form.

A guide that has changed how it stores its parameters offers ``split_packed(key, value)``
(:meth:`pyro_bdl.guides.base.AutoLocScaleGuide.split_packed`): given an entry saved in the old
form it returns the entries of the new one. :func:`upgrade_payload` applies it, before anything
is checked, to every part of a checkpoint that names parameters: the param store, the guide's
``state_dict``, the optimizer's states and the fingerprints that describe them.

A ready-made model names its params after itself (``"model_0.sigma"``); older files hold a point
σ as plain ``"sigma"``. :func:`rename_legacy_params` gives such a file's entry the name of the
model it is loaded into.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rename_legacy_params", "upgrade_payload"]


def _split_all(mapping: dict, split) -> dict[str, list[str]]:
    """Replace, in place, every entry ``split`` turns into several; returns old key -> new keys."""
    renamed = {}
    for key in list(mapping):
        if not isinstance(key, str):
            continue
        parts = split(key, mapping[key])
        if parts is None or any(k in mapping for k in parts if k != key):
            continue
        mapping.update(parts)
        renamed[key] = list(parts)
    return renamed


def upgrade_payload(payload: dict[str, Any], guide) -> None:
    """Rewrite, in place, the parts of ``payload`` that ``guide`` stores in another form now."""
    split = getattr(guide, "split_packed", None)
    if not callable(split):
        return
    store = payload.get("param_store") or {}
    fingerprint = payload.get("fingerprint") or {}
    values = store.get("values")
    if isinstance(values, dict):
        for old, new in _split_all(values, split).items():
            constraints, described = store.get("constraints", {}), fingerprint.get("params", {})
            for key in new:
                if old in constraints:
                    constraints[key] = constraints[old]
                if old in described:
                    described[key] = {**described[old], "shape": list(values[key].shape)}
    state = payload.get("guide")
    if isinstance(state, dict):
        described = fingerprint.get("guide_state")
        for new in _split_all(state, split).values():
            if isinstance(described, dict):
                described.update({key: list(state[key].shape) for key in new})
    optim = payload.get("optim")
    if isinstance(optim, dict):
        _split_all(optim, split)


def rename_legacy_params(payload: dict[str, Any], model) -> None:
    """Rename, in place, a point σ saved under the old shared name ``"sigma"`` to the name
    ``model`` (a :class:`~pyro_bdl.models.NetworkModel`) gives it, when the file holds only
    the old one."""
    names = tuple(getattr(model, "param_names", ()))
    store = payload.get("param_store") or {}
    values = store.get("values")
    if len(names) != 1 or not isinstance(values, dict):
        return
    old, new = "sigma", names[0]
    if old not in values or new in values:
        return
    described = (payload.get("fingerprint") or {}).get("params")
    optim = payload.get("optim")
    for mapping in (values, store.get("constraints"), described, optim):
        if isinstance(mapping, dict) and old in mapping:
            mapping[new] = mapping.pop(old)
