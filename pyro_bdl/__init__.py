"""pyro_bdl: Bayesian deep learning in Pyro.

Lift any PyTorch network with :func:`bayesianize`, write the model with ``pyro.sample``, and pick
an inference method; every method ends in an ordinary Pyro guide.
"""

from pyro_bdl import (
    checkpoint,
    compare,
    curvature,
    data,
    diagnostics,
    distributed,
    distributions,
    guides,
    infer,
    models,
    nn,
    priors,
)
from pyro_bdl.nn import bayesianize, init_to_network, sites

__version__ = "0.1.0"

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
    "models",
    "nn",
    "priors",
    "sites",
]
