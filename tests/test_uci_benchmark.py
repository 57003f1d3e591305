"""``benchmarks/uci.py`` on any folder in the standard UCI split format: the command line, the
loader, the errors for a missing or malformed folder, the split selection and the anchor table.
Everything runs on a tiny generated folder; the real benchmark is not run here."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from benchmarks import uci
from pyro_bdl.app import data


def make_folder(root, name="toy", *, rows=24, splits=3, n_hidden=8, n_splits_file=True):
    """A dataset folder in the standard format: 3 inputs and a target in column 3, ``splits``
    splits of 18 train / 6 test rows, n_hidden.txt and MC dropout's n_epochs.txt."""
    folder = root / name
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=rows) + 10.0
    np.savetxt(folder / "data.txt", np.column_stack([x, y]))
    (folder / "index_features.txt").write_text("0\n1\n2\n")
    (folder / "index_target.txt").write_text("3\n")
    for k in range(splits):
        order = np.random.default_rng(k).permutation(rows)
        np.savetxt(folder / f"index_train_{k}.txt", order[6:], fmt="%d")
        np.savetxt(folder / f"index_test_{k}.txt", order[:6], fmt="%d")
    if n_splits_file:
        (folder / "n_splits.txt").write_text(f"{splits}\n")
    if n_hidden is not None:
        (folder / "n_hidden.txt").write_text(f"{n_hidden}\n")
    (folder / "n_epochs.txt").write_text("40\n")  # MC dropout's setting: ignored
    return folder


# ----------------------------------------------------------------------------- the loader


def test_loader_reads_a_standard_folder_with_its_hidden_width(tmp_path):
    make_folder(tmp_path / "uci")
    spec = data.uci_folder("toy", tmp_path)
    assert (spec.n_splits, spec.n_hidden) == (3, 8)
    d = data.load_uci("toy", tmp_path, split=2)
    assert d.x_train.shape == (18, 3) and d.y_test.shape == (6,)
    assert d.info["n_hidden"] == 8 and d.info["n_splits"] == 3 and d.info["split"] == 2
    # Standardised with the training rows' statistics.
    assert torch.allclose(d.x_train.mean(0), torch.zeros(3), atol=1e-5)
    assert float(d.y_train.mean()) == pytest.approx(0.0, abs=1e-5)


def test_loader_defaults_and_layouts(tmp_path):
    # No n_hidden.txt: the protocol's 50; no n_splits.txt: the consecutive split files counted.
    make_folder(tmp_path, "plain", splits=2, n_hidden=None, n_splits_file=False)
    spec = data.uci_folder("plain", tmp_path)
    assert (spec.n_splits, spec.n_hidden) == (2, data.UCI_DEFAULT_HIDDEN)
    # The MC-dropout repository's layout: the files in NAME/data/.
    make_folder(tmp_path / "nested", "data")
    assert data.uci_datasets(tmp_path) == ["nested", "plain"]
    assert data.load_uci("nested", tmp_path, split=1).info["n_hidden"] == 8


def test_a_missing_dataset_lists_the_folders_found(tmp_path):
    make_folder(tmp_path / "uci", "alpha")
    make_folder(tmp_path / "uci", "beta")
    with pytest.raises(FileNotFoundError, match=r"'gamma'.*\['alpha', 'beta'\]"):
        data.uci_folder("gamma", tmp_path)


