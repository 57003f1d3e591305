"""Distributions that ``pyro_bdl`` adds to Pyro's, with their KL divergences registered."""

from pyro_bdl.distributions.radial import Radial
from pyro_bdl.distributions.scale_mixture import ScaleMixtureNormal

__all__ = ["Radial", "ScaleMixtureNormal"]
