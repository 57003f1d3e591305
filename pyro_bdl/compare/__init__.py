"""``pyro-bdl compare``: every inference method on the same data and network, side by side."""

from pyro_bdl.compare.evaluate import format_table, run, write_json
from pyro_bdl.compare.problem import NETWORKS, Problem
from pyro_bdl.compare.registry import COMPARE_METHODS, METHODS

__all__ = ["COMPARE_METHODS", "METHODS", "NETWORKS", "Problem", "format_table", "run", "write_json"]
