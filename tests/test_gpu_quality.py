"""The GPU quality runner (benchmarks/gpu_quality.py): commands, deadline, summary."""

from __future__ import annotations

import sys

import pytest

from benchmarks import gpu_quality


def test_every_benchmark_writes_into_the_output_folder(tmp_path):
    cmds = gpu_quality.commands(tmp_path, jobs=5, model_dir="model")
    assert set(cmds) == {"uci", "mnist_table", "lora"}
    assert cmds["uci"][-4:] == ["--jobs", "5", "--out", str(tmp_path / "uci.json")]
    assert "--model-dir" in cmds["lora"] and "laplace_torch" not in cmds["lora"]
    assert all("cuda" in cmds[k] for k in ("mnist_table", "lora"))
    chosen = gpu_quality.commands(tmp_path, jobs=5, model_dir=None, methods=["ivon", "ensemble"])
    lora = chosen["lora"]
    assert lora[lora.index("--methods") + 1 :] == ["ivon", "ensemble"]


def test_unknown_lora_methods_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit):
        gpu_quality.main(["--output", str(tmp_path), "--only", "lora", "--lora-methods", "nope"])
    assert not (tmp_path / "quality-summary.json").exists()


def test_a_command_past_the_deadline_is_killed_and_the_others_kept(tmp_path):
    cmds = {
        "quick": [sys.executable, "-c", "print('done')"],
        "slow": [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
    }
    ended = gpu_quality.run_together(cmds, deadline=3.0, output=tmp_path)
    assert ended["quick"]["rc"] == 0 and "done" in ended["quick"]["output_tail"]
    assert ended["slow"]["rc"] is None and "started" in ended["slow"]["output_tail"]
    assert ended["slow"]["seconds"] < 30  # killed at the deadline, not after its minute


def test_only_selects_and_the_summary_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu_quality, "commands", lambda output, jobs, model_dir, mnist_jobs, methods: {
            "uci": [sys.executable, "-c", "pass"], "lora": [sys.executable, "-c", "1/0"]
        },
    )  # fmt: skip
    summary = gpu_quality.main(["--output", str(tmp_path), "--only", "lora", "--deadline", "60"])
    assert list(summary["ended"]) == ["lora"] and summary["ended"]["lora"]["rc"] == 1
    assert (tmp_path / "quality-summary.json").is_file()
