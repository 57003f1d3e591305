r"""Export posterior draws of any Pyro guide to ArviZ.

:func:`to_inference_data` draws from the guide, replays the model on each draw, and collects the
ArviZ groups ``posterior`` (latent sites the guide covers, and deterministic sites), ``posterior_
predictive`` (a fresh draw of each observed site, and model-only sites), ``log_likelihood`` (the
pointwise, unscaled log density of each observation, for LOO/WAIC) and ``observed_data``, with
``chain``/``draw`` dims and named dims from the plates and the layers. It only uses
``poutine.trace``/``replay``, so it works for every guide of this library and for Pyro's own
autoguides (auxiliary sites such as ``AutoContinuous``'s packed latent are skipped: the model's
replayed sites hold the constrained values).

Memory stays bounded: draws are moved to the host ``batch_size`` at a time into preallocated
arrays, and a weight site larger than ``max_site_size`` keeps only per-draw summaries
(``<site>_mean``, ``<site>_std``, ``<site>_norm``).

Usage::

    idata = to_inference_data(model, guide, x_test, y_test, num_samples=200)
    save_inference_data(idata, "run.nc"); idata = load_inference_data("run.nc")
    loo(idata)                                  # pyro_bdl.diagnostics.loo, either ArviZ

References:
    Kumar, Carroll, Hartikainen & Martin, "ArviZ a unified library for exploratory analysis of
    Bayesian models in Python", JOSS 2019 (the InferenceData schema).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pyro
import torch
import xarray as xr
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro_bdl._validation import check_positive_int
from pyro_bdl._version import __version__
from pyro_bdl.diagnostics.arviz_compat import (
    arviz_major,
    arviz_version,
    is_data,
    package,
    read_netcdf,
)
from pyro_bdl.diagnostics.metrics import as_tensor, check_probs
from pyro_bdl.nn import site_spec

__all__ = [
    "GROUPS",
    "arviz_major",
    "load_inference_data",
    "mean_predictive_data",
    "package",
    "save_inference_data",
    "to_inference_data",
]

#: The groups :func:`to_inference_data` fills, in ArviZ's schema order.
GROUPS = ("posterior", "posterior_predictive", "log_likelihood", "observed_data")

_SUMMARIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": lambda v: v.mean(),
    "std": lambda v: v.std() if v.numel() > 1 else torch.zeros((), dtype=v.dtype),
    "norm": lambda v: v.norm(),
}


@dataclass
class _Variable:
    """Where one quantity of a draw goes: its group, name, dims and how to read it."""

    group: str
    name: str
    site: str
    dims: tuple[str, ...]
    read: Callable[[dict], torch.Tensor]
    shape: tuple[int, ...] = ()
    buffer: list[torch.Tensor] = field(default_factory=list)
    array: np.ndarray | None = None


def _host(value: torch.Tensor) -> np.ndarray:
    """``value`` as a NumPy array on the host; NumPy (and netCDF) have no bfloat16, so it
    becomes float32, which holds every bfloat16 value exactly."""
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def _layer_dims(site: Mapping[str, Any], name: str, ndim: int, offset: int) -> list[str]:
    """Readable dims for a lifted layer's weight or bias; ``<site>_dim_i`` otherwise (i counts
    the value's axes, so ``offset`` is the number of batch dims before the event dims)."""
    spec = site_spec(site)
    generic = [f"{name}_dim_{offset + i}" for i in range(ndim)]
    if spec is None or not isinstance(spec.module, (nn.Linear, nn.modules.conv._ConvNd)):
        return generic
    if spec.param_name == "bias" and ndim == 1:
        return [f"{name}_out"]
    if spec.param_name == "weight" and ndim >= 2:
        kernel = [f"{name}_k{i}" for i in range(ndim - 2)]
        return [f"{name}_out", f"{name}_in", *kernel]
    return generic


def _site_dims(site: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Batch dims named after their plates (``"data"`` for the data plate), event dims after the
    layer; anything else ``<site>_dim_i``."""
    fn = site["fn"]
    batch_ndim = len(shape) - len(getattr(fn, "event_shape", ()))
    batch_ndim = max(0, min(batch_ndim, len(shape)))
    plates = {f.dim: f.name for f in site["cond_indep_stack"] if f.dim is not None}
    dims = []
    for i in range(batch_ndim):
        dims.append(plates.get(i - batch_ndim, f"{name}_dim_{i}"))
    event = _layer_dims(site, name, len(shape) - batch_ndim, batch_ndim)
    dims += [d if d not in dims else f"{d}_{j}" for j, d in enumerate(event)]
    return tuple(dims)


def _pointwise_log_likelihood(site: Mapping[str, Any]) -> torch.Tensor:
    """log p(y_i | θ) per observation: no subsampling scale, but the site's mask applies."""
    log_prob = site["fn"].log_prob(site["value"])
    mask = site.get("mask")
    if mask is not None and not isinstance(mask, bool):
        log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob))
    elif mask is False:
        log_prob = torch.zeros_like(log_prob)
    return log_prob