@pytest.mark.parametrize("missing", ["data.txt", "index_target.txt", "index_test_0.txt"])
def test_a_malformed_folder_names_the_missing_file(tmp_path, missing):
    folder = make_folder(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        data.load_uci("toy", tmp_path)


def test_bad_contents_are_named(tmp_path):
    folder = make_folder(tmp_path)
    (folder / "n_hidden.txt").write_text("fifty\n")
    with pytest.raises(ValueError, match=r"n_hidden\.txt.*one positive integer"):
        data.uci_folder("toy", tmp_path)
    (folder / "n_hidden.txt").write_text("8\n")
    (folder / "index_test_1.txt").write_text("0\n99\n")  # row 99 of 24
    with pytest.raises(ValueError, match=r"index_test_1\.txt.*\[0, 24\)"):
        data.load_uci("toy", tmp_path, split=1)
    with pytest.raises(ValueError, match=r"split must lie in \[0, 3\)"):
        data.load_uci("toy", tmp_path, split=3)


# ----------------------------------------------------------------------------- the command line


def test_splits_accepts_a_count_a_list_and_a_range():
    assert uci.parse_splits("3") == 3
    assert uci.parse_splits("0,3,5") == [0, 3, 5]
    assert uci.parse_splits("0-4") == [0, 1, 2, 3, 4]
    assert uci.parse_splits("5-5,0-1,1") == [0, 1, 5]
    for bad, message in (("0", "at least 1"), ("4-2", "ends before"), ("a", "'a'"), ("1,", "''")):
        with pytest.raises(ValueError, match=message):
            uci.parse_splits(bad)
    assert uci.select_splits(None, 4, "toy") == [0, 1, 2, 3]
    assert uci.select_splits(2, 4, "toy") == [0, 1]
    assert uci.select_splits([1, 3], 4, "toy") == [1, 3]
    with pytest.raises(ValueError, match="'toy' has 4"):
        uci.select_splits(5, 4, "toy")
    with pytest.raises(ValueError, match=r"\[4\].*0-3"):
        uci.select_splits([1, 4], 4, "toy")


def test_the_cli_parses_datasets_repeated_or_listed():
    args = uci.build_parser().parse_args(
        ["--dataset", "a", "b,c", "--datasets", "a", "--splits", "0-1", "--quick"]
    )
    assert uci._names(args.datasets) == ["a", "b", "c"]
    assert args.splits == [0, 1] and args.quick
    assert uci._names(uci.build_parser().parse_args([]).datasets) == list(uci.DATASETS)
    with pytest.raises(SystemExit):
        uci.build_parser().parse_args(["--splits", "x"])


def test_main_reports_a_missing_dataset_and_a_missing_split_file(tmp_path, capsys):
    folder = make_folder(tmp_path / "uci")
    with pytest.raises(SystemExit):
        uci.main(["--dataset", "nope", "--data-dir", str(tmp_path)])
    assert "['toy']" in capsys.readouterr().err
    (folder / "index_train_2.txt").unlink()  # n_splits.txt still says 3
    with pytest.raises(SystemExit):
        uci.main(["--dataset", "toy", "--splits", "1-2", "--data-dir", str(tmp_path)])
    assert "index_train_2.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        uci.main(["--dataset", "toy", "--splits", "4", "--data-dir", str(tmp_path)])
    assert "has 3" in capsys.readouterr().err


TINY = dataclasses.replace(
    uci.DEFAULTS,
    noise_rounds=1,
    map_steps=20,
    mf_steps=10,
    swag_epochs=2,
    num_samples=4,
    vogn_steps=10,
    ivon_steps=10,
)


def test_main_runs_the_selected_splits_with_the_folders_width(tmp_path, monkeypatch, capsys):
    make_folder(tmp_path / "uci")
    widths, written = [], {}
    build = uci.network

    def network(hidden):
        widths.append(hidden)
        return build(hidden)

    monkeypatch.setattr(uci, "network", network)
    monkeypatch.setattr(uci, "DEFAULTS", TINY)
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: config}))
    argv = ["--dataset", "toy", "--splits", "0,2", "--methods", "map", "meanfield"]
    uci.main([*argv, "--data-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "toy split 0" in out and "toy split 2" in out and "toy split 1" not in out
    assert set(widths) == {8}
    assert "published" not in out  # toy has no anchors: no lines, no brackets, no table rows
    # Not the default selection: the measured results file is left alone.
    assert list(written) == ["uci-toy"]
    config = written["uci-toy"]
    assert config["splits_done"] == {"toy": [0, 2]} and config["hidden_per_dataset"] == {"toy": 8}
    json.dumps(config, default=float)  # the JSON writer's contract


# ----------------------------------------------------------------------------- the anchors


def test_published_anchors_are_one_sourced_table():
    assert set(uci.PUBLISHED) == set(uci.DATASETS)
    for name, methods in uci.PUBLISHED.items():
        assert set(methods) <= set(uci.ANCHOR_LABELS), name
        for method, fig in methods.items():
            assert fig["source"], (name, method)
            for key in ("ll_se", "rmse", "rmse_se"):
                assert fig[key] is None or fig[key] > 0, (name, method, key)
    # The 2016 paper's Table 1 is not the grid-search re-run.
    paper = {n: m["mc_dropout_2016"]["ll"] for n, m in uci.PUBLISHED.items()}
    assert paper == {"wine-quality-red": -0.93, "concrete": -3.04, "energy": -1.99, "yacht": -1.55}
    grid = {n: m["mc_dropout"]["ll"] for n, m in uci.PUBLISHED.items()}
    assert grid == {"wine-quality-red": -0.93, "concrete": -2.93, "energy": -1.21, "yacht": -1.25}
    assert uci.anchor_lines("toy") == []


def test_make_bench_without_uci_data_skips(tmp_path, monkeypatch, capsys):
    # ``benchmarks.run_all`` calls main() bare: a data folder without the default datasets
    # skips with a message instead of failing the whole run.
    make_folder(tmp_path / "uci", "other")
    monkeypatch.setenv("PYRO_BDL_DATA", str(tmp_path))
    uci.main()
    out = capsys.readouterr().out
    assert "skipped" in out and "'wine-quality-red'" in out and "['other']" in out


def test_sigma_own_learns_sigma_per_method_and_has_its_own_results_file(tmp_path, monkeypatch):
    make_folder(tmp_path / "uci")
    written = {}
    monkeypatch.setattr(uci, "DEFAULTS", TINY)
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: figures}))
    argv = ["--dataset", "toy", "--splits", "1", "--methods", "map", "--data-dir", str(tmp_path)]
    argv += ["--noise", "homoscedastic"]
    uci.main(argv)
    uci.main([*argv, "--sigma", "own"])
    fixed, own = (
        written["uci-toy-homoscedastic"]["results"]["toy"],
        written["uci-toy-homoscedastic-sigma-own"]["results"]["toy"],
    )
    # Fixed (the default): the MAP predicts with the validation σ; own: with the σ it learned
    # from there. (Index 0: the mean over the one split; its SE is NaN.)
    assert fixed["noise_map_original_units"][0] == fixed["noise_original_units"][0]
    assert own["noise_original_units"][0] == fixed["noise_original_units"][0]
    assert own["noise_map_original_units"][0] != own["noise_original_units"][0]


