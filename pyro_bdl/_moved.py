"""Old module paths kept for one release. A shim module either becomes an alias of its new home
(:func:`alias_moved`) or re-exports the old names from it (:func:`warn_moved`); both warn once,
on import, with the same message."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Mapping


def alias_moved(old: str, new: str, submodules: Mapping[str, str] | None = None) -> None:
    """Make module ``old`` (the shim being imported) the module ``new``, with a
    ``DeprecationWarning``; ``submodules`` maps old submodule names to new ones so that
    ``import old.sub`` finds the same module objects instead of loading copies."""
    warn_moved(old, new, stacklevel=4)
    module = importlib.import_module(new)
    sys.modules[old] = module
    for old_sub, new_sub in (submodules or {}).items():
        sys.modules[f"{old}.{old_sub}"] = importlib.import_module(f"{new}.{new_sub}")


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that module ``old`` moved to ``new`` (called by the shim at ``old`` on import;
    ``stacklevel`` points the warning at the code importing the shim)."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes in the next release. Import {new} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
