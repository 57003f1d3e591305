"""What a newcomer meets first in ``pyro-bdl compare``: every option explains itself and its
default, a bad output folder or missing data is refused by name before anything loads or trains,
``--tune`` records the rate each method used, and the torch thread count is chosen, not
inherited."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from pyro_bdl.app import cli
from pyro_bdl.app.cli import build_parser, main
from pyro_bdl.app.compare import evaluate, tuning
from pyro_bdl.app.compare.evaluate import is_point_mass
from pyro_bdl.app.data import DATA_ENV, MNIST_FILES
from pyro_bdl.diagnostics import arviz_compat

FAST = ["--epochs", "1", "--batch-size", "512", "--num-samples", "2", "--no-progress"]


def _compare_parser():
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sub.choices["compare"]


def _one_line_refusal(capsys, rc: int, *texts: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("pyro-bdl: error:"), err
    for text in texts:
        assert text in err, err
    return err


def test_every_option_has_help_with_its_default(capsys):
    parser = _compare_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    formatter = parser._get_formatter()
    for action in options:
        name = action.option_strings[0]
        assert action.help, f"{name} has no help text"
        # The text --help prints after the option: its help, then its default.
        text = formatter._expand_help(action)
        assert text.endswith(f"(default: {action.default})"), (name, text)
    assert main(["compare", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the line wrapping
    for option in ("--network", "--epochs", "--batch-size", "--lr", "--seed", "--device"):
        assert option in out
    assert "(default: 30)" in out and "(default: 0.001)" in out and "(default: auto)" in out


@pytest.fixture
def no_data(monkeypatch):
    """Loading any data fails the test: a refusal must come first."""
    loaded = []
    monkeypatch.setattr(cli, "load_dataset", lambda *a, **k: loaded.append(a))
    yield loaded
    assert loaded == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
def test_output_on_a_virtual_file_system_is_refused_before_data(capsys, no_data):
    # /proc refuses new folders even to root, whom its permission bits would let write.
    rc = main(["compare", *FAST, "--output", "/proc/nope"])
    _one_line_refusal(capsys, rc, "--output", "'/proc/nope'", "not writable", "pass")
    assert not Path("/proc/nope").exists()


def test_output_check_leaves_nothing_behind(tmp_path):
    target = tmp_path / "a" / "b"
    assert cli.check_output(str(target)) == target
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["option", "environment"])
def test_mnist_in_an_empty_folder_names_the_path_and_the_variable(
    tmp_path, capsys, monkeypatch, where
):
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["compare", *FAST, "--output", str(tmp_path / "out"), "--dataset", "mnist"]
    if where == "option":
        monkeypatch.delenv(DATA_ENV, raising=False)
        argv += ["--data-dir", str(empty)]
    else:
        monkeypatch.setenv(DATA_ENV, str(empty))
    err = _one_line_refusal(capsys, main(argv), "--dataset mnist", str(empty), DATA_ENV)
    assert MNIST_FILES[0] in err and "Errno" not in err
    assert not (tmp_path / "out").exists()


def test_mnist_with_a_missing_folder_names_the_path_and_the_variable(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(DATA_ENV, str(missing))
    rc = main(["compare", *FAST, "--output", str(tmp_path / "out"), "--dataset", "mnist"])
    err = _one_line_refusal(capsys, rc, str(missing), DATA_ENV, "does not exist")
    assert "Errno" not in err


def test_point_mass_posterior_is_recognised():
    rng = np.random.default_rng(0)
    same = np.broadcast_to(rng.normal(size=(1, 1, 3)), (1, 8, 3))

    def posterior(w):  # through the one ArviZ layer: ArviZ 1.x changed from_dict's signature
        dims = ("chain", "draw", "w_dim_0")
        return arviz_compat.package({"posterior": xr.Dataset({"w": (dims, w)})})

    assert is_point_mass(posterior(same))
    assert not is_point_mass(posterior(rng.normal(size=(1, 8, 3))))


def test_tune_records_the_rate_each_method_used(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(tuning.GRIDS, "map", {"lr": (1e-2, 3e-2), "prior_scale": (1.0,)})
    argv = ["compare", *FAST, "--output", str(tmp_path), "--methods", "map"]
    assert main([*argv, "--tune", "--lr", "0.5"]) == 0
    capsys.readouterr()
    payload = json.loads((tmp_path / "results.json").read_text())
    (row,) = payload["results"]
    assert row["lr"] == row["tuned"]["lr"] in (1e-2, 3e-2)  # the grid's choice, not --lr
    assert payload["config"]["lr"] == "per method (see each result's lr)"


@pytest.mark.parametrize(
    "argv, threads", [([], 1), (["--threads", str(os.cpu_count())], os.cpu_count())]
)
def test_threads_are_chosen(tmp_path, capsys, monkeypatch, argv, threads):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(evaluate, "run", lambda *a, **k: [])
    assert main(["compare", *FAST, "--output", str(tmp_path), *argv]) == 0
    assert calls == [threads]
    assert f"{threads} thread(s)" in capsys.readouterr().out


def test_make_run_states_the_thread_count():
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    run = makefile.split("\nrun:")[1].split("\n\n")[0]
    assert "--threads 1" in run


def test_device_auto_resolves_to_a_device():
    args = _compare_parser().parse_args([])
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert os.fspath(args.output) == "results"
