"""pyro_bdl: Bayesian deep learning in Pyro.

Lift any PyTorch network with :func:`bayesianize`, write the model with ``pyro.sample``, and pick
an inference method; every method ends in an ordinary Pyro guide.

The subpackages load on first access (``bdl.guides``, ``from pyro_bdl import bayesianize``). The
``pyro-bdl`` command, its datasets and its registry of methods live apart, in
:mod:`pyro_bdl.app`, which the library never imports. The diagnostics load ArviZ and matplotlib
only when exporting or plotting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyro_bdl._version import __version__

if TYPE_CHECKING:
    from pyro_bdl import (
        app,  # noqa: F401  (not in __all__: a star import loads the library only)
        checkpoint,
        curvature,
        diagnostics,
        distributed,
        distributions,
        guides,
        infer,
        layout,
        models,
        nn,
        predictive,
        priors,
    )
    from pyro_bdl.nn import bayesianize, init_to_network, sites

#: Besides the library's subpackages (those in ``__all__``), loaded on first access: the
#: application and the shims of its old paths (which warn when they load).
_APPLICATION = ("app", "cli", "compare", "data", "metrics_binary")
#: Names re-exported from a subpackage: name -> subpackage.
_FROM = {"bayesianize": "nn", "init_to_network": "nn", "sites": "nn"}


def __getattr__(name: str) -> Any:
    # The subpackages load on first access, so that ``import pyro_bdl`` alone (and so the
    # ``pyro-bdl`` command before it has parsed its arguments) loads neither torch nor Pyro.
    if name in _FROM:
        value = getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
        globals()[name] = value
        return value
    if name in __all__ or name in _APPLICATION:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"app"})


__all__ = [
    "__version__",
    "bayesianize",
    "checkpoint",
    "curvature",
    "diagnostics",
    "distributed",
    "distributions",
    "guides",
    "infer",
    "init_to_network",
    "layout",
    "models",
    "nn",
    "predictive",
    "priors",
    "sites",
]
