"""The ArviZ compatibility layer on whichever ArviZ is installed (0.x on Python 3.11, 1.x on
Python ≥ 3.12): the same answers through it on both."""

import math

import arviz as az
import numpy as np
import pytest
import xarray as xr
from matplotlib import pyplot
from scipy.special import logsumexp

from pyro_bdl.diagnostics import arviz_compat, export

PNG = b"\x89PNG\r\n\x1a\n"


def _datasets(log_lik: np.ndarray) -> dict[str, xr.Dataset]:
    """posterior, log_likelihood and observed_data groups for ``log_lik`` of shape (chain, draw,
    data), as the export writes them."""
    chains, draws, n = log_lik.shape
    rng = np.random.default_rng(1)
    sample = ("chain", "draw")
    return {
        "posterior": xr.Dataset({"w": ((*sample, "w_dim_0"), rng.normal(size=(chains, draws, 2)))}),
        "log_likelihood": xr.Dataset({"y": ((*sample, "data"), log_lik)}),
        "observed_data": xr.Dataset({"y": (("data",), np.arange(n, dtype=float))}),
    }


def test_the_container_follows_the_installed_arviz():
    datasets = _datasets(np.zeros((1, 4, 3)))
    data = arviz_compat.package(datasets)
    assert arviz_compat.arviz_major() == int(az.__version__.split(".")[0])
    assert isinstance(data, xr.DataTree) == (arviz_compat.arviz_major() >= 1)
    assert arviz_compat.group_names(data) == ("posterior", "log_likelihood", "observed_data")
    for name, ds in datasets.items():
        got = arviz_compat.group(data, name)
        assert isinstance(got, xr.Dataset)
        xr.testing.assert_equal(got, ds)
    smaller = arviz_compat.drop_groups(data, ["log_likelihood"])
    assert type(smaller) is type(data)
    assert arviz_compat.group_names(smaller) == ("posterior", "observed_data")
    assert arviz_compat.group_names(data)[1] == "log_likelihood"  # the input is left as it was
    # A DataTree is accepted on either ArviZ (export(major=1) writes one on 0.x too).
    tree = arviz_compat.package(datasets, major=1)
    assert isinstance(tree, xr.DataTree)
    assert arviz_compat.group_names(arviz_compat.drop_groups(tree, ["posterior"])) == (
        "log_likelihood",
        "observed_data",
    )
    for obj, expected in (
        (data, True),
        (tree, True),
        (datasets, False),
        (datasets["posterior"], False),
    ):
        assert arviz_compat.is_data(obj) is expected


def test_netcdf_round_trip_gives_the_installed_container(tmp_path):
    data = arviz_compat.package(_datasets(np.zeros((2, 3, 4))))
    path = export.save_inference_data(data, tmp_path / "d.nc")
    back = arviz_compat.read_netcdf(path)
    assert type(back) is type(data)
    for name in arviz_compat.group_names(data):
        xr.testing.assert_equal(arviz_compat.group(back, name), arviz_compat.group(data, name))


def test_psislw_shapes_sign_and_tail_shape():
    """Row 0: log ratios of exact Pareto(k = 0.3) ratios, r = U^(-k); row 1: bounded ratios
    (a negative shape). S = 40,000 draws: PSIS fits M = 3√S = 600 tail ratios and sd(k̂) ≈
    (1 + k)/√M = 0.053 at k = 0.3, so ±0.2 is about 4 sd. A sign slip (smoothing the left tail)
    would give row 0 a negative k̂ and row 1 a positive one."""
    rng = np.random.default_rng(0)
    s = 40_000
    rows = np.stack([-0.3 * np.log(rng.uniform(size=s)), rng.uniform(size=s)])
    smoothed, khat = arviz_compat.psislw(rows)
    assert smoothed.shape == rows.shape and khat.shape == (2,)
    assert abs(khat[0] - 0.3) < 0.2
    assert khat[1] < 0
    np.testing.assert_allclose(logsumexp(smoothed, axis=-1), 0.0, atol=1e-9)
    # Smoothing keeps the order of the ratios and leaves the body (below the tail) as it was.
    order = np.argsort(rows[0])
    assert np.all(np.diff(smoothed[0][order]) >= -1e-12)
    body = order[: s - 700]
    np.testing.assert_allclose(
        smoothed[0][body] - smoothed[0][body][0], rows[0][body] - rows[0][body][0], atol=1e-9
    )


