"""benchmarks/mnist_table.py on scikit-learn's digits (``--quick``): every method is scored at
every seed, the JSON holds the table and the wins, and the test split never reaches a choice."""

import dataclasses
import json
import math

import torch

from benchmarks import mnist_table

FIGURES = ("accuracy", "nll", "ece", "ood_auroc", "epoch_s")


def test_quick_run_scores_every_method_and_writes_the_table(tmp_path):
    out = tmp_path / "table.json"
    mnist_table.main(["--quick", "--seeds", "0,1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == set(mnist_table.METHODS)
    for name, per_seed in saved["results"].items():
        assert set(per_seed) == {"0", "1"}, name
        for row in per_seed.values():
            assert 0 <= row["accuracy"] <= 1 and 0 <= row["ece"] <= 1
            assert 0 <= row["ood_auroc"] <= 1 and row["nll"] > 0 and row["epoch_s"] > 0
            assert len(row["grid"]) == mnist_table.CANDIDATES, name
            assert row["setting"] in [g["setting"] for g in row["grid"]]
    for name in mnist_table.METHODS:
        for metric in FIGURES:
            cell = saved["table"][name][metric]
            assert math.isfinite(cell["mean"]) and math.isfinite(cell["se"]), (name, metric)
    assert set(saved["wins"]) == set(FIGURES)
    for entry in saved["wins"].values():
        assert entry["best"] in mnist_table.METHODS and isinstance(entry["within_1se"], bool)
    assert saved["statement"].count(";") == len(FIGURES) - 1
    assert saved["config"]["network"] == "MLP 64-16-16-10"
    assert not out.with_name(out.name + ".tmp").exists()  # written by rename


def _choices(payload: dict) -> dict:
    return {
        (name, seed): (row["setting"], [g["val_nll"] for g in row["grid"]])
        for name, per_seed in payload["results"].items()
        for seed, row in per_seed.items()
    }


def test_the_test_split_never_reaches_a_choice():
    """Filling the test rows (and so the rotated OOD set) with NaN leaves every chosen setting
    and every validation score as they were; only the test figures become NaN."""

    def poisoned(x, y, seed):
        splits = mnist_table.split(x, y, seed)
        return dataclasses.replace(splits, x_test=torch.full_like(splits.x_test, math.nan))

    _, x, y = mnist_table.load(None, quick=True)
    settings = mnist_table.Settings(epochs=1, hidden=16, num_samples=4, members=2)
    clean = mnist_table.run(x, y, seeds=(0,), settings=settings)
    blind = mnist_table.run(x, y, seeds=(0,), settings=settings, split_fn=poisoned)
    assert _choices(blind) == _choices(clean)
    for per_seed in blind["results"].values():
        assert math.isnan(per_seed["0"]["nll"]) and math.isnan(per_seed["0"]["ood_auroc"])
    for per_seed in clean["results"].values():
        assert math.isfinite(per_seed["0"]["nll"])


def test_the_map_family_shares_one_job_per_seed():
    jobs = mnist_table.jobs_for(["vogn", "laplace", "map"], [0, 1])
    assert jobs == [
        (("map", "laplace"), 0),
        (("vogn",), 0),
        (("map", "laplace"), 1),
        (("vogn",), 1),
    ]
