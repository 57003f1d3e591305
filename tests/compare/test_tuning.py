"""The fair-tuning protocol (``pyro-bdl compare --tune``): the same grid size for every method,
scored on validation rows carved from the training split, never on the test split."""

import dataclasses
import json
import math

import pytest
import torch

from pyro_bdl.app.cli import main
from pyro_bdl.app.compare import METHODS, Problem, format_table, run, tuning, write_json
from pyro_bdl.app.data import Dataset, load_digits


def _classes(n_train: int = 60, n_test: int = 20) -> Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_test, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return Dataset("toy", x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes=2)


def test_every_method_gets_a_grid_of_the_same_size():
    sizes = {name: math.prod(len(v) for v in grid.values()) for name, grid in tuning.GRIDS.items()}
    assert set(sizes) == set(METHODS)
    assert set(sizes.values()) == {6}


def test_the_search_sees_only_training_rows_and_picks_the_lowest_validation_nll():
    data = _classes()
    problem = Problem(data, progress=False, epochs=1)
    seen: list[Problem] = []

    def fit(p: Problem, **keywords):
        seen.append(p)

        # A predictor whose confidence grows with lr: the largest lr fits the labels best.
        def predict(x):
            right = torch.nn.functional.one_hot((x[:, 0] > 0).long(), 2).float()
            return right * p.lr * 50 + (1 - p.lr * 50) / 2 * torch.ones_like(right)

        return predict

    chosen, keywords, record = tuning.tune("map", fit, problem)
    assert len(seen) == 6 and len(record["grid"]) == 6
    assert record["setting"]["lr"] == max(tuning.LR_GRID) and chosen.lr == max(tuning.LR_GRID)
    assert keywords == {} and chosen.prior.scale == record["setting"]["prior_scale"]
    test_rows = {tuple(r.tolist()) for r in data.x_test}
    for p in seen:
        rows = torch.cat([p.dataset.x_train, p.dataset.x_test])
        assert not test_rows & {tuple(r.tolist()) for r in rows}
        assert len(rows) == len(data.x_train) and p.ood_x is None
    assert record["validation_rows"] == 6  # 10% of 60


def test_a_diverging_setting_scores_inf_and_swag_tunes_its_own_rate():
    problem = Problem(_classes(), progress=False, epochs=1)

    def fit(p: Problem, swa_lr: float):
        if swa_lr == max(tuning.SWA_LR_GRID):
            raise FloatingPointError("diverged")
        return lambda x: torch.tensor([[0.5 + swa_lr, 0.5 - swa_lr]]).expand(len(x), 2)

    _, keywords, record = tuning.tune("swag", fit, problem)
    assert [r["val_nll"] for r in record["grid"]].count(math.inf) == 2  # 2 prior scales
    assert [r.get("error") for r in record["grid"]].count("FloatingPointError: diverged") == 2
    assert keywords["swa_lr"] != max(tuning.SWA_LR_GRID)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="no tuning grid for method 'nope'"):
        tuning.tune("nope", METHODS["map"], Problem(_classes(), progress=False))


def test_the_table_shows_the_chosen_setting():
    row = {"method": "map", "tuned": {"lr": 0.003, "prior_scale": 1.0}}
    assert "lr=0.003, prior_scale=1" in format_table([row])
    assert "tuned setting" not in format_table([{"method": "map"}])


def test_run_with_tune_records_the_choice_and_the_json_the_grids(tmp_path):
    problem = Problem(_classes(), network="mlp", epochs=1, batch_size=64, progress=False)
    (row,) = run(problem, ["map"], tune=True)
    assert row["tuned"] == min(row["tuning"]["grid"], key=lambda r: r["val_nll"])["setting"]
    write_json([row], problem, tmp_path / "r.json", tune=True)
    config = json.loads((tmp_path / "r.json").read_text())["config"]
    assert config["tune"]["grids"]["swag"]["swa_lr"] == list(tuning.SWA_LR_GRID)


@pytest.mark.slow
def test_compare_tune_writes_the_chosen_settings(tmp_path, capsys):
    torch.set_num_threads(1)
    argv = ["compare", "--methods", "map", "--epochs", "1", "--batch-size", "256", "--tune"]
    assert main([*argv, "--num-samples", "2", "--output", str(tmp_path), "--no-progress"]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    (row,) = payload["results"]
    assert row["tuned"] == min(row["tuning"]["grid"], key=lambda r: r["val_nll"])["setting"]
    assert payload["config"]["tune"]["grids"]["map"]["lr"] == list(tuning.LR_GRID)
    assert "tuned setting" in capsys.readouterr().out


@pytest.mark.slow
def test_tuning_never_reads_the_test_split():
    # By construction the search gets a Dataset of training and validation rows only. Poisoning
    # the test split (NaN inputs, out-of-range labels) must change nothing in the search: the
    # same validation NLL for every setting and the same choice, bit for bit.
    torch.set_num_threads(1)
    clean = Problem(load_digits(), epochs=2, batch_size=128, progress=False, num_samples=4)
    data = clean.dataset
    poisoned = dataclasses.replace(
        clean,
        dataset=dataclasses.replace(
            data, x_test=torch.full_like(data.x_test, math.nan), y_test=data.y_test + 100
        ),
    )
    for name in ("map", "meanfield"):
        _, _, a = tuning.tune(name, METHODS[name], clean)
        _, _, b = tuning.tune(name, METHODS[name], poisoned)
        assert a["grid"] == b["grid"] and a["setting"] == b["setting"], name
        assert all(math.isfinite(r["val_nll"]) for r in a["grid"]), name


@pytest.mark.slow
def test_the_tuned_vogn_adam_benchmark_smoke_runs(capsys):
    from benchmarks import tuned_vogn_adam

    tuned_vogn_adam.main(["--seeds", "0", "--smoke"])
    out = capsys.readouterr().out
    for mode in ("tuned", "untuned"):
        for method in tuned_vogn_adam.METHODS:
            assert f"seed 0 {mode:8s} {method:7s} acc" in out
    assert out.count("'lr'") == len(tuned_vogn_adam.METHODS)  # the tuned rows name their choice
