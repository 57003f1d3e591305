r"""The one place that knows which ArviZ is installed: every other module goes through here.

ArviZ 0.x (the last on Python 3.11) keeps exported draws in ``arviz.InferenceData`` and has
``az.psislw``, ``az.loo`` and matplotlib plots drawn on axes we pass. ArviZ ≥ 1 (Python ≥ 3.12)
keeps them in an ``xarray.DataTree`` and splits into ``arviz_base``, ``arviz_stats`` (PSIS,
LOO) and ``arviz_plots`` (plots that return a ``PlotCollection``). The functions below build,
read and query either container, smooth importance ratios, run PSIS-LOO and draw ArviZ's plots,
with one behaviour on both.

Usage::

    data = package({"posterior": ds}); group_names(data)   # ("posterior",)
    log_weights, khat = psislw(log_ratios)                  # samples on the last axis
    summary = loo_summary(loo(data))                        # elpd, se, p, elpd_i, pareto_k

References:
    ArviZ migration guide, "InferenceData to DataTree" (python.arviz.org, user guide).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

with warnings.catch_warnings():
    # ArviZ 0.23 announces its 1.x refactor with a FutureWarning on the first import of each
    # day (a stamp in the user's cache): the refactor is this module's concern, not the user's,
    # and a warning that depends on the date must not decide whether a run under -W error fails.
    warnings.filterwarnings("ignore", "\nArviZ is undergoing a major refactor", FutureWarning)
    import arviz as az

__all__ = [
    "LooSummary",
    "arviz_major",
    "arviz_version",
    "drop_groups",
    "group",
    "group_names",
    "is_data",
    "loo",
    "loo_summary",
    "num_draws",
    "package",
    "plot_forest",
    "plot_khat",
    "plot_ppc",
    "psislw",
    "read_netcdf",
]


def arviz_version() -> str:
    """The installed ArviZ version, as recorded in exported data."""
    return str(az.__version__)


def arviz_major() -> int:
    """The installed ArviZ major version (0 gives ``InferenceData``, 1 gives ``DataTree``)."""
    return int(arviz_version().split(".")[0])


def package(datasets: Mapping[str, xr.Dataset], *, major: int | None = None):
    """ArviZ 0.x ``InferenceData``, or (ArviZ ≥ 1, or ``major=1``) an ``xarray.DataTree`` with
    the same groups."""
    major = arviz_major() if major is None else major
    if major >= 1:
        return xr.DataTree.from_dict({f"/{name}": ds for name, ds in datasets.items()})
    return az.InferenceData(**datasets)


def is_data(obj: Any) -> bool:
    """Whether ``obj`` is exported ArviZ data: an ``xarray.DataTree`` (either ArviZ can hold
    one here), or an ``InferenceData`` on ArviZ 0.x."""
    # On ArviZ ≥ 1 ``az.InferenceData`` is a deprecated alias of DataTree; never touch it there.
    return isinstance(obj, xr.DataTree) or (
        arviz_major() == 0 and isinstance(obj, az.InferenceData)
    )


def group_names(data) -> tuple[str, ...]:
    """The groups of ``data`` (``"posterior"``, ``"log_likelihood"``, …), in stored order."""
    if isinstance(data, xr.DataTree):
        return tuple(data.children)
    return tuple(data.groups())


def group(data, name: str) -> xr.Dataset:
    """Group ``name`` of ``data`` as an ``xarray.Dataset``."""
    node = data[name]
    return node.to_dataset() if isinstance(node, xr.DataTree) else node


def num_draws(dataset: xr.Dataset) -> int:
    """The draws of a group (as from :func:`group`): chains times draws per chain."""
    return int(dataset.sizes.get("chain", 1) * dataset.sizes.get("draw", 1))


def drop_groups(data, names: Iterable[str]):
    """``data`` without the groups ``names``, in the same kind of container."""
    drop = set(names)
    kept = {g: group(data, g) for g in group_names(data) if g not in drop}
    return package(kept, major=1 if isinstance(data, xr.DataTree) else 0)


def read_netcdf(path: str | os.PathLike, *, major: int | None = None):
    """Read a netCDF file of groups into memory as the container of ArviZ ``major``."""
    major = arviz_major() if major is None else major
    if major >= 1:
        with xr.open_datatree(path, engine="h5netcdf") as tree:
            return tree.load()
    return az.from_netcdf(path, engine="h5netcdf")


def _psislw_row(row: np.ndarray) -> tuple[np.ndarray, float]:
    """PSIS of one vector of log ratios on ArviZ ≥ 1 (and of one draw on ArviZ 0.x)."""
    n = row.size
    # arviz_stats' tail length at relative efficiency 1; it fits the generalized Pareto to at
    # least 5 tail draws and raises (ValueError or IndexError) on fewer or on a flat tail.
    # ArviZ 0.x answers both with k̂ = inf and the normalized, unsmoothed weights; so do we.
    tail = int(np.floor(3 * np.sqrt(n))) if n > 225 else n // 5
    if tail < 5 or np.ptp(np.sort(row)[-tail:]) < np.finfo(np.float64).tiny:
        shifted = row - np.max(row)
        return shifted - np.log(np.sum(np.exp(shifted))), math.inf
    from arviz_stats.base import array_stats

    # arviz_stats smooths the right tail of the *negated* input (it is fed log-likelihoods in
    # LOO, where the ratio is 1 / p(y_i | θ)), so log ratios go in with their sign flipped.
    smoothed, khat = array_stats.psislw(-row)
    return np.asarray(smoothed), float(khat)


def psislw(log_ratios: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pareto-smoothed, normalized log importance weights and the tail shape k̂ of log ratios
    with the samples on the last axis: shapes ``log_ratios.shape`` and ``log_ratios.shape[:-1]``.

    The relative efficiency is 1 (independent draws, as from a guide). Too few draws for the
    tail fit (fewer than about 25) or a flat tail give k̂ = inf and the unsmoothed weights.
    """
    a = np.array(log_ratios, dtype=np.float64)
    with warnings.catch_warnings(), np.errstate(over="ignore", divide="ignore"):
        # ArviZ warns when k̂ is large or the tail is short (k̂ says both), and its profile
        # likelihood overflows harmlessly to weight 0 for far-off candidate shapes.
        warnings.simplefilter("ignore", UserWarning)
        if arviz_major() == 0 and a.shape[-1] > 1:  # ArviZ 0.x fails on one draw (IndexError)
            smoothed, khat = az.psislw(a, reff=1.0)
            return np.asarray(smoothed), np.asarray(khat, dtype=np.float64)
        rows = a.reshape(-1, a.shape[-1])
        fits = [_psislw_row(r) for r in rows]
    smoothed = np.stack([f[0] for f in fits]).reshape(a.shape)
    khats = np.array([f[1] for f in fits], dtype=np.float64).reshape(a.shape[:-1])
    return smoothed, khats


