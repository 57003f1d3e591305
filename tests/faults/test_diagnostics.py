"""Fault injection against the diagnostics (issue class 6, obscure errors).

Every public metric, OOD figure, temperature fit and the Pareto k̂ refuses NaN/inf inputs,
probabilities that are not probability vectors, labels out of range and mismatched lengths with
a ``ValueError``/``TypeError`` that names the argument, shows expected vs actual and proposes a
fix that fits where the values came from (non-finite predictions come from the predictor, not
from the data). A refusal changes neither its inputs nor any global RNG state.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xarray as xr

from pyro_bdl.diagnostics import arviz_compat, metrics, ood, psis, temperature
from tests.faults.common import assert_same, rng_states

NAN = float("nan")
INF = float("inf")


def snapshot(*objects) -> dict:
    """The global RNG states and a copy of each tensor in ``objects``."""
    return {
        "rng": rng_states(),
        "objects": [torch.as_tensor(o).clone() for o in objects],
    }


def _probs(rows=((0.7, 0.3), (0.2, 0.8))):
    return torch.tensor(rows, dtype=torch.float64)


Y = torch.tensor([0, 1])
NAN_PROBS = _probs(((NAN, 0.5), (0.2, 0.8)))
SHORT_ROWS = _probs(((0.2, 0.2), (0.2, 0.8)))
NEGATIVE = _probs(((1.5, -0.5), (0.2, 0.8)))
CLASSIFIERS = {
    "accuracy": metrics.accuracy,
    "nll": metrics.nll,
    "brier": metrics.brier,
    "ece": metrics.ece,
    "reliability": metrics.reliability,
}

# (probs, y, error type, texts the message must contain)
BAD_CLASSIFICATION = [
    (NAN_PROBS, Y, ValueError, ["probs", "non-finite", "index (0, 0)", "predictor"]),
    (_probs(((INF, 0.0), (0.2, 0.8))), Y, ValueError, ["probs", "non-finite", "predictor"]),
    (SHORT_ROWS, Y, ValueError, ["row 0 sums to 0.4", "softmax(logits)"]),
    (NEGATIVE, Y, ValueError, ["row 0", "minimum -0.5"]),
    (_probs(), torch.tensor([0, 2]), ValueError, ["labels y must lie in [0, 2)", "max 2"]),
    (_probs(), torch.tensor([-1, 0]), ValueError, ["labels y must lie in [0, 2)", "min -1"]),
    (_probs(), torch.tensor([0, 1, 1]), ValueError, ["shape (2,)", "got (3,)"]),
    (_probs(), torch.tensor([0.0, 1.0]), TypeError, ["labels y must be integers", "y.long()"]),
    (_probs()[0], Y, ValueError, ["shape (n, C)", "unsqueeze(0)"]),
    (_probs().expand(3, 2, 2), Y, ValueError, ["shape (n, C)", "probs.mean(0)"]),
    (torch.zeros(0, 2, dtype=torch.float64), Y[:0], ValueError, ["zero rows"]),
    (torch.tensor([[1, 0], [0, 1]]), Y, TypeError, ["probs must be floating point"]),
    ("probs", Y, TypeError, ["probs must be a torch.Tensor or numpy array", "str"]),
]


@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
@pytest.mark.parametrize("probs, y, error, texts", BAD_CLASSIFICATION)
def test_classification_metrics_refuse_bad_inputs(name, probs, y, error, texts):
    before = snapshot(*(t for t in (probs, y) if isinstance(t, torch.Tensor)))
    with pytest.raises(error) as info:
        CLASSIFIERS[name](probs, y)
    for text in texts:
        assert text in str(info.value), str(info.value)
    assert "Clean or impute the data" not in str(info.value)  # the wrong fix for predictions
    assert_same(before, snapshot(*(t for t in (probs, y) if isinstance(t, torch.Tensor))))


@pytest.mark.parametrize(
    "call, texts",
    [
        (lambda: metrics.nll(_probs(), Y, eps=-1.0), ["eps must be a number in (0, 1)", "-1"]),
        (lambda: metrics.nll(_probs(), Y, eps=NAN), ["eps", "nan"]),
        (lambda: metrics.nll(_probs(), Y, eps=1.0), ["eps", "1e-12"]),
        (lambda: metrics.check_probs(_probs(), atol=NAN), ["atol must be", "nan"]),
        (lambda: metrics.check_probs(_probs(), atol=-0.1), ["atol must be", "-0.1"]),
        (lambda: metrics.ece(_probs(), Y, num_bins=0), ["num_bins must be >= 1", "got 0"]),
    ],
)
def test_metric_options_refused(call, texts):
    with pytest.raises(ValueError) as info:
        call()
    for text in texts:
        assert text in str(info.value)


@pytest.mark.parametrize(
    "call, texts",
    [
        (lambda: metrics.rmse(torch.tensor([NAN, 0.0]), torch.zeros(2)), ["mean", "predictor"]),
        (lambda: metrics.rmse(torch.zeros(2), torch.tensor([0.0, INF])), ["y", "targets"]),
        (lambda: metrics.rmse(torch.zeros(3), torch.zeros(2)), ["shape (2,)", "got (3,)"]),
        (lambda: metrics.rmse(torch.zeros(2), torch.zeros(2), y_scale=INF), ["y_scale", "inf"]),
        (
            lambda: metrics.gaussian_log_likelihood(torch.zeros(2), NAN, torch.zeros(2)),
            ["scale", "σ > 0"],
        ),
        (
            lambda: metrics.gaussian_log_likelihood(torch.zeros(2), -1.0, torch.zeros(2)),
            ["scale must be finite and > 0", "-1.0"],
        ),
    ],
)
def test_regression_metrics_refuse_bad_inputs(call, texts):
    with pytest.raises(ValueError) as info:
        call()
    for text in texts:
        assert text in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "call, error, texts",
    [
        (lambda: ood.auroc([0.1, NAN], [0.2]), ValueError, ["scores_in", "index (1,)", "finite"]),
        (lambda: ood.auroc([0.1], [INF]), ValueError, ["scores_out", "non-finite"]),
        (lambda: ood.auroc([], [0.2]), ValueError, ["scores_in must have shape (n,)", "(0,)"]),
        (lambda: ood.auroc([[0.1]], [0.2]), ValueError, ["scores_in", "(1, 1)"]),
        (lambda: ood.auroc([True], [0.2]), TypeError, ["scores_in must be real"]),
        (
            lambda: ood.ood_auroc(_probs(), NAN_PROBS),
            ValueError,
            ["probs_out", "non-finite", "predictor"],
        ),
        (lambda: ood.ood_auroc(SHORT_ROWS, _probs()), ValueError, ["probs_in", "sums to 0.4"]),
        (
            lambda: ood.ood_auroc(_probs(), torch.full((2, 3), 1 / 3, dtype=torch.float64)),
            ValueError,
            ["same number of classes", "2 and 3"],
        ),
        (lambda: ood.fpr_at_tpr([0.1], [0.2], tpr=NAN), ValueError, ["tpr must lie in (0, 1]"]),
        (lambda: ood.fpr_at_95_tpr(_probs(), _probs(), tpr=0), ValueError, ["tpr", "got 0"]),
        (lambda: ood.ood_scores(_probs(), score="energy"), ValueError, ["score", "'entropy'"]),
        (lambda: ood.predictive_entropy(NEGATIVE), ValueError, ["probability vector"]),
    ],
)
def test_ood_figures_refuse_bad_inputs(call, error, texts):
    with pytest.raises(error) as info:
        call()
    for text in texts:
        assert text in str(info.value), str(info.value)


LOGITS = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize(
    "call, error, texts",
    [
        (
            lambda: temperature.fit_temperature(LOGITS.index_fill(1, torch.tensor([0]), NAN), Y),
            ValueError,
            ["logits", "non-finite", "network produced them"],
        ),
        (
            lambda: temperature.fit_temperature(LOGITS, torch.tensor([0, 1, 5])),
            ValueError,
            ["labels y must lie in [0, 2)", "max 5"],
        ),
        (
            lambda: temperature.fit_temperature(LOGITS, Y),
            ValueError,
            ["labels y must have shape (3,)", "got (2,)"],
        ),
        (
            lambda: temperature.fit_temperature(LOGITS, torch.tensor([0.0, 1.0, 1.0])),
            TypeError,
            ["labels y must be integers"],
        ),
        (
            lambda: temperature.fit_temperature(LOGITS, torch.tensor([0, 1, 1]), prior_shape=NAN),
            ValueError,
            ["prior_shape", "nan"],
        ),
        (
            lambda: temperature.fit_temperature(LOGITS, torch.tensor([0, 1, 1]), prior_shape=1.0),
            ValueError,
            ["prior_shape must be > 1"],
        ),
        (
            lambda: temperature.fit_temperature(LOGITS.softmax(-1)[:, :1], Y[:3]),
            ValueError,
            ["at least 2 classes"],
        ),
        (
            lambda: temperature.temperature_scale(LOGITS, NAN),
            ValueError,
            ["temperature must be finite and > 0", "fit_temperature"],
        ),
        (
            lambda: temperature.temperature_scale(LOGITS, -1.0),
            ValueError,
            ["temperature", "-1.0"],
        ),
        (
            lambda: temperature.temperature_scale(torch.tensor([[INF, 0.0]]), 1.0),
            ValueError,
            ["logits", "non-finite"],
        ),
    ],
)
def test_temperature_refuses_bad_inputs(call, error, texts):
    before = snapshot(LOGITS)
    with pytest.raises(error) as info:
        call()
    for text in texts:
        assert text in str(info.value), str(info.value)
    assert_same(before, snapshot(LOGITS))


def test_pareto_khat_all_minus_inf_is_a_clear_error():
    """Every draw of zero weight: no k̂ is honest, so say why and what to check (it was
    (inf, nan) before, a figure a user could not act on)."""
    ratios = torch.full((100,), -math.inf, dtype=torch.float64)
    before = snapshot(ratios)
    with pytest.raises(ValueError) as info:
        psis.pareto_khat(ratios)
    message = str(info.value)
    assert "every one of the 100 log_ratios is -inf" in message
    assert "zero weight" in message and "support" in message
    assert_same(before, snapshot(ratios))


def test_pareto_khat_some_minus_inf_is_allowed():
    """A few draws of zero weight are a legal importance sample; k̂ and the ESS stay finite."""
    ratios = torch.cat([torch.full((10,), -math.inf), torch.linspace(-1.0, 1.0, 990)])
    khat, ess = psis.pareto_khat(ratios.double())
    assert math.isfinite(khat) and 1.0 <= ess <= 990.0


@pytest.mark.parametrize(
    "log_ratios, kwargs, error, texts",
    [
        (torch.tensor([0.0, NAN, 1.0]), {}, ValueError, ["NaN or +inf", "support"]),
        (torch.tensor([0.0, INF, 1.0]), {}, ValueError, ["NaN or +inf"]),
        (torch.zeros(0), {}, ValueError, ["shape (num_samples,)", "(0,)"]),
        (torch.zeros(3, 2), {}, ValueError, ["shape (num_samples,)", "(3, 2)"]),
        (torch.tensor([1, 2, 3]), {}, TypeError, ["floating point", "int64"]),
        ("ratios", {}, TypeError, ["log_ratios must be a torch.Tensor", "str"]),
        (torch.randn(50), {"rtol": -1.0}, ValueError, ["rtol must be a finite number >= 0"]),
        (torch.randn(50), {"rtol": NAN}, ValueError, ["rtol", "nan"]),
    ],
)
def test_pareto_khat_refuses_bad_inputs(log_ratios, kwargs, error, texts):
    with pytest.raises(error) as info:
        psis.pareto_khat(log_ratios, **kwargs)
    for text in texts:
        assert text in str(info.value), str(info.value)


def test_psis_khat_options_refused():
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        psis.psis_khat(lambda: None, lambda: None, num_samples=0)
    with pytest.raises(ValueError, match="max_plate_nesting"):
        psis.psis_khat(lambda: None, lambda: None, vectorize=True)


def test_loo_without_log_likelihood_names_the_fix():
    posterior = xr.Dataset({"w": (("chain", "draw"), np.zeros((1, 5)))})
    data = arviz_compat.package({"posterior": posterior})
    with pytest.raises(ValueError, match=r"to_inference_data\(model, guide, x, y\)"):
        psis.loo(data)


def test_loo_of_one_draw_names_the_fix():
    # One draw leaves nothing to leave out: ArviZ 0.x raised IndexError from inside its PSIS.
    log_likelihood = xr.Dataset({"y": (("chain", "draw", "data"), np.zeros((1, 1, 4)))})
    data = arviz_compat.package({"log_likelihood": log_likelihood})
    with pytest.raises(ValueError, match=r"1 draw\(s\).*at least 2.*num_samples"):
        psis.loo(data)


# ----- the ArviZ export and the plots -----------------------------------------------------------


@pytest.mark.parametrize(
    "probs, y, texts",
    [
        (NAN_PROBS, Y, ["probs", "non-finite", "predictor"]),
        (_probs(), torch.tensor([0, 1, 1]), ["shape (2,)", "got (3,)"]),
        (_probs(), torch.tensor([0, 4]), ["labels y must lie in [0, 2)"]),
        (SHORT_ROWS, Y, ["sums to 0.4"]),
    ],
)
def test_mean_predictive_data_refuses_bad_inputs(probs, y, texts):
    from pyro_bdl.diagnostics import export

    with pytest.raises(ValueError) as info:
        export.mean_predictive_data(probs, y)
    for text in texts:
        assert text in str(info.value), str(info.value)


def _files(folder):
    return sorted((p.name, p.read_bytes()) for p in folder.iterdir())


def test_save_inference_data_refuses_a_folder_or_missing_parent(tmp_path):
    from pyro_bdl.diagnostics import export

    data = export.mean_predictive_data(_probs(), Y)
    with pytest.raises(IsADirectoryError, match="is a folder; expected a file name"):
        export.save_inference_data(data, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist; create it first"):
        export.save_inference_data(data, tmp_path / "missing" / "x.nc")
    with pytest.raises(TypeError, match="to_inference_data"):
        export.save_inference_data({"probs": 1}, tmp_path / "x.nc")
    assert _files(tmp_path) == []


def test_interrupted_save_keeps_the_previous_file(tmp_path, monkeypatch):
    """A save interrupted between writing and renaming (a kill, Ctrl-C) leaves the previous
    export whole and no temporary file."""
    from pyro_bdl.diagnostics import export

    path = tmp_path / "m.nc"
    export.save_inference_data(export.mean_predictive_data(_probs(), Y), path)
    before = _files(tmp_path)

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(export.os, "replace", interrupted)
    flipped = _probs(((0.1, 0.9), (0.9, 0.1)))
    with pytest.raises(KeyboardInterrupt):
        export.save_inference_data(export.mean_predictive_data(flipped, Y), path)
    monkeypatch.undo()
    assert _files(tmp_path) == before
    loaded = export.load_inference_data(path)
    np.testing.assert_allclose(loaded.predictions["probs"].values[0, 0], _probs().numpy())


def test_load_of_a_truncated_file_names_the_fix(tmp_path):
    from pyro_bdl.diagnostics import export

    path = tmp_path / "m.nc"
    export.save_inference_data(export.mean_predictive_data(_probs(), Y), path)
    path.write_bytes(path.read_bytes()[:100])  # what a non-atomic killed save would leave
    with pytest.raises(ValueError, match=r"not a readable netCDF file.*save_inference_data"):
        export.load_inference_data(path)


def test_plot_entropy_refuses_non_finite():
    from pyro_bdl.diagnostics import plots

    with pytest.raises(ValueError, match=r"entropy \(out-of-distribution\) contains 1 non-finite"):
        plots.plot_entropy(torch.tensor([0.1, 0.2]), torch.tensor([NAN]))
