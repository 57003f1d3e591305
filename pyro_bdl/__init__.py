"""pyro_bdl: Bayesian deep learning in Pyro.

Lift any PyTorch network with :func:`bayesianize`, write the model with ``pyro.sample``, and pick
an inference method; every method ends in an ordinary Pyro guide.

The ``pyro-bdl`` command, its datasets and its registry of methods live apart, in
:mod:`pyro_bdl.app`, which the library never imports (``bdl.app`` loads it on first access). The
diagnostics load ArviZ and matplotlib only when exporting or plotting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyro_bdl import (
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
from pyro_bdl._version import __version__
from pyro_bdl.nn import bayesianize, init_to_network, sites

if TYPE_CHECKING:
    from pyro_bdl import app

#: Loaded on first access: the application, and the deprecated shims of its old paths (which
#: warn when they load).
_LAZY = ("app", "cli", "compare", "data", "metrics_binary")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "app",
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