def _is_observed(site: Mapping[str, Any]) -> bool:
    return bool(site["is_observed"]) and not site["infer"].get("_deterministic", False)


def _plan(
    model_trace, guide_trace, var_names: Iterable[str] | None, max_site_size: int | None
) -> tuple[list[_Variable], dict[str, np.ndarray]]:
    """Decide, from the first draw, which variable goes to which group (and its dims)."""
    variables: list[_Variable] = []
    observed: dict[str, np.ndarray] = {}
    latent: list[str] = []
    guide_sites = {n for n, s in guide_trace.nodes.items() if s["type"] == "sample"}
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        value = site["value"]
        shape = tuple(value.shape)
        dims = _site_dims(site, name, shape)
        if _is_observed(site):
            observed[name] = _host(value)
            lp_shape = tuple(_pointwise_log_likelihood(site).shape)
            variables.append(
                _Variable(
                    "posterior_predictive", name, name, dims, lambda s: s["fn"].sample(), shape
                )
            )
            variables.append(
                _Variable(
                    "log_likelihood",
                    name,
                    name,
                    # log_prob has the batch shape: the leading dims of the value.
                    dims[: len(lp_shape)],
                    _pointwise_log_likelihood,
                    lp_shape,
                )
            )
        elif name in guide_sites or site["infer"].get("_deterministic", False):
            latent.append(name)
        else:
            # Sampled by the model alone given θ (for example y when no y is passed).
            variables.append(
                _Variable("posterior_predictive", name, name, dims, lambda s: s["value"], shape)
            )
    chosen = latent if var_names is None else list(var_names)
    unknown = [v for v in chosen if v not in latent]
    if unknown:
        raise ValueError(
            f"var_names {unknown} are not latent sites of the model that the guide samples; "
            f"expected some of {latent}."
        )
    for name in chosen:
        site = model_trace.nodes[name]
        shape = tuple(site["value"].shape)
        numel = int(np.prod(shape)) if shape else 1
        if max_site_size is not None and numel > max_site_size:
            for stat, fn in _SUMMARIES.items():
                variables.append(
                    _Variable("posterior", f"{name}_{stat}", name, (), partial(_summary, fn))
                )
        else:
            dims = _site_dims(site, name, shape)
            variables.append(_Variable("posterior", name, name, dims, lambda s: s["value"], shape))
    names = [(v.group, v.name) for v in variables]
    clash = {n for n in names if names.count(n) > 1}
    if clash:
        raise ValueError(
            f"variables {sorted(clash)} would be written twice (a site is named like another "
            "site's summary); pass max_site_size=None or rename the site."
        )
    return variables, observed


def _summary(fn: Callable[[torch.Tensor], torch.Tensor], site: Mapping[str, Any]) -> torch.Tensor:
    return fn(site["value"])


def _flush(variables: list[_Variable], start: int) -> None:
    """Move the buffered draws of every variable to its host array in one copy."""
    for v in variables:
        if not v.buffer:
            continue
        block = _host(torch.stack(v.buffer))
        assert v.array is not None
        v.array[start : start + len(v.buffer)] = block
        v.buffer.clear()


def _attrs(guide) -> dict[str, str]:
    return {
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "arviz_version": arviz_version(),
        "inference_library": "pyro",
        "inference_library_version": pyro.__version__,
        "creation_library": "pyro_bdl",
        "creation_library_version": __version__,
        "guide": type(guide).__name__,
    }


def mean_predictive_data(probs: torch.Tensor, y: torch.Tensor):
    """ArviZ data for a predictor with no model/guide to draw from: its mean predictive class
    probabilities ``probs`` (n, C) as one draw of ``predictions``, and ``y`` as
    ``observed_data``."""
    check_probs(probs, y)
    probs, y = as_tensor("probs", probs), as_tensor("y", y)
    probs_np = probs.detach().double().cpu().numpy()[None, None]
    dims = ("chain", "draw", "data", "class")
    predictions = xr.Dataset(
        {"probs": xr.DataArray(probs_np, dims=dims)},
        attrs={"note": "the method's predictor exposes no model/guide: mean predictive only"},
    )
    observed = xr.Dataset({"y": xr.DataArray(_host(y), dims=("data",))})
    coords = {"data": np.arange(len(y)), "class": np.arange(probs.shape[1])}
    return package(
        {
            "predictions": predictions.assign_coords(coords),
            "observed_data": observed.assign_coords({"data": coords["data"]}),
        }
    )