def _result_file(path, lls: dict[str, list[float]]):
    per = {m: {"per_split_ll": v} for m, v in lls.items()}
    path.write_text(json.dumps({"figures": {"results": {"yacht": {"noise": [1, 0], **per}}}}))
    return path


def _run_file(path, name: str, lls: dict[str, list[float]]):
    figs = {
        m: {"per_split_ll": v, "test_ll": list(uci.mean_se(v)), "test_rmse": [1.0, 0.1]}
        for m, v in lls.items()
    }
    splits = list(range(len(next(iter(lls.values())))))
    config = {"noise_model": "heteroscedastic", "splits_done": {name: splits}, "wall_seconds": 1}
    figures = {"results": {name: figs}, "selected_settings": {name: {"split": 0}}}
    path.write_text(json.dumps({"config": config, "figures": figures}))
    return path


def test_merge_joins_runs_per_dataset_and_checks_the_targets(tmp_path, monkeypatch, capsys):
    written = {}
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: figures}))
    yacht = _run_file(
        tmp_path / "y.json",
        "yacht",
        {
            "map": [-1.0, -1.1],
            "ensemble": [-1.0, -1.2],  # −1.1: 0.08 above the published −1.18 ± 0.21
            "ensemble_paper": [-1.3, -1.5],  # −1.4 ± 0.1: 0.22 below, within √(0.1² + 0.21²)
            "meanfield": [-0.9, -1.0],  # above both ensembles, 0.1 above MAP on each split
            "vogn": [-3.0, -3.2],  # 2 below MAP on each split
        },
    )
    energy = _run_file(
        tmp_path / "e.json",
        "energy",
        {"map": [0.4, 0.6], "ensemble": [0.5, 0.7], "meanfield": [0.4, 0.6], "vogn": [0.4, 0.6]},
    )
    uci.main(["--merge", str(yacht), str(energy)])
    figures = written["uci-yacht-energy"]
    assert set(figures["results"]) == {"yacht", "energy"}
    assert figures["selected_settings"]["energy"] == {"split": 0}
    targets = figures["targets"]
    assert targets["yacht"]["ensemble_vs_published"]["within"]
    paper = targets["yacht"]["ensemble_paper_vs_published"]
    assert not paper["within"] and paper["within_combined"]
    assert targets["yacht"]["bayesian_at_or_above_published"] == ["meanfield"]
    assert targets["yacht"]["bayesian_at_or_above_ensemble"] == ["meanfield"]
    versus = targets["yacht"]["bayesian_vs_map"]
    assert versus["meanfield"]["ok"] and not versus["vogn"]["ok"]
    # Energy's published deep ensemble is −1.38 ± 0.22: 0.6 is 1.98 above it, outside one SE.
    assert not targets["energy"]["ensemble_vs_published"]["within"]
    assert "| meanfield test LL |" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"'yacht': splits \[0, 1\] are in two of the files"):
        uci.merge([yacht, yacht])


