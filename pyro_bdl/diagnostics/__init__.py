"""Diagnostics: calibration and out-of-distribution metrics, ArviZ export."""

from pyro_bdl.diagnostics import metrics
from pyro_bdl.diagnostics.metrics import accuracy, nll

__all__ = ["accuracy", "metrics", "nll"]
