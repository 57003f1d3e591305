"""Pyro guides for lifted networks. Every guide here is an ordinary Pyro guide: ``Predictive``,
``poutine``, ``state_dict`` checkpoints and the diagnostics work the same for all of them."""

from pyro_bdl.guides.base import AutoLocScaleGuide
from pyro_bdl.guides.ensemble import AutoEnsemble, AutoMultiSWAG
from pyro_bdl.guides.laplace import AutoLaplace, AutoSubnetLaplace, NotFittedError
from pyro_bdl.guides.meanfield import AutoMeanField
from pyro_bdl.guides.radial import AutoRadial
from pyro_bdl.guides.swag import AutoSWAG

__all__: list[str] = [
    "AutoEnsemble",
    "AutoLaplace",
    "AutoLocScaleGuide",
    "AutoMeanField",
    "AutoMultiSWAG",
    "AutoRadial",
    "AutoSWAG",
    "AutoSubnetLaplace",
    "NotFittedError",
]
