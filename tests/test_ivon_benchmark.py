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


def test_the_peer_steps_in_the_same_rounds_and_learns(tiny):
    """ivon-opt's step is timed beside the same Adam step, and it is a real IVON step: a few
    steps on one fixed batch lower the loss (a step that did nothing would not)."""
    pytest.importorskip("ivon")
    out = ivon_step.measure(tiny, (3, 4, 4), 100, 4, rounds=2, peer=True)
    assert set(out["seconds"]) == {"adam", "ivon", "ivon_opt"}
    assert out["ivon_opt/adam"]["time"] > 0 and out["ivon_opt/adam"]["peak_memory"] > 0
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 4, 4), torch.randint(0, 10, (16,))
    step = ivon_step.peer_step(tiny(), x, y, 16)
    # One MC sample per step: the loss is noisy, so compare the mean of the first and last 5
    # of 60 steps; lr 0.1 on 16 fixed examples fits them within a few dozen steps.
    losses = [step() for _ in range(60)]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