def to_inference_data(
    model,
    guide,
    *args,
    num_samples: int = 100,
    num_chains: int = 1,
    var_names: Iterable[str] | None = None,
    batch_size: int = 32,
    max_site_size: int | None = 100_000,
    **kwargs,
):
    """Draw from ``guide``, replay ``model`` on each draw and return ArviZ data.

    :param model: the Pyro model, called as ``model(*args, **kwargs)`` (for example ``model(x,
        y)``; pass ``y`` to get ``log_likelihood`` and ``observed_data``).
    :param guide: any Pyro guide for ``model`` (trained).
    :param int num_samples: draws per chain.
    :param int num_chains: independent chains of draws (guide draws are independent, so several
        chains only serve ArviZ diagnostics that compare chains).
    :param var_names: latent sites to keep in ``posterior`` (default: all that the guide
        samples, plus deterministic sites).
    :param int batch_size: draws gathered on the device before one copy to the host.
    :param max_site_size: sites with more elements keep only per-draw ``_mean``, ``_std`` and
        ``_norm`` summaries (``None`` keeps every site whole).
    :returns: ``arviz.InferenceData`` (ArviZ 0.x) or ``xarray.DataTree`` (ArviZ ≥ 1).
    """
    total = check_positive_int("num_samples", num_samples) * check_positive_int(
        "num_chains", num_chains
    )
    check_positive_int("batch_size", batch_size)
    if max_site_size is not None:
        check_positive_int("max_site_size", max_site_size)
    if isinstance(var_names, str):
        raise TypeError(
            f"var_names must be a list of site names; got the string {var_names!r}. Wrap it in a "
            f"list: var_names=[{var_names!r}]."
        )
    variables: list[_Variable] = []
    observed: dict[str, np.ndarray] = {}
    dims_of: dict[str, tuple[str, ...]] = {}
    start = 0
    # The guide runs for its draws alone, as Predictive runs it: densities masked out (unused
    # here, and a guide that draws its posterior only then, AutoSWAG, does).
    draws_only = poutine.mask(guide, mask=False)
    with torch.no_grad():
        for draw in range(total):
            guide_trace = poutine.trace(draws_only).get_trace(*args, **kwargs)
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
                *args, **kwargs
            )
            if draw == 0:
                variables, observed = _plan(model_trace, guide_trace, var_names, max_site_size)
                for name in observed:
                    dims_of[name] = _site_dims(model_trace.nodes[name], name, observed[name].shape)
            for v in variables:
                value = v.read(model_trace.nodes[v.site])
                if tuple(value.shape) != v.shape:
                    raise ValueError(
                        f"site {v.name!r} changed shape between draws ({v.shape} then "
                        f"{tuple(value.shape)}); the model must have a static structure."
                    )
                if v.array is None:
                    dtype = _host(value).dtype
                    v.array = np.empty((total, *v.shape), dtype=dtype)
                v.buffer.append(value)
            if (draw + 1) % batch_size == 0 or draw + 1 == total:
                _flush(variables, start)
                start = draw + 1
    attrs = _attrs(guide)
    groups: dict[str, dict[str, xr.DataArray]] = {g: {} for g in GROUPS}
    for v in variables:
        assert v.array is not None
        data = v.array.reshape(num_chains, num_samples, *v.shape)
        groups[v.group][v.name] = xr.DataArray(data, dims=("chain", "draw", *v.dims))
    for name, obs in observed.items():
        groups["observed_data"][name] = xr.DataArray(obs, dims=dims_of[name])
    datasets = {}
    for group, arrays in groups.items():
        if not arrays:
            continue
        ds = xr.Dataset(arrays, attrs=attrs)
        coords = {d: np.arange(n) for d, n in ds.sizes.items()}
        datasets[group] = ds.assign_coords(coords)
    return package(datasets)


def save_inference_data(data, path: str | os.PathLike) -> str:
    """Write ``data`` (``InferenceData`` or ``DataTree``) to a netCDF file with ``h5netcdf``;
    returns the path.

    The file is written next to ``path`` under a temporary name and renamed into place, so an
    interrupted save leaves the previous file (or none), never a truncated one, and no
    temporary file.
    """
    path = os.fspath(path)
    if not is_data(data):
        raise TypeError(
            f"data must be arviz.InferenceData or xarray.DataTree; got {type(data).__name__}. "
            "Create it with to_inference_data."
        )
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"path {path!r} is a folder; expected a file name such as "
            f"{os.path.join(path, 'posterior.nc')!r}."
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"the folder of path {path!r} does not exist; create it first "
            f"(os.makedirs({folder!r})) or pass a path in an existing folder."
        )
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        data.to_netcdf(tmp, engine="h5netcdf")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; an export is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_inference_data(path: str | os.PathLike, *, major: int | None = None):
    """Read a file written by :func:`save_inference_data` into memory (``InferenceData`` on
    ArviZ 0.x, ``DataTree`` on ArviZ ≥ 1)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no netCDF file at {path!r}. Check the path, or write the file first with "
            "save_inference_data."
        )
    try:
        return read_netcdf(path, major=major)
    except OSError as err:
        raise ValueError(
            f"{path!r} is not a readable netCDF file ({err}); it is truncated or of another "
            "format. Write it again with save_inference_data."
        ) from err
