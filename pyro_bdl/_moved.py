"""Old module paths kept for one release: each shim module makes its old name an alias of the
module's new home and warns once, on import."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Mapping


def alias_moved(old: str, new: str, submodules: Mapping[str, str] | None = None) -> None:
    """Make module ``old`` (the shim being imported) the module ``new``, with a
    ``DeprecationWarning``; ``submodules`` maps old submodule names to new ones so that
    ``import old.sub`` finds the same module objects instead of loading copies."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes in the next release. Import {new} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    sys.modules[old] = module
    for old_sub, new_sub in (submodules or {}).items():
        sys.modules[f"{old}.{old_sub}"] = importlib.import_module(f"{new}.{new_sub}")
