"""Fault injection against ``pyro-bdl compare`` (issue classes 6 and 7).

Class 6, obscure errors: every bad option is refused with one ``pyro-bdl: error:`` line that
names the option, the expected and the actual value and a fix; the exit status is 2, nothing is
trained and nothing is written. Class 7, work lost: the output folder is checked before any
training; each method's results are saved as it finishes; a failing method is reported in the
table and the JSON while the others are kept, and the exit status is 1.

The methods here are stand-ins registered with ``monkeypatch.setitem(METHODS, ...)`` (uniform
predictions, no training) so the file runs in seconds; one case trains the real ``map``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import sklearn.datasets  # noqa: F401  (see below)
import torch

from pyro_bdl.app import cli
from pyro_bdl.app.cli import main
from pyro_bdl.app.compare import METHODS, evaluate
from pyro_bdl.app.compare.evaluate import run, write_text_atomic
from pyro_bdl.app.compare.problem import train_loop
from pyro_bdl.app.data import MNIST_FILES
from tests.faults.common import assert_same, rng_states

# sklearn is imported above, not first by `--dataset digits` inside a test: importing it draws
# from Python's global RNG, which the refusal tests check a refused command leaves alone.
MNIST_IMAGES, MNIST_LABELS = MNIST_FILES
FAST = ["--epochs", "1", "--batch-size", "512", "--num-samples", "2", "--no-progress"]


def snapshot(*objects, folder: Path | None = None) -> dict:
    """What a refusal must leave alone: the global RNG states, the state dicts / tensors in
    ``objects``, and every file (path and content hash) under ``folder``."""
    state: dict = {
        "rng": rng_states(),
        "objects": [
            {k: v.clone() for k, v in o.state_dict().items()}
            if hasattr(o, "state_dict")
            else o.clone()
            for o in objects
        ],
    }
    if folder is not None:
        state["files"] = {
            str(p.relative_to(folder)): (
                hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            )
            for p in sorted(folder.rglob("*"))
        }
    return state


def _uniform(problem):
    c = problem.dataset.num_classes
    return lambda x: torch.full((len(x), c), 1.0 / c)


@pytest.fixture
def no_training(monkeypatch):
    """Any call that would train fails the test loudly."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("a refused command must not train")

    monkeypatch.setattr(evaluate, "run", must_not_run)


# (argv, option named, text that must appear: the actual value or the expected form)
REFUSALS = [
    (["--lr", "inf"], "--lr", "'inf'"),
    (["--lr", "nan"], "--lr", "'nan'"),
    (["--lr", "-1"], "--lr", "'-1'"),
    (["--lr", "0"], "--lr", "> 0"),
    (["--lr", "fast"], "--lr", "'fast'"),
    (["--epochs", "0"], "--epochs", ">= 1"),
    (["--epochs", "-2"], "--epochs", "'-2'"),
    (["--epochs", "1.5"], "--epochs", "'1.5'"),
    (["--batch-size", "nan"], "--batch-size", "'nan'"),
    (["--batch-size", "0"], "--batch-size", ">= 1"),
    (["--num-samples", "-1"], "--num-samples", "'-1'"),
    (["--num-kl-samples", "1e3"], "--num-kl-samples", "'1e3'"),
    (["--seed", "-1"], "--seed", "'-1'"),
    (["--seed", str(2**32)], "--seed", "4294967295"),
    (["--methods", "nope"], "--methods", "'nope'"),
    (["--methods", "map,nope"], "--methods", "subnet_laplace"),  # the choices are listed
    (["--methods", ","], "--methods", "got none"),
    (["--methods", "map,map"], "--methods", "more than once"),
    (["--data-dir", "/nonexistent/pyro_bdl"], "--data-dir", "does not exist"),
    (["--ood", "/nonexistent/ood.npy"], "--ood", "does not exist"),
    (["--ood", ""], "--ood", "is empty"),
    (["--ood-classes", "eight"], "--ood-classes", "'eight'"),
    (["--ood-classes", "3,12"], "--ood-classes", "[0, 10)"),
    (["--ood-classes", ""], "--ood-classes", "at least one class"),
    (["--device", "tpu"], "--device", "'tpu'"),
    (["--network", "resnet"], "--network", "'resnet'"),
    (["--dataset", "cifar"], "--dataset", "'cifar'"),
    (["--unknown-flag"], "--unknown-flag", "unrecognized"),
    (["--threads", "0"], "--threads", "'0'"),
    # Beyond the CPUs (and beyond a C int, which raised from torch.set_num_threads).
    (["--threads", "99999999999"], "--threads", f"[1, {os.cpu_count()}]"),
]


