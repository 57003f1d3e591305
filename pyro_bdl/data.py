"""Deprecated: moved to :mod:`pyro_bdl.app.data`; this path goes in the next release."""

from pyro_bdl._moved import alias_moved

alias_moved(__name__, "pyro_bdl.app.data")
