"""Natural-gradient variational inference: one driver (:mod:`.driver`) and the mathematics of each
method, VOGN (:mod:`.vogn`) and IVON (:mod:`.ivon`)."""

from pyro_bdl.infer.natural_gradient.driver import NaturalGradientVI
from pyro_bdl.infer.natural_gradient.ivon import (
    IVON,
    IVONHyperparameters,
    ivon_scale,
    ivon_update,
)
from pyro_bdl.infer.natural_gradient.optimizer import NaturalGradientOptimizer
from pyro_bdl.infer.natural_gradient.state import NaturalGradientState
from pyro_bdl.infer.natural_gradient.vogn import (
    VOGN,
    VOGNHyperparameters,
    vogn_scale,
    vogn_update,
)

__all__ = [
    "IVON",
    "VOGN",
    "IVONHyperparameters",
    "NaturalGradientOptimizer",
    "NaturalGradientState",
    "NaturalGradientVI",
    "VOGNHyperparameters",
    "ivon_scale",
    "ivon_update",
    "vogn_scale",
    "vogn_update",
]
