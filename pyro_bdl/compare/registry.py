"""The methods ``pyro-bdl compare`` knows: one line each (name -> fit function).

A fit function takes a :class:`~pyro_bdl.compare.problem.Problem`, trains, and returns a
predictor mapping test inputs to mean predictive probabilities. To add a method, write its fit
function in a module of this package and add one line here.
"""

from __future__ import annotations

from collections.abc import Callable

from pyro_bdl.compare.laplace import fit_subnet_laplace
from pyro_bdl.compare.map import fit_map
from pyro_bdl.compare.problem import Predictor, Problem
from pyro_bdl.compare.swag import fit_swag, fit_swag_diag
from pyro_bdl.compare.temperature import fit_map_ts
from pyro_bdl.compare.variational import fit_meanfield, fit_radial
from pyro_bdl.compare.vogn import fit_vogn

METHODS: dict[str, Callable[[Problem], Predictor]] = {
    "map": fit_map,
    "map_ts": fit_map_ts,
    "swag": fit_swag,
    "swag_diag": fit_swag_diag,
    "meanfield": fit_meanfield,
    "radial": fit_radial,
    "subnet_laplace": fit_subnet_laplace,
    "vogn": fit_vogn,
}
