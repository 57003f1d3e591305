"""Tied weights and shared layers in a lifted network: one site per parameter tensor.

A parameter tensor used under several dotted names, because two layers hold the same
``nn.Parameter`` (a language-model head sharing the embedding matrix) or because one layer
instance appears twice in the module tree (the same ``nn.Linear`` twice in a ``Sequential``), is
one random variable. :func:`~pyro_bdl.bayesianize` therefore lifts it into one sample site, named
by its first dotted name in ``named_modules`` order; the other names are its aliases
(:attr:`~pyro_bdl.nn.SiteSpec.aliases`).

Pyro names a ``PyroSample`` site after the module that reads it, so two mechanisms keep one name:

- an alias layer (another module holding the tensor) gets the site's ``PyroSample`` too, and its
  ``_pyro_get_fullname`` maps that attribute to the owner's site name, so both layers read one
  cached value per forward pass (the vectorized forward's cache included);
- a layer instance reachable under several paths is named by its first path (Pyro would keep
  the last one it saw), also after the lifted network is placed inside another ``PyroModule``.

Methods that write a weight sample onto the owning layer alone (VOGN, and
:func:`pyro_bdl.curvature.substitute` called with the owner's name only) cannot serve the alias
layer; reading it then raises :class:`TiedWeightsError` instead of drawing an unrelated value.

See docs/design/lifting.md.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from pyro.nn import PyroModule
from torch import nn

__all__ = [
    "TiedSite",
    "TiedWeightsError",
    "check_alias_read",
    "install_alias",
    "name_by_first_path",
]


class TiedSite(Protocol):
    """What this module reads of a lifted site (:class:`~pyro_bdl.nn.SiteSpec` has it); a
    protocol, so that the site's own module can import this one and not the other way round."""

    name: str
    module: nn.Module
    param_name: str


_ALIASES_ATTR = "_bdl_aliases"


class TiedWeightsError(ValueError):
    """A method met a tied weight site that it serves on the owning layer only."""


def _make_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def aliased_fullname(module: PyroModule, name: str) -> str:
    """``module._pyro_get_fullname`` of a layer holding aliases: the owner's site name for an
    aliased attribute, Pyro's own name for any other."""
    entry = module.__dict__.get(_ALIASES_ATTR, {}).get(name)
    if entry is not None:
        spec = entry[0]
        return spec.module._pyro_get_fullname(spec.param_name)
    return type(module)._pyro_get_fullname(module, name)


def install_alias(module: nn.Module, param_name: str, spec: TiedSite, alias: str) -> None:
    """Record that ``module.<param_name>`` (dotted name ``alias``) is ``spec``'s site."""
    aliases = module.__dict__.get(_ALIASES_ATTR)
    if aliases is None:
        aliases = {}
        object.__setattr__(module, _ALIASES_ATTR, aliases)
    aliases[param_name] = (spec, alias)
    object.__setattr__(module, "_pyro_get_fullname", functools.partial(aliased_fullname, module))


def remove_alias(module: nn.Module, param_name: str) -> None:
    """Undo :func:`install_alias` for one attribute (the layer's other aliases stay)."""
    aliases = module.__dict__.get(_ALIASES_ATTR, {})
    aliases.pop(param_name, None)
    if not aliases:
        module.__dict__.pop(_ALIASES_ATTR, None)
        module.__dict__.pop("_pyro_get_fullname", None)


def check_alias_read(spec: TiedSite, module: nn.Module) -> None:
    """Refuse an alias layer's read while a value sits on the owner's instance dict only (the
    owner reads that value, the alias would draw a new one from the prior)."""
    if module is spec.module or spec.param_name not in spec.module.__dict__:
        return
    entry = module.__dict__.get(_ALIASES_ATTR, {})
    alias = next((a for s, a in entry.values() if s is spec), type(module).__name__)
    raise TiedWeightsError(
        f"weight site {spec.name!r} is tied: layer {alias!r} uses the same parameter, but a "
        f"value was written onto {spec.name!r} only (as VOGN and pyro_bdl.curvature.substitute "
        "do), so the two layers would read different weights. These methods do not support "
        "tied weights: untie them (give each layer its own nn.Parameter) before "
        "bayesianize, or fit with SVI and a guide (pyro_bdl.guides.AutoMeanField)."
    )


def name_by_first_path(root: nn.Module, prefix: str | None = None) -> None:
    """Name every ``PyroModule`` under ``root`` by its first path (``named_modules`` order)."""
    if prefix is None:
        prefix = root.__dict__.get("_pyro_name", "")
    for rel, sub in root.named_modules():
        if rel and isinstance(sub, PyroModule):
            sub.__dict__["_pyro_name"] = _make_name(prefix, rel)


def _set_supermodule(root: PyroModule, name: str, context: Any) -> None:
    type(root)._pyro_set_supermodule(root, name, context)
    name_by_first_path(root, name)


def install_first_path_naming(root: nn.Module) -> None:
    """Keep first-path names when Pyro renames ``root``'s tree (it is placed in a supermodule);
    only needed, and installed, when a layer instance appears under several paths."""
    paths = [id(m) for _, m in root.named_modules(remove_duplicate=False)]
    if len(paths) == len(set(paths)):
        return
    object.__setattr__(root, "_pyro_set_supermodule", functools.partial(_set_supermodule, root))
    name_by_first_path(root)
