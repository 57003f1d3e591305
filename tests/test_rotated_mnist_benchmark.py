"""Smoke test of benchmarks/rotated_mnist.py on a few scikit-learn digits: every angle is scored
for each method, and the JSON and the plot are written (the figures themselves are not checked)."""

import json

import pytest

from benchmarks import common, laplace_quality, rotated_mnist


def test_smoke_run_writes_every_angle_and_the_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    out = rotated_mnist.main(["--smoke", "--methods", "map,ensemble", "--n-train", "80"])
    assert set(out["results"]) == {"map", "ensemble"}
    saved = json.loads((tmp_path / "rotated_mnist_smoke.json").read_text())
    assert saved["config"]["angles"] == list(laplace_quality.ANGLES)
    assert saved["config"]["n_train"] == 80
    for row in saved["figures"].values():
        for metric in rotated_mnist.METRICS:
            assert len(row[metric]) == len(laplace_quality.ANGLES)
            assert all(0 <= v for v in row[metric])
    assert (tmp_path / "rotated_mnist_smoke.png").stat().st_size > 0


def test_every_compare_method_and_both_ensembles_are_in_the_default_run():
    assert {"ensemble", "multiswag", "map", "swag"} <= set(rotated_mnist.ALL_METHODS)
    with pytest.raises(ValueError, match="unknown methods"):
        rotated_mnist.run(None, ["nope"], epochs=1)  # type: ignore[arg-type]