def test_before_after_compares_the_common_splits_and_checks_the_targets(tmp_path, monkeypatch):
    from benchmarks import uci_before_after as ba

    written = {}
    monkeypatch.setattr(ba, "write", lambda name, config, figures: written.update({name: figures}))
    before = _result_file(
        tmp_path / "b.json", {"map": [-1.0, -1.2, -1.1, -9.0], "vogn": [-1.0, -1.2, -1.1, -9.0]}
    )
    # "after" in two files (runs of successive splits), joined in order.
    after = _result_file(tmp_path / "a.json", {"map": [-1.0, -1.2], "vogn": [-0.5, -0.8]})
    more = _result_file(tmp_path / "a2.json", {"map": [-1.1], "vogn": [-0.6]})
    ba.main(["--before", str(before), "--after", str(after), str(more)])
    figures = written["uci_sigma_before_after"]
    rows = figures["table"]["yacht"]
    assert rows["splits"] == 3  # the 4th split of "before" has no partner
    assert rows["map"]["before"]["ll"][0] == pytest.approx(-1.1)
    # VOGN after: 0.5, 0.4, 0.5 above MAP on each split: better by far more than the SE.
    assert rows["vogn"]["after"]["diff_to_map"][0] == pytest.approx(1.4 / 3)
    assert figures["targets"]["after"]["better_than_map_by_1se"]["vogn"] == ["yacht"]
    assert figures["targets"]["before"]["better_than_map_by_1se"]["vogn"] == []
    # Yacht's published deep ensemble is −1.18: the best method (VOGN, −0.63) beats it, on one
    # dataset only, so the "at least two datasets" target is not met.
    assert figures["targets"]["after"]["best_method_at_least_deep_ensemble"] == ["yacht"]
    assert not figures["targets"]["after"]["deep_ensemble_target_met"]


def test_multiswag_runs_swags_phase_from_the_ensembles_members(monkeypatch):
    # MultiSWAG = the ensemble at the same settings, then SWAG's phase (its epochs, batch and
    # Adam rate) from each member: the registry gets the ensemble's member values as starts.
    x, y = torch.randn(30, 3), torch.randn(30)
    cfg = dataclasses.replace(TINY, hidden=4, ensemble_members=2, map_epochs=2)
    problem = uci.regression_problem(x, y, None, cfg, 0, None, "heteroscedastic")
    fields, keywords = uci.method_settings("multiswag", problem, cfg)
    assert (fields["epochs"], fields["batch_size"]) == (cfg.swag_epochs, cfg.swag_batch)
    assert keywords == {"num_members": 2, "optimizer": "adam", "swa_lr": cfg.swag_lr}
    seen: dict = {}
    registry = dict(uci.METHODS)

    def spy(name):
        def run(problem, **keywords):
            predict = registry[name](problem, **keywords)
            seen[name] = (keywords, getattr(predict, "member_values", None))
            return predict

        return run

    monkeypatch.setattr(uci, "METHODS", {m: spy(m) for m in ("ensemble", "multiswag")})
    uci.fit("multiswag", problem, cfg)
    assert seen["multiswag"][0]["starts"] is seen["ensemble"][1]
    assert len(seen["ensemble"][1]) == 2