@pytest.mark.parametrize(
    "row",
    [np.full(40, 2.5), np.linspace(-1.0, 1.0, 10), np.array([0.3])],
    ids=["flat", "too-few-draws", "one-draw"],  # one draw: ArviZ 0.x raised IndexError
)
def test_psislw_degenerate_rows_give_inf_and_plain_weights(row):
    """No generalized Pareto fit is possible: k̂ = inf and the normalized, unsmoothed weights (ArviZ
    0.x's answer; ArviZ ≥ 1 raises, and the layer gives 0.x's answer there too)."""
    smoothed, khat = arviz_compat.psislw(row)
    assert khat.shape == () and math.isinf(float(khat)) and float(khat) > 0
    np.testing.assert_allclose(smoothed, row - logsumexp(row), atol=1e-12)


def test_loo_agrees_with_psislw_and_reads_the_same_on_both():
    """PSIS-LOO of observation i is log Σ_s w_is p(y_i | θ_s) with w_i the smoothed weights of the
    ratios 1/p(y_i | θ_s); the layer's LOO and its psislw must agree, on either ArviZ."""
    rng = np.random.default_rng(2)
    log_lik = rng.normal(-1.0, 0.7, size=(2, 200, 5))
    data = arviz_compat.package(_datasets(log_lik))
    summary = arviz_compat.loo_summary(arviz_compat.loo(data, pointwise=True))
    draws = log_lik.reshape(400, 5).T  # (data, sample)
    smoothed, khat = arviz_compat.psislw(-draws)
    expected_i = logsumexp(smoothed + draws, axis=-1)
    assert summary.elpd_i is not None and summary.pareto_k is not None
    assert summary.elpd_i.dims == ("data",) and summary.pareto_k.dims == ("data",)
    np.testing.assert_allclose(summary.elpd_i.values, expected_i, rtol=1e-10)
    np.testing.assert_allclose(summary.pareto_k.values, khat, rtol=1e-10)
    assert summary.elpd == pytest.approx(expected_i.sum(), rel=1e-10)
    lppd = logsumexp(draws, axis=-1, b=1 / 400).sum()
    assert summary.p == pytest.approx(lppd - summary.elpd, rel=1e-8)
    assert summary.se > 0


def test_loo_with_a_point_mass_is_exact_and_flags_every_point():
    """Every draw the same: each LOO density is exactly p(y_i | θ) and no tail can be fitted
    (k̂ = inf), the same on ArviZ 0.x and ≥ 1 (which alone would raise)."""
    values = np.array([-0.5, -1.25, -2.0])
    data = arviz_compat.package(_datasets(np.broadcast_to(values, (1, 8, 3)).copy()))
    summary = arviz_compat.loo_summary(arviz_compat.loo(data, pointwise=True))
    np.testing.assert_allclose(summary.elpd_i.values, values, rtol=1e-12)
    assert summary.elpd == pytest.approx(values.sum(), rel=1e-12)
    assert summary.p == pytest.approx(0.0, abs=1e-12)
    assert np.isposinf(summary.pareto_k.values).all()


def test_plots_write_png_and_leave_no_pyplot_figure(tmp_path):
    rng = np.random.default_rng(3)
    datasets = _datasets(rng.normal(-1.0, 0.3, size=(1, 40, 6)))
    datasets["posterior_predictive"] = xr.Dataset(
        {"y": (("chain", "draw", "data"), rng.normal(size=(1, 40, 6)))}
    )
    data = arviz_compat.package(datasets)
    before = pyplot.get_fignums()
    paths = [
        arviz_compat.plot_ppc(data, tmp_path / "ppc.png", num_samples=20),
        arviz_compat.plot_khat(arviz_compat.loo(data), tmp_path / "khat.png"),
        arviz_compat.plot_forest(data, ["w"], tmp_path / "forest.png"),
    ]
    assert [p.name for p in paths] == ["ppc.png", "khat.png", "forest.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG
    assert pyplot.get_fignums() == before
