"""End to end: ``pyro-bdl compare`` trains, prints the table, and writes JSON, .nc and plots."""

import json

import numpy as np
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_bdl.app.cli import _ood_data, main
from pyro_bdl.app.compare import METHODS, Problem
from pyro_bdl.app.compare.evaluate import POINT_MASS_NOTE, evaluate, format_table, run
from pyro_bdl.app.compare.problem import attach_posterior
from pyro_bdl.app.data import hold_out_classes, load_digits, load_ood
from pyro_bdl.diagnostics import load_inference_data
from pyro_bdl.diagnostics.arviz_compat import group_names

PNG = b"\x89PNG\r\n\x1a\n"


def test_compare_map_writes_table_json_netcdf_and_plots(tmp_path, capsys):
    torch.set_num_threads(1)
    argv = ["compare", "--methods", "map", "--epochs", "1", "--batch-size", "256"]
    argv += ["--num-samples", "4", "--output", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for header in ("accuracy", "test NLL", "ECE", "Brier", "OOD AUROC", "fit time (s)"):
        assert header in out
    assert "OOD data: held-out classes 8, 9" in out and "8 classes" in out

    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["config"]["ood"] == "held-out classes 8, 9"
    assert payload["config"]["num_classes"] == 8
    (row,) = payload["results"]
    assert row["method"] == "map"
    for key in ("accuracy", "ece", "ood_auroc", "ood_fpr95"):
        assert 0.0 <= row[key] <= 1.0
    assert 0.0 <= row["brier"] <= 2.0 and row["nll"] > 0

    nc = tmp_path / "map.nc"
    assert str(nc) in out  # the command says where the files are
    data = load_inference_data(nc)
    assert set(group_names(data)) >= {"posterior", "posterior_predictive", "log_likelihood"}
    assert data.log_likelihood["y"].shape == (1, 4, payload["config"]["n_test"])
    names = {"map-reliability.png", "map-entropy.png", "map-ppc.png", "map-forest.png"}
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == PNG
        assert name in out
    assert sorted(row["files"]) == sorted([str(nc)] + [str(tmp_path / n) for n in names])
    # A point estimate's LOO-k̂ plot would be blank: it is left out, and the row says why.
    assert not (tmp_path / "map-loo-khat.png").exists()
    assert row["notes"] == [POINT_MASS_NOTE]
    assert row["lr"] == payload["config"]["lr"] == 1e-3
    assert len(row["reliability"]["counts"]) == 15 and row["reliability"]["ece"] == row["ece"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ood-classes", "eight"], "comma-separated integers"),
        (["--ood-classes", "3,12"], "must lie in [0, 10)"),
        (["--ood", "/nonexistent/ood.npy"], "does not exist"),
        (["--methods", "nope"], "unknown method"),
    ],
)
def test_bad_options_fail_before_training(tmp_path, capsys, argv, message):
    assert main(["compare", "--output", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_hold_out_classes_keeps_a_sensible_task():
    digits = load_digits()
    inside, x_ood = hold_out_classes(digits, [9, 8])
    assert inside.num_classes == 8 and inside.info["class_names"] == list(range(8))
    assert set(inside.y_train.tolist()) == set(range(8))
    n_held = int(np.isin(digits.y_train, [8, 9]).sum() + np.isin(digits.y_test, [8, 9]).sum())
    assert len(x_ood) == n_held and x_ood.shape[1:] == digits.x_train.shape[1:]
    assert len(inside.y_train) + len(inside.y_test) + n_held == 1797
    # Relabelling keeps the remaining classes in order: held out 0 → old 1 becomes 0.
    shifted, _ = hold_out_classes(digits, [0])
    assert torch.equal(shifted.y_test, digits.y_test[digits.y_test != 0] - 1)
    with pytest.raises(ValueError, match="at least two"):
        hold_out_classes(digits, range(1, 10))
    with pytest.raises(ValueError, match="empty"):
        hold_out_classes(digits, [])


def test_load_ood_files(tmp_path):
    x = np.random.default_rng(0).random((5, 64))
    np.save(tmp_path / "a.npy", x)
    np.savez(tmp_path / "b.npz", x=x, y=np.zeros(5))
    torch.save({"x": torch.as_tensor(x)}, tmp_path / "c.pt")
    for name in ("a.npy", "b.npz", "c.pt"):
        got = load_ood(tmp_path / name, (1, 8, 8))
        assert got.shape == (5, 1, 8, 8) and got.dtype == torch.float32
        np.testing.assert_allclose(got.reshape(5, -1).numpy(), x, rtol=1e-6)
    np.save(tmp_path / "bad.npy", np.zeros((5, 10)))
    with pytest.raises(ValueError, match="64 values per row"):
        load_ood(tmp_path / "bad.npy", (1, 8, 8))
    np.save(tmp_path / "nan.npy", np.full((2, 64), np.nan))
    with pytest.raises(ValueError, match="non-finite"):
        load_ood(tmp_path / "nan.npy", (1, 8, 8))
    (tmp_path / "d.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match=r"\.npy, \.npz or \.pt"):
        load_ood(tmp_path / "d.txt", (1, 8, 8))


def _digits_problem():
    digits, x_ood = hold_out_classes(load_digits(), [8, 9])
    return Problem(digits, epochs=1, num_samples=3, progress=False, ood_x=x_ood, ood_name="8, 9")


def test_export_uses_attached_posterior_or_falls_back_to_the_mean(tmp_path, monkeypatch):
    """A predictor that does not call predictive_probs is exported fully when it carries its
    model and guide, and as its mean predictive otherwise."""

    def attached(problem):
        _, model = problem.bayesian_model()
        guide = AutoNormal(model)
        return attach_posterior(lambda x: torch.full((len(x), 8), 1 / 8), model, guide)

    def bare(problem):
        return lambda x: torch.full((len(x), 8), 1 / 8)

    monkeypatch.setitem(METHODS, "attached", attached)
    monkeypatch.setitem(METHODS, "bare", bare)
    rows = run(_digits_problem(), ["attached", "bare"], output=tmp_path)
    full = load_inference_data(tmp_path / "attached.nc")
    assert {"posterior", "log_likelihood"} <= set(group_names(full))
    mean_only = load_inference_data(tmp_path / "bare.nc")
    assert set(group_names(mean_only)) == {"predictions", "observed_data"}
    np.testing.assert_allclose(mean_only.predictions["probs"].values, 1 / 8)
    # Uniform predictions: chance-level OOD detection and maximal entropy everywhere.
    assert rows[1]["ood_auroc"] == 0.5 and rows[1]["ece"] == pytest.approx(
        abs(1 / 8 - rows[1]["accuracy"])
    )
    assert not any(f.endswith("ppc.png") for f in rows[1]["files"])


def test_evaluate_without_ood():
    probs = torch.eye(3, dtype=torch.float64)
    row = evaluate(probs, torch.arange(3))
    assert row["accuracy"] == 1.0 and row["ood_auroc"] is None
    assert "n/a" in format_table([{"method": "m", **row, "fit_seconds": 1.0}])


def test_ood_option_choices(tmp_path):
    digits = load_digits()
    same, x_ood, name = _ood_data(digits, "none", "8,9")
    assert same is digits and x_ood is None and name == ""
    np.save(tmp_path / "ood.npy", np.zeros((3, 64)))
    same, x_ood, name = _ood_data(digits, str(tmp_path / "ood.npy"), "8,9")
    assert same.num_classes == 10 and x_ood.shape == (3, 1, 8, 8) and "ood.npy" in name
    inside, x_ood, name = _ood_data(digits, "held-out", "9")
    assert inside.num_classes == 9 and name == "held-out classes 9"
