"""Moved to :mod:`pyro_bdl.infer.natural_gradient.vogn`; this path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.guides.natural_gradient import NaturalGradientGuide as VOGNGuide
from pyro_bdl.infer.natural_gradient.optimizer import NaturalGradientOptimizer as VOGNOptimizer
from pyro_bdl.infer.natural_gradient.state import NaturalGradientState as VOGNState
from pyro_bdl.infer.natural_gradient.vogn import VOGN, vogn_scale, vogn_update

warn_moved(__name__, "pyro_bdl.infer.natural_gradient.vogn")

__all__ = ["VOGN", "VOGNGuide", "VOGNOptimizer", "VOGNState", "vogn_scale", "vogn_update"]
