"""Moved to :mod:`pyro_bdl.infer.natural_gradient.ivon`; this path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.infer.natural_gradient.ivon import IVON

warn_moved(__name__, "pyro_bdl.infer.natural_gradient.ivon")

__all__ = ["IVON"]