def test_the_paper_recipe_is_fixed_whatever_the_noise_model_but_its_rate():
    # Lakshminarayanan et al. (2017), Sec. 3.1 and 3.3: M = 5, 40 epochs, batch 100, Adam at a
    # constant rate (the text's 0.1 by default), mean-and-variance networks (softplus
    # variance), maximum likelihood; only the rate is chosen, from the text's and two below.
    x, y = torch.randn(30, 3), torch.randn(30)
    homo = dataclasses.replace(uci.DEFAULTS, noise_model="homoscedastic")
    for cfg, noise, sigma in ((uci.DEFAULTS, None, "heteroscedastic"), (homo, 0.5, "fixed")):
        problem = uci.regression_problem(x, y, noise, cfg, 0, None, sigma)
        fields, keywords = uci.method_settings("ensemble_paper", problem, cfg)
        mine = dataclasses.replace(problem, **fields)
        assert mine.heteroscedastic and mine.variance == "softplus" and mine.init is None
        assert (mine.batch_size, mine.epochs, mine.lr, mine.lr_decay) == (100, 40, 0.1, None)
        assert mine.prior.scale == 1e3  # no prior in effect: maximum likelihood
        assert keywords == {"num_members": 5, "adversarial": None}
    assert uci.SELECT["ensemble_paper"] == [{"paper_lr": r} for r in (0.1, 1e-2, 1e-3)]
    assert uci.REGISTRY_NAMES["ensemble_paper"] == "ensemble"


def test_vogn_and_ivon_take_minibatches_and_a_step_floor_under_sigma_x():
    # 100 rows: one minibatch of 100 an epoch, so the step floors (600 and 1200) set the
    # epochs; 6,400 rows: 64 minibatches an epoch, and the 40 epochs already exceed them.
    for rows, vogn_epochs, ivon_epochs in ((100, 600, 1200), (6400, 40, 40)):
        x, y = torch.zeros(rows, 3), torch.zeros(rows)
        problem = uci.regression_problem(x, y, None, uci.DEFAULTS, 0, None, "heteroscedastic")
        vogn, _ = uci.method_settings("vogn", problem, uci.DEFAULTS)
        ivon, keywords = uci.method_settings("ivon", problem, uci.DEFAULTS)
        assert vogn["batch_size"] == ivon["batch_size"] == uci.DEFAULTS.map_batch
        assert (vogn["epochs"], ivon["epochs"]) == (vogn_epochs, ivon_epochs)
        assert vogn["lr_decay"] == 0.1 and vogn["init"] is None is ivon["init"]
        assert keywords == {"ivon_lr": uci.DEFAULTS.ivon_lr}
    # Under one σ both keep their full-batch runs.
    homo = dataclasses.replace(uci.DEFAULTS, noise_model="homoscedastic")
    problem = uci.regression_problem(x, y, 1.0, homo, 0, None)
    vogn, _ = uci.method_settings("vogn", problem, homo)
    ivon, _ = uci.method_settings("ivon", problem, homo)
    assert vogn["batch_size"] == ivon["batch_size"] == rows
    assert (vogn["epochs"], vogn["lr_decay"], ivon["epochs"]) == (600, 0.01, homo.map_steps)


# ----------------------------------------------------------------------------- selection


def test_every_method_gets_the_same_number_of_settings_to_choose_from():
    assert set(uci.SELECT) == set(uci.UCI_METHODS)
    assert {len(grid) for grid in uci.SELECT.values()} == {uci.SELECT_SIZE}
    fields = {f.name for f in dataclasses.fields(uci.Config)}
    assert all(set(s) <= fields for grid in uci.SELECT.values() for s in grid)


def test_the_choice_reads_only_training_rows(tmp_path):
    # The same split with its test rows replaced by NaN: the choice and its scores are unchanged.
    make_folder(tmp_path / "uci", rows=40)
    d = data.load_uci("toy", tmp_path, split=0)
    poisoned = dataclasses.replace(
        d, x_test=torch.full_like(d.x_test, float("nan")), y_test=torch.full_like(d.y_test, 1e9)
    )
    cfg = dataclasses.replace(TINY, hidden=4, dropout_rates=(0.05,))
    methods = ["map", "mc_dropout"]
    configs, record = uci.select_settings(d, cfg, methods)
    again, record_again = uci.select_settings(poisoned, cfg, methods)
    assert record == record_again and configs == again
    for m in methods:
        scores = [row["validation_ll"] for row in record["methods"][m]["tried"]]
        assert len(scores) == uci.SELECT_SIZE
        best = max(record["methods"][m]["tried"], key=lambda r: r["validation_ll"])
        assert record["methods"][m]["chosen"] == best["setting"]
    assert configs["map"].map_lr == record["methods"]["map"]["chosen"]["map_lr"]