def _check_refusal(capsys, rc: int, option: str, text: str) -> None:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err  # one line, no traceback, no usage block
    assert err.startswith("pyro-bdl: error:") and "Traceback" not in err
    assert option in err and text in err, err
    assert "pass" in err.lower() or "see" in err  # a fix, or where to find the valid forms


@pytest.mark.parametrize("argv, option, text", REFUSALS)
def test_bad_option_is_one_line_exit_2_nothing_written(
    tmp_path, capsys, no_training, argv, option, text
):
    out = tmp_path / "out"
    before = snapshot(folder=tmp_path)
    rc = main(["compare", *FAST, "--output", str(out), *argv])
    _check_refusal(capsys, rc, option, text)
    assert_same(before, snapshot(folder=tmp_path))
    assert not out.exists()


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda(tmp_path, capsys, no_training, monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = snapshot(folder=tmp_path)
    rc = main(["compare", *FAST, "--output", str(tmp_path / "out"), "--device", device])
    _check_refusal(capsys, rc, "--device", "--device cpu")
    assert_same(before, snapshot(folder=tmp_path))


def test_cuda_index_beyond_the_devices(tmp_path, capsys, no_training, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rc = main(["compare", *FAST, "--output", str(tmp_path / "out"), "--device", "cuda:3"])
    _check_refusal(capsys, rc, "--device", "1 CUDA device")


def test_output_is_an_existing_file(tmp_path, capsys, no_training):
    target = tmp_path / "results"
    target.write_text("keep me")
    before = snapshot(folder=tmp_path)
    rc = main(["compare", *FAST, "--output", str(target)])
    _check_refusal(capsys, rc, "--output", "existing file")
    assert_same(before, snapshot(folder=tmp_path))
    assert target.read_text() == "keep me"


def test_output_below_a_file(tmp_path, capsys, no_training):
    (tmp_path / "afile").write_text("x")
    before = snapshot(folder=tmp_path)
    rc = main(["compare", *FAST, "--output", str(tmp_path / "afile" / "sub" / "out")])
    _check_refusal(capsys, rc, "--output", "is a file")
    assert_same(before, snapshot(folder=tmp_path))


def test_output_read_only(tmp_path, capsys, no_training, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root may write anywhere: answer os.access as for another user
        real_access = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda p, mode, **kw: (
                False if Path(p) == ro and mode & os.W_OK else real_access(p, mode, **kw)
            ),
        )
    before = snapshot(folder=tmp_path)
    try:
        for target in (ro, ro / "new" / "deeper"):
            rc = main(["compare", *FAST, "--output", str(target)])
            _check_refusal(capsys, rc, "--output", "not writable")
        assert_same(before, snapshot(folder=tmp_path))
    finally:
        ro.chmod(0o755)


def test_mnist_without_data(tmp_path, capsys, no_training, monkeypatch):
    monkeypatch.delenv("PYRO_BDL_DATA", raising=False)
    before = snapshot(folder=tmp_path)
    rc = main(["compare", *FAST, "--output", str(tmp_path / "out"), "--dataset", "mnist"])
    _check_refusal(capsys, rc, "--dataset", "--data-dir")
    assert_same(before, snapshot(folder=tmp_path))


def test_no_subcommand(capsys):
    rc = main([])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "command" in err


def test_help_exits_zero(capsys):
    assert main(["compare", "--help"]) == 0
    assert "--output" in capsys.readouterr().out


def test_output_checked_before_data_and_training(tmp_path, capsys, monkeypatch, no_training):
    """The output folder is refused before the data is loaded, let alone a method trained."""
    loaded = []
    monkeypatch.setattr(cli, "load_dataset", lambda *a, **k: loaded.append(a))
    (tmp_path / "f").write_text("")
    assert main(["compare", *FAST, "--output", str(tmp_path / "f")]) == 2
    assert loaded == []
    capsys.readouterr()


# ----- class 7: work lost by the CLI -------------------------------------------------------------


def _strict_json(path: Path) -> dict:
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_failing_method_keeps_the_others_and_exits_1(tmp_path, capsys, monkeypatch):
    """A method that fails mid-training (inside the shared train_loop, at its 2nd step) is
    reported in the table, the JSON and on stderr; the methods before and after it are kept."""
    seen_on_disk = {}

    def boom(problem):
        # What a run killed here would leave: the first method's results are already saved.
        seen_on_disk["json"] = _strict_json(tmp_path / "results.json")
        seen_on_disk["txt"] = (tmp_path / "results.txt").read_text()

        def step(x, y):
            if step.calls == 1:
                raise RuntimeError("injected failure at step 2")
            step.calls += 1
            return 0.0

        step.calls = 0
        train_loop(problem, step, "boom")
        raise AssertionError("unreachable")

    monkeypatch.setitem(METHODS, "first", _uniform)
    monkeypatch.setitem(METHODS, "boom", boom)
    monkeypatch.setitem(METHODS, "last", _uniform)
    rc = main(["compare", *FAST, "--output", str(tmp_path), "--methods", "first,boom,last"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "boom: RuntimeError: injected failure at step 2" in captured.err
    assert str(tmp_path / "results.json") in captured.err

    early = seen_on_disk["json"]
    assert [r["method"] for r in early["results"]] == ["first"]
    assert early["status"] == "running" and early["pending"] == ["boom", "last"]
    assert "first" in seen_on_disk["txt"] and "still to run: boom, last" in seen_on_disk["txt"]

    payload = _strict_json(tmp_path / "results.json")
    assert payload["status"] == "failed: boom" and payload["pending"] == []
    first, failed, last = payload["results"]
    assert failed["error"] == (
        "RuntimeError: injected failure at step 2 (while training boom: epoch 1 of 1, step 2)"
    )
    assert "train_loop" in failed["traceback"] and failed.get("accuracy") is None
    for row in (first, last):
        assert "error" not in row and row["ood_auroc"] == 0.5  # uniform: chance level
        assert (tmp_path / f"{row['method']}.nc").exists()
    table = (tmp_path / "results.txt").read_text()
    assert "boom failed: RuntimeError: injected failure at step 2" in table
    assert "boom" in captured.out and "failed" in captured.out
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_every_method_failing_still_writes_the_report(tmp_path, capsys, monkeypatch):
    def broken(problem):
        return lambda x: torch.full((len(x), problem.dataset.num_classes), float("nan"))

    monkeypatch.setitem(METHODS, "broken", broken)
    rc = main(["compare", *FAST, "--output", str(tmp_path), "--methods", "broken"])
    err = capsys.readouterr().err
    assert rc == 1 and "1 of 1 method(s) failed" in err
    (row,) = _strict_json(tmp_path / "results.json")["results"]
    # The metric's own error says where the NaN came from (the predictor), not "clean the data".
    assert row["error"].startswith("ValueError: probs contains") and "predictor" in row["error"]


def test_diverging_real_method_is_reported(tmp_path, capsys):
    """A CLI option that makes a real method fail: MAP at --lr 1e30 overflows to NaN."""
    torch.set_num_threads(1)
    rc = main(["compare", *FAST, "--output", str(tmp_path), "--methods", "map", "--lr", "1e30"])
    capsys.readouterr()
    assert rc == 1
    payload = _strict_json(tmp_path / "results.json")
    (row,) = payload["results"]
    assert row["method"] == "map" and payload["status"] == "failed: map"
    # Pyro's own message (NaN logits) gains where it happened and why: the weights blew up.
    assert "while training map: epoch 1 of 1" in row["error"]
    assert "training diverged: lower the learning rate (lr=1e+30" in row["error"]


def test_non_finite_loss_stops_training_with_the_fix():
    from pyro_bdl.app.compare import Problem
    from pyro_bdl.app.data import load_digits

    problem = Problem(load_digits(), epochs=2, batch_size=512, progress=False)
    losses = iter([1.0, float("nan")])
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2 .*lower the learning"):
        train_loop(problem, lambda x, y: next(losses), "m")


def _problem_kwargs():
    from pyro_bdl.app.data import load_digits

    return {"dataset": load_digits(), "progress": False}


@pytest.mark.parametrize(
    "field, value, text",
    [
        ("epochs", 0, "Problem.epochs must be an int >= 1; got 0"),
        ("batch_size", 2.5, "Problem.batch_size must be an int >= 1; got 2.5"),
        ("num_samples", True, "Problem.num_samples must be an int >= 1; got True"),
        ("num_kl_samples", -1, "Problem.num_kl_samples"),
        ("seed", -1, "Problem.seed must be an int in [0, 4294967295]"),
        ("lr", float("inf"), "Problem.lr must be finite and > 0"),
        ("lr", 0.0, "Problem.lr must be finite and > 0"),
        ("lr_decay", float("nan"), "Problem.lr_decay"),
        ("noise", -0.1, "Problem.noise"),
        ("network", "resnet", "Problem.network must be one of 'mlp', 'cnn'"),
        ("device", "tpu", "Problem.device must name a torch device"),
        ("ood_x", torch.zeros(3, 5), "Problem.ood_x must be a tensor of shape (n, 1, 8, 8)"),
        ("ood_x", torch.full((3, 1, 8, 8), float("nan")), "Problem.ood_x contains NaN"),
    ],
)
def test_problem_refuses_bad_settings(field, value, text):
    from pyro_bdl.app.compare import Problem

    with pytest.raises(ValueError) as info:
        Problem(**_problem_kwargs(), **{field: value})
    assert text in str(info.value), str(info.value)


def test_problem_cuda_without_cuda(monkeypatch):
    from pyro_bdl.app.compare import Problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"CUDA is not available.*device='cpu'"):
        Problem(**_problem_kwargs(), device="cuda")


def test_interrupted_run_keeps_the_finished_methods(tmp_path, capsys, monkeypatch):
    def ctrl_c(problem):
        raise KeyboardInterrupt

    monkeypatch.setitem(METHODS, "first", _uniform)
    monkeypatch.setitem(METHODS, "stopped", ctrl_c)
    monkeypatch.setitem(METHODS, "never", _uniform)
    argv = ["compare", *FAST, "--output", str(tmp_path), "--methods", "first,stopped,never"]
    assert main(argv) == 130
    assert "1 finished method(s) are saved" in capsys.readouterr().err
    payload = _strict_json(tmp_path / "results.json")
    assert payload["status"] == "interrupted" and payload["pending"] == ["stopped", "never"]
    assert [r["method"] for r in payload["results"]] == ["first"]
    assert (tmp_path / "first.nc").exists() and not (tmp_path / "never.nc").exists()
    assert "never ran (interrupted): stopped, never" in (tmp_path / "results.txt").read_text()


def test_run_raises_by_default_and_keeps_going_on_request(monkeypatch):
    from pyro_bdl.app.compare import Problem
    from pyro_bdl.app.data import hold_out_classes, load_digits

    def boom(problem):
        raise RuntimeError("boom")

    monkeypatch.setitem(METHODS, "boom", boom)
    monkeypatch.setitem(METHODS, "ok", _uniform)
    digits, _ = hold_out_classes(load_digits(), [8, 9])
    problem = Problem(digits, epochs=1, progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        run(problem, ["boom", "ok"])
    saved = []
    rows = run(problem, ["boom", "ok"], keep_going=True, on_row=lambda r: saved.append(len(r)))
    assert rows[0]["error"] == "RuntimeError: boom" and "error" not in rows[1]
    assert saved == [1, 2]


def test_interrupted_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_text_atomic(path, "old")

    def killed(src, dst):
        raise KeyboardInterrupt  # the process is interrupted between write and rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def _idx(array) -> bytes:
    """An IDX file (MNIST's format): zero, zero, the type 8 (unsigned byte), the number of
    dims, each dim as 4 big-endian bytes, then the bytes."""
    head = bytes([0, 0, 8, array.ndim])
    return head + b"".join(int(d).to_bytes(4, "big") for d in array.shape) + array.tobytes()


@pytest.mark.parametrize("damage", ["truncated", "short", "not-gzip"])
def test_damaged_mnist_file_is_one_line_naming_it(tmp_path, capsys, no_training, damage):
    """A damaged download escaped as a traceback (EOFError from gzip is not an OSError)."""
    import gzip

    import numpy as np

    folder = tmp_path / "mnist"
    folder.mkdir()
    images = gzip.compress(_idx(np.zeros((10, 28, 28), dtype=np.uint8)))
    if damage == "truncated":  # the download stopped half-way
        images = images[: len(images) // 2]
    elif damage == "short":  # a whole gzip whose header promises more images than it holds
        images = gzip.compress(_idx(np.zeros((10, 28, 28), dtype=np.uint8))[:-28])
    else:
        images = b"<html>not found</html>"
    (folder / MNIST_IMAGES).write_bytes(images)
    (folder / MNIST_LABELS).write_bytes(gzip.compress(_idx(np.arange(10, dtype=np.uint8))))
    argv = ["compare", *FAST, "--output", str(tmp_path / "out"), "--dataset", "mnist"]
    rc = main([*argv, "--data-dir", str(folder)])
    _check_refusal(capsys, rc, "--dataset", str(folder / MNIST_IMAGES))
    assert not (tmp_path / "out").exists()
