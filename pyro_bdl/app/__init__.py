"""The ``pyro-bdl`` application, apart from the library: the command (:mod:`pyro_bdl.app.cli`),
its datasets (:mod:`pyro_bdl.app.data`) and the registry of methods it compares
(:mod:`pyro_bdl.app.compare`), also used by the benchmarks and the tutorials.

The library never imports this package. Its submodules load on first access, so that
``pyro-bdl --help`` parses its arguments before torch or Pyro load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyro_bdl.app import cli, compare, data

_SUBMODULES = ("cli", "compare", "data")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["cli", "compare", "data"]
