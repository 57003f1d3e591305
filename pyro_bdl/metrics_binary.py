"""Deprecated: moved to :mod:`pyro_bdl.diagnostics.metrics_binary`; this path goes in the next
release."""

from pyro_bdl._moved import alias_moved

alias_moved(__name__, "pyro_bdl.diagnostics.metrics_binary")
