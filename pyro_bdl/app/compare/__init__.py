"""``pyro-bdl compare``: every inference method on the same data and network, side by side."""

from pyro_bdl.app.compare.evaluate import format_table, run, write_json
from pyro_bdl.app.compare.problem import NETWORKS, Problem
from pyro_bdl.app.compare.registry import COMPARE_METHODS, METHODS

__all__ = ["COMPARE_METHODS", "METHODS", "NETWORKS", "Problem", "format_table", "run", "write_json"]
