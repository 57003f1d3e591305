"""The methods of ``pyro-bdl compare`` and of the benchmarks: one line each (name -> fit function).

A fit function takes a :class:`~pyro_bdl.app.compare.problem.Problem`, trains, and returns a
predictor (mean class probabilities for classification, the predictive distribution for
regression; see ``Problem.predictor``). A method that needs settings other than compare's takes
them as keyword arguments (the UCI regression benchmark passes its own). To add a method, write
its fit function in a module of this package and add one line to :data:`ENTRIES`.

Each fit function's module loads when the method is first looked up, so that the command can
list and check the names (``pyro-bdl --help``) before torch or Pyro load.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyro_bdl.app.compare.problem import Predictor

__all__ = ["COMPARE_METHODS", "ENTRIES", "METHODS"]

#: Method name -> "module of this package:fit function".
ENTRIES: dict[str, str] = {
    "map": "map:fit_map",
    "map_ts": "temperature:fit_map_ts",
    "swag": "swag:fit_swag",
    "swag_diag": "swag:fit_swag_diag",
    "meanfield": "variational:fit_meanfield",
    "radial": "variational:fit_radial",
    # The GGN Laplace over a subnetwork of at most 1,000 weights chosen by SWAG variances.
    "subnet_laplace": "subnet_laplace:fit_subnet_laplace",
    "vogn": "vogn:fit_vogn",
    "ivon": "ivon:fit_ivon",
    # The GGN Laplace over every lifted weight (dense D × D posterior).
    "laplace": "laplace:fit_laplace",
    "ensemble": "ensemble:fit_ensemble",
    "multiswag": "ensemble:fit_multiswag",
    # Dropout kept on at prediction, the rate chosen on held-out training rows.
    "mc_dropout": "mc_dropout:fit_mc_dropout",
}


class _Registry(MutableMapping[str, Callable[..., "Predictor"]]):
    """Names to fit functions, each given as ``"module:function"`` (:data:`ENTRIES`) and
    imported on first lookup; a callable may be set directly (a test's stand-in method)."""

    def __init__(self, entries: Mapping[str, str]):
        self._entries: dict[str, str | Callable[..., Predictor]] = dict(entries)

    def __getitem__(self, name: str) -> Callable[..., Predictor]:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, function = entry.split(":")
            entry = getattr(importlib.import_module(f"{__package__}.{module}"), function)
        return entry

    def __setitem__(self, name: str, fit: Callable[..., Predictor]) -> None:
        self._entries[name] = fit

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


METHODS: MutableMapping[str, Callable[..., Predictor]] = _Registry(ENTRIES)

#: What ``pyro-bdl compare`` runs by default: every method but the full-network ``laplace``,
#: whose dense D × D posterior outgrows compare's networks (``subnet_laplace`` is its scalable
#: form), the ensembles, which train M = 5 networks each (M times ``map`` / ``swag``), and
#: ``ivon`` (about 6 s more on the default digits MLP) and ``mc_dropout``, which trains once per
#: dropout rate it tries and once more; ask for them with
#: ``--methods laplace,ensemble,multiswag,ivon,mc_dropout``.
COMPARE_METHODS: tuple[str, ...] = tuple(
    name
    for name in ENTRIES
    if name not in ("laplace", "ensemble", "multiswag", "ivon", "mc_dropout")
)