def test_the_methods_from_the_map_are_chosen_from_the_map_they_start_from(tmp_path, monkeypatch):
    # MAP's second candidate wins; mean-field's candidates are then scored from that MAP (the
    # one it starts from on every split), both in select_settings and in main's jobs.
    make_folder(tmp_path / "uci")
    seen = []

    def fake(d, cfg, method, setting, start=None):
        seen.append((method, start))
        best = method == "map" and setting == uci.SELECT["map"][1]
        return {"setting": setting, "validation_ll": 0.0 if best else -1.0}

    monkeypatch.setattr(uci, "select_one", fake)
    d = data.load_uci("toy", tmp_path, split=0)
    configs, _ = uci.select_settings(d, TINY, ["meanfield", "map", "ivon"])
    winner = uci.SELECT["map"][1]
    assert {m: s for m, s in seen if m != "meanfield"} == {"map": None, "ivon": None}
    assert [s for m, s in seen if m == "meanfield"] == [winner] * uci.SELECT_SIZE
    assert configs["map"].map_lr == winner["map_lr"]
    seen.clear()
    monkeypatch.setattr(uci, "DEFAULTS", TINY)
    monkeypatch.setattr(uci, "write", lambda name, config, figures: None)
    argv = ["--dataset", "toy", "--splits", "1", "--methods", "meanfield", "map"]
    uci.main([*argv, "--data-dir", str(tmp_path)])
    assert [s for m, s in seen if m == "meanfield"] == [winner] * uci.SELECT_SIZE
    assert seen.index(("map", None)) < seen.index(("meanfield", winner))


def test_main_chooses_per_dataset_and_reports_the_choice(tmp_path, monkeypatch):
    make_folder(tmp_path / "uci")
    written = {}
    monkeypatch.setattr(uci, "DEFAULTS", TINY)
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: figures}))
    argv = ["--dataset", "toy", "--splits", "0,1", "--methods", "map", "ivon"]
    uci.main([*argv, "--data-dir", str(tmp_path)])
    chosen = written["uci-toy"]["selected_settings"]["toy"]
    assert chosen["split"] == 0 and set(chosen["methods"]) == {"map", "ivon"}
    uci.main([*argv, "--data-dir", str(tmp_path), "--no-select"])
    assert written["uci-toy"]["selected_settings"] == {"toy": None}


def test_the_paper_ensemble_chooses_its_rate_without_a_map(tmp_path, monkeypatch):
    make_folder(tmp_path / "uci")
    written = {}
    paper = dataclasses.replace(TINY, paper_members=2, paper_epochs=2)
    monkeypatch.setattr(uci, "DEFAULTS", paper)
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: figures}))
    argv = ["--dataset", "toy", "--splits", "0-1", "--data-dir", str(tmp_path)]
    # Under σ(x) nothing of the paper's recipe starts from a MAP: none is trained.
    monkeypatch.setattr(uci, "prepare", lambda *a, **k: pytest.fail("trained a MAP"))
    uci.main([*argv, "--methods", "ensemble_paper"])
    figures = written["uci-toy"]
    record = figures["selected_settings"]["toy"]["methods"]["ensemble_paper"]
    assert [row["setting"] for row in record["tried"]] == uci.SELECT["ensemble_paper"]
    best = max(record["tried"], key=lambda row: row["validation_ll"])
    assert record["chosen"] == best["setting"]
    assert len(figures["results"]["toy"]["ensemble_paper"]["per_split_ll"]) == 2


def test_adversarial_flag_reaches_the_ensemble_and_names_the_results_file(tmp_path, monkeypatch):
    make_folder(tmp_path / "uci")
    written, seen = {}, []
    fit = uci.fit

    def spy(name, problem, cfg, **keywords):
        seen.append((name, cfg.adversarial))
        return fit(name, problem, cfg, **keywords)

    monkeypatch.setattr(uci, "DEFAULTS", dataclasses.replace(TINY, ensemble_members=2))
    monkeypatch.setattr(uci, "fit", spy)
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: 1}))
    argv = ["--dataset", "toy", "--splits", "1", "--methods", "ensemble", "--no-select"]
    uci.main([*argv, "--adversarial", "--data-dir", str(tmp_path)])
    assert ("ensemble", 0.01) in seen and list(written) == ["uci-toy-adversarial"]


# ----------------------------------------------------------------------------- jobs and recovery


def _per_split(figures) -> dict:
    return {
        name: {m: figs[m]["per_split_ll"] for m in figs if not m.startswith("noise")}
        for name, figs in figures["results"].items()
    }