def loo(data, *, var_name: str | None = None, pointwise: bool = True):
    """PSIS leave-one-out cross-validation by the installed ArviZ: its own ``ELPDData`` (read it
    the same way on both with :func:`loo_summary`).

    Guide draws are independent, so the relative efficiency is 1 on both versions; on ArviZ ≥ 1
    the weights come from :func:`psislw`, so too few draws give k̂ = inf there too instead of an
    error.
    """
    with warnings.catch_warnings():
        # ArviZ warns about large pointwise k̂; they are in the result's ``pareto_k``.
        warnings.simplefilter("ignore", UserWarning)
        if arviz_major() == 0:
            return az.loo(data, pointwise=pointwise, var_name=var_name, reff=1.0)
        import arviz_stats

        log_lik = arviz_stats.get_log_likelihood(data, var_name=var_name)
        samples = log_lik.stack(__sample__=("chain", "draw")).transpose(..., "__sample__")
        # The LOO ratio of observation i is 1 / p(y_i | θ): its log is -log p(y_i | θ).
        smoothed, khat = psislw(-samples.values)
        log_weights = samples.copy(data=smoothed).unstack("__sample__")
        pareto_k = samples.isel(__sample__=0, drop=True).copy(data=khat)
        return arviz_stats.loo(
            data,
            pointwise=pointwise,
            var_name=var_name,
            reff=1.0,
            log_weights=log_weights.transpose(*log_lik.dims),
            pareto_k=pareto_k,
        )


