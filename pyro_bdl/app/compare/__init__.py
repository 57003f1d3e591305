"""``pyro-bdl compare``: every inference method on the same data and network, side by side.

The names below and the submodules load on first access, so that the command parses its
arguments (with the registry's names, :mod:`~pyro_bdl.app.compare.registry`) before torch or
Pyro load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyro_bdl.app.compare.evaluate import format_table, run, write_json
    from pyro_bdl.app.compare.networks import NETWORKS
    from pyro_bdl.app.compare.problem import Problem
    from pyro_bdl.app.compare.registry import COMPARE_METHODS, METHODS

#: Name -> the submodule that defines it.
_LAZY = {
    "COMPARE_METHODS": "registry",
    "METHODS": "registry",
    "NETWORKS": "networks",
    "Problem": "problem",
    "format_table": "evaluate",
    "run": "evaluate",
    "write_json": "evaluate",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    try:  # a submodule, e.g. ``bdl.app.compare.vogn``
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise  # a submodule that exists but lacks a dependency
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["COMPARE_METHODS", "METHODS", "NETWORKS", "Problem", "format_table", "run", "write_json"]