def test_jobs_give_the_serial_figures(tmp_path, monkeypatch):
    # Every job is self-contained and seeded, so a pool of 2 processes (in whatever order they
    # finish) gives the serial run's figures exactly, selection included.
    make_folder(tmp_path / "uci")
    written = {}
    monkeypatch.setattr(uci, "DEFAULTS", dataclasses.replace(TINY, map_epochs=3, vogn_steps=5))
    monkeypatch.setattr(uci, "write", lambda name, config, figures: written.update({name: figures}))
    argv = ["--dataset", "toy", "--splits", "0-1", "--methods", "map", "vogn"]
    argv += ["--data-dir", str(tmp_path)]
    uci.main([*argv, "--jobs", "1"])
    serial = written.pop("uci-toy")
    uci.main([*argv, "--jobs", "2"])
    pooled = written.pop("uci-toy")
    assert _per_split(pooled) == _per_split(serial)
    assert (
        pooled["selected_settings"]["toy"]["methods"]["vogn"]["chosen"]
        == (serial["selected_settings"]["toy"]["methods"]["vogn"]["chosen"])
    )


def test_the_json_is_rewritten_after_every_job_and_survives_a_killed_run(tmp_path, monkeypatch):
    make_folder(tmp_path / "uci")
    monkeypatch.setattr(uci, "DEFAULTS", dataclasses.replace(TINY, map_epochs=3))
    job = uci.split_job
    finished = []

    def killed_after_three(*args):
        if len(finished) == 3:
            raise KeyboardInterrupt  # the timeout's kill, during split 1's second method
        finished.append(args[1:3])
        return job(*args)

    monkeypatch.setattr(uci, "split_job", killed_after_three)
    out = tmp_path / "elsewhere" / "run.json"
    argv = ["--dataset", "toy", "--splits", "0-2", "--methods", "map", "meanfield"]
    with pytest.raises(KeyboardInterrupt):
        uci.main([*argv, "--no-select", "--data-dir", str(tmp_path), "--out", str(out)])
    run = json.loads(out.read_text())
    assert not out.with_name("run.json.tmp").exists()  # written by rename
    # Split 0 finished for both methods, split 1 for MAP only: the summary is over split 0, the
    # job's CPU seconds are kept for all three.
    assert run["config"]["splits_done"] == {"toy": [0]}
    assert len(run["figures"]["results"]["toy"]["map"]["per_split_ll"]) == 1
    cpu = run["config"]["job_cpu_seconds"]["toy"]
    assert set(cpu["0"]) == {"map", "meanfield"} and set(cpu["1"]) == {"map"}
    assert all(s > 0 for row in cpu.values() for s in row.values())


class _Blown:
    """A predictor whose σ collapsed: N(0, 10⁻³) for every row."""

    def __call__(self, x):
        return torch.distributions.Normal(torch.zeros(len(x)), 1e-3)


def test_a_blown_up_fit_is_retrained_at_a_lower_rate_and_noted(monkeypatch):
    from pyro_bdl.app.compare.recovery import DivergedWarning

    x = torch.randn(40, 3)
    y = x[:, 0] - x[:, 1]
    y = (y - y.mean()) / y.std()
    cfg = dataclasses.replace(TINY, hidden=4, vogn_steps=10, vogn_lr=0.3, map_epochs=3)
    fit, rates = uci.fit, []

    def blown_at_high_rates(name, problem, c, **keywords):
        if name == "vogn":
            rates.append(c.vogn_lr)
            if c.vogn_lr > 0.01:  # 0.3 and 0.03 blow up, 0.003 trains
                return _Blown()
        return fit(name, problem, c, **keywords)

    monkeypatch.setattr(uci, "fit", blown_at_high_rates)
    with pytest.warns(DivergedWarning, match="vogn"):
        out = uci.run_methods(x, y, x[:8], y[:8], 1.0, cfg, ["map", "vogn"], 0)
    assert rates == pytest.approx([0.3, 0.03, 0.003])
    assert len(out["_chosen"]["vogn"]["retries"]) == 2 and math.isfinite(out["vogn"][0])
    assert "retries" not in out["_chosen"]["map"]
    # In the selection the check scores the setting -inf, unretried, so it is not chosen.
    d = data.Dataset("toy", x, y, x[:8], y[:8], num_classes=None)
    rates.clear()
    row = uci.select_one(d, cfg, "vogn", {"vogn_lr": 0.3})
    assert row["validation_ll"] == -math.inf and "training log-likelihood" in row["error"]
    assert rates == [0.3]