@dataclass(frozen=True)
class LooSummary:
    """PSIS-LOO figures under the same names on every ArviZ.

    :ivar float elpd: the estimated expected log pointwise predictive density.
    :ivar float se: its standard error.
    :ivar float p: the effective number of parameters (``p_loo``).
    :ivar xarray.DataArray elpd_i: the pointwise elpd (``None`` without ``pointwise=True``).
    :ivar xarray.DataArray pareto_k: the pointwise k̂ (``None`` without ``pointwise=True``).
    """

    elpd: float
    se: float
    p: float
    elpd_i: xr.DataArray | None
    pareto_k: xr.DataArray | None


def loo_summary(result) -> LooSummary:
    """The figures of an ArviZ ``ELPDData`` from :func:`loo`, whichever ArviZ made it."""
    if hasattr(result, "elpd_loo"):  # ArviZ 0.x: a pandas Series with "_loo" names
        return LooSummary(
            float(result.elpd_loo),
            float(result.se),
            float(result.p_loo),
            getattr(result, "loo_i", None),
            getattr(result, "pareto_k", None),
        )
    return LooSummary(
        float(result.elpd), float(result.se), float(result.p), result.elpd_i, result.pareto_k
    )


@contextmanager
def _plot_warnings_off():
    """ArviZ's plots warn about what their figures show (large k̂, few draws, class labels that
    look discrete); ArviZ 0.23's matplotlib backend also uses an API that matplotlib 3.11
    deprecates, which is not ours to fix."""
    from matplotlib import MatplotlibDeprecationWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", MatplotlibDeprecationWarning)
        yield


def _draw_1x(make, path: Path) -> Path:
    """Run an ``arviz_plots`` function with matplotlib and save its figure to ``path``.

    arviz_plots makes its figures with ``pyplot`` (it takes no axes), so the figure is closed
    after saving: it must not stay registered with pyplot.
    """
    from matplotlib import pyplot

    with _plot_warnings_off():
        figure = make("matplotlib").get_viz("figure")
    try:
        figure.savefig(path, dpi=100)
    finally:
        pyplot.close(figure)
    return path


def _draw_0x(plot, path: Path, size: tuple[float, float]) -> Path:
    """Run an ArviZ 0.x plot function on axes of our own figure and save it to ``path``."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    with _plot_warnings_off():
        plot(figure.subplots())
    figure.savefig(path, dpi=100)
    return path


def plot_ppc(data, path: Path, *, num_samples: int) -> Path:
    """Posterior predictive draws (``num_samples`` of them) against the observed data."""
    if arviz_major() == 0:
        return _draw_0x(
            lambda ax: az.plot_ppc(data, ax=ax, num_pp_samples=num_samples), path, (6, 4)
        )
    import arviz_plots

    return _draw_1x(
        lambda backend: arviz_plots.plot_ppc_dist(data, num_samples=num_samples, backend=backend),
        path,
    )


def plot_khat(loo_result, path: Path) -> Path:
    """The pointwise PSIS-LOO k̂ of a :func:`loo` result (made with ``pointwise=True``)."""
    if arviz_major() == 0:
        return _draw_0x(lambda ax: az.plot_khat(loo_result, ax=ax), path, (6, 4))
    import arviz_plots

    return _draw_1x(lambda backend: arviz_plots.plot_khat(loo_result, backend=backend), path)


def plot_forest(data, var_names: list[str], path: Path) -> Path:
    """Credible intervals of the posterior variables ``var_names``, chains combined."""
    if arviz_major() == 0:
        return _draw_0x(
            lambda ax: az.plot_forest(data, var_names=var_names, combined=True, ax=ax),
            path,
            (6, 5),
        )
    import arviz_plots

    return _draw_1x(
        lambda backend: arviz_plots.plot_forest(
            data, var_names=var_names, combined=True, backend=backend
        ),
        path,
    )
