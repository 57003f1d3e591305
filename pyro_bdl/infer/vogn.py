"""Moved to :mod:`pyro_bdl.infer.natural_gradient.vogn`; this path goes in the next release."""

import warnings

from pyro_bdl.guides.natural_gradient import NaturalGradientGuide as VOGNGuide
from pyro_bdl.infer.natural_gradient.driver import NaturalGradientOptimizer as VOGNOptimizer
from pyro_bdl.infer.natural_gradient.state import NaturalGradientState as VOGNState
from pyro_bdl.infer.natural_gradient.vogn import VOGN, vogn_scale, vogn_update

warnings.warn(
    "pyro_bdl.infer.vogn moved to pyro_bdl.infer.natural_gradient.vogn; the old path goes in the "
    "next release. Import VOGN from pyro_bdl.infer.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["VOGN", "VOGNGuide", "VOGNOptimizer", "VOGNState", "vogn_scale", "vogn_update"]
