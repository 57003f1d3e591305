"""The methods of ``pyro-bdl compare`` and of the benchmarks: one line each (name -> fit function).

A fit function takes a :class:`~pyro_bdl.app.compare.problem.Problem`, trains, and returns a
predictor (mean class probabilities for classification, the predictive distribution for
regression; see ``Problem.predictor``). A method that needs settings other than compare's takes
them as keyword arguments (the UCI regression benchmark passes its own). To add a method, write
its fit function in a module of this package and add one line here.
"""

from __future__ import annotations

from collections.abc import Callable

from pyro_bdl.app.compare.ensemble import fit_ensemble, fit_multiswag
from pyro_bdl.app.compare.laplace import fit_laplace
from pyro_bdl.app.compare.subnet_laplace import fit_subnet_laplace
from pyro_bdl.app.compare.map import fit_map
from pyro_bdl.app.compare.problem import Predictor
from pyro_bdl.app.compare.swag import fit_swag, fit_swag_diag
from pyro_bdl.app.compare.temperature import fit_map_ts
from pyro_bdl.app.compare.variational import fit_meanfield, fit_radial
from pyro_bdl.app.compare.vogn_fit import fit_vogn

__all__ = ["COMPARE_METHODS", "METHODS"]

METHODS: dict[str, Callable[..., Predictor]] = {
    "map": fit_map,
    "map_ts": fit_map_ts,
    "swag": fit_swag,
    "swag_diag": fit_swag_diag,
    "meanfield": fit_meanfield,
    "radial": fit_radial,
    "subnet_laplace": fit_subnet_laplace,
    "vogn": fit_vogn,
    "laplace": fit_laplace,
    "ensemble": fit_ensemble,
    "multiswag": fit_multiswag,
}

#: What ``pyro-bdl compare`` runs by default: every method but the full-network ``laplace``,
#: whose dense D × D posterior outgrows compare's networks (``subnet_laplace`` is its scalable
#: form), and the ensembles, which train M = 5 networks each (M times ``map`` / ``swag``);
#: ask for them with ``--methods laplace,ensemble,multiswag``.
COMPARE_METHODS: tuple[str, ...] = tuple(
    name for name in METHODS if name not in ("laplace", "ensemble", "multiswag")
)