def test_the_variance_parameterisation_is_checked_and_softplus_bounds_sigma():
    x, y = torch.zeros(4, 3), torch.zeros(4)
    bad = dataclasses.replace(uci.DEFAULTS, variance="square")
    with pytest.raises(ValueError, match=r"variance must be one of \('exp', 'softplus'\)"):
        uci.regression_problem(x, y, None, bad, 0, None, "heteroscedastic")
    # σ² = softplus(r) + 1e-6: never below 1e-6, linear in r for large r.
    _, log_var = uci.softplus_variance(torch.tensor([[0.0, -50.0], [0.0, 30.0]]))
    assert log_var.exp()[0] == pytest.approx(1e-6, rel=1e-3)
    assert log_var.exp()[1] == pytest.approx(30.0, rel=1e-6)


def test_a_run_continued_with_the_earlier_settings_merges_into_the_whole_run(tmp_path, monkeypatch):
    # Splits 0 and 1 in one run equal split 0, then split 1 with --settings-from the first run,
    # joined by --merge: the continuation selects nothing and trains with the same settings.
    make_folder(tmp_path / "uci")
    monkeypatch.setattr(uci, "DEFAULTS", dataclasses.replace(TINY, map_epochs=3))
    argv = ["--dataset", "toy", "--methods", "map", "ivon", "--data-dir", str(tmp_path)]
    whole, first, rest = (tmp_path / f"{n}.json" for n in ("whole", "first", "rest"))
    uci.main([*argv, "--splits", "0-1", "--out", str(whole)])
    uci.main([*argv, "--splits", "1", "--out", str(first)])  # the first split
    selected = []
    monkeypatch.setattr(uci, "selection_job", lambda *a: selected.append(a))
    uci.main([*argv, "--splits", "1-1", "--settings-from", str(first), "--out", str(rest)])
    assert selected == []
    config, figures = uci.merge([rest, first])
    expected = json.loads(whole.read_text())["figures"]
    assert config["splits_done"] == {"toy": [0, 1]}
    assert _per_split(figures) == _per_split(expected)
    for m in ("map", "ivon"):
        joined, whole_run = figures["results"]["toy"][m], expected["results"]["toy"][m]
        assert list(joined["test_ll"]) == whole_run["test_ll"]
    assert uci.chosen_settings(figures["selected_settings"]["toy"]) == uci.chosen_settings(
        expected["selected_settings"]["toy"]
    )


def test_settings_from_a_file_without_the_dataset_is_refused(tmp_path, monkeypatch):
    make_folder(tmp_path / "uci")
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"figures": {"selected_settings": {"yacht": None}}}))
    with pytest.raises(ValueError, match="no chosen setting for 'toy'"):
        uci.settings_from(earlier, ["toy"], ["map"], TINY, tmp_path)


def test_the_plain_torch_paper_ensemble_learns_and_writes_its_summary(tmp_path, monkeypatch):
    from benchmarks import uci_paper_ensemble as reference

    make_folder(tmp_path / "uci", rows=406, splits=2)  # 400 training rows: 4 minibatches
    written = {}
    monkeypatch.setattr(
        reference, "write", lambda name, config, figures, out: written.update(figures)
    )
    reference.main(["--data-dir", str(tmp_path), "--dataset", "toy", "--splits", "0-1",
                    "--lrs", "0.01"])  # fmt: skip
    toy = written["toy"]["0.01"]
    assert len(toy["per_split"]) == 2
    # y = x·(1, −2, 0.5) + 10 + 0.1 noise: std √5.25 ≈ 2.29, so the constant forecast scores
    # −½ log(2πe) − log 2.29 ≈ −2.25 nats and the true model −½ log(2πe·0.01) ≈ 0.88. A
    # calibrated Gaussian with RMSE 0.3 scores −½ log(2πe·0.09) ≈ −0.22: the bounds below ask
    # for most of the linear map learnt in 160 Adam steps (the two splits score 0.5 and 0.7,
    # RMSE 0.13 and 0.07, with these seeds).
    assert toy["ll"][0] > -0.5 and toy["rmse"][0] < 0.3
    means = [row["ll"] for row in toy["per_split"]]
    assert toy["ll"][0] == pytest.approx(sum(means) / 2)
