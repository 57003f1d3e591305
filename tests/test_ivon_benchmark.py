"""Smoke test of benchmarks/ivon_step.py on a tiny network: both variants build, step, are timed,
have a peak memory, and the ratios are formed (the figures themselves are not checked)."""

import pyro
import pytest
import torch

from benchmarks import ivon_step
from benchmarks.resnet import wide_mlp


@pytest.fixture
def tiny(monkeypatch):
    torch.set_num_threads(1)
    yield lambda: wide_mlp((3, 4, 4), width=16)
    pyro.clear_param_store()


def test_both_variants_step_and_the_ratios_are_formed(tiny):
    out = ivon_step.measure(tiny, (3, 4, 4), 100, 4, rounds=2)
    assert set(out["seconds"]) == {"adam", "ivon"}
    assert all(out["peak_bytes"][k] > 0 for k in ("adam", "ivon"))
    r = out["ivon/adam"]
    assert r["time"] > 0 and r["peak_memory"] > 0 and len(r["time_quartiles_per_round"]) == 3


def test_quick_mode_runs_and_writes_nothing(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path)
    figures = ivon_step.main(["--quick"])
    assert set(figures) == {"tiny/B=4"} and not list(tmp_path.iterdir())


def test_main_refuses_an_unknown_net():
    with pytest.raises(SystemExit):
        ivon_step.main(["--nets", "vgg"])
