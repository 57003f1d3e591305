"""pyro_bdl: Bayesian deep learning in Pyro.

Lift any PyTorch network with :func:`bayesianize`, write the model with ``pyro.sample``, and pick
an inference method; every method ends in an ordinary Pyro guide.

``pyro_bdl.compare`` (the application behind ``pyro-bdl compare``) loads on first access, and the
diagnostics load ArviZ and matplotlib only when exporting or plotting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyro_bdl import (
    checkpoint,
    curvature,
    data,
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

if TYPE_CHECKING:
    from pyro_bdl import compare

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "compare":
        return importlib.import_module("pyro_bdl.compare")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "bayesianize",
    "checkpoint",
    "compare",
    "curvature",
    "data",
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
