"""Fault injection, checkpoints and state dicts: killed saves, malformed and mismatched files,
pickle payloads, and ``load_state_dict`` of a guide of another configuration.

Every refusal is checked for its type and message and for leaving nothing changed: the param
store, the guide's, modules' and optimizer's state, every RNG and the files on disk are
snapshotted before and compared after (:func:`snapshot`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import pickle
import random
import re
import signal
import sys
import time
from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import PyroOptim

import pyro_bdl as bdl
from pyro_bdl.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    load_checkpoint,
    save_checkpoint,
)
from pyro_bdl.checkpoint._files import FORMAT, VERSION, remove_stale, temporary_name
from pyro_bdl.guides import AutoMeanField, AutoRadial, AutoSubnetLaplace, AutoSWAG
from pyro_bdl.guides.state_checks import StateDictMismatchError
from tests.faults.common import assert_same, rng_states

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# "Nothing changed": snapshots of every piece of state a refused load could touch


def snapshot(*objects, folder: Path | None = None) -> dict:
    """Copies of the param store, every RNG, each object's state (a module's or VOGN's
    ``state_dict``, a Pyro optimizer's state, a generator's state) and the files in ``folder``."""
    state: dict = {
        "params": {n: v.detach().clone() for n, v in pyro.get_param_store().items()},
        "rng": rng_states(),
    }
    for i, obj in enumerate(objects):
        if isinstance(obj, torch.Generator):
            state[i] = obj.get_state()
        elif isinstance(obj, PyroOptim):
            state[i] = copy.deepcopy(obj.get_state())
        elif isinstance(obj, bdl.infer.VOGN) and obj.needs_setup:
            state[i] = "not set up"
        else:
            state[i] = copy.deepcopy(obj.state_dict())
    if folder is not None:
        state["files"] = {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<folder>"
            for p in sorted(folder.iterdir())
        }
    return state


# ---------------------------------------------------------------------------------------------
# A small classifier and its guides

N = 12


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 3, generator=g), torch.randint(0, 3, (N,), generator=g)


def network(hidden: int = 5):
    torch.manual_seed(0)
    return bdl.bayesianize(
        torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
    )


GUIDES = {
    "AutoMeanField": AutoMeanField,
    "AutoRadial": AutoRadial,
    "AutoSWAG": functools.partial(AutoSWAG, rank=3),
    "AutoSubnetLaplace": functools.partial(AutoSubnetLaplace, subnetwork="random", size=5),
}


def trained(name: str, *, hidden: int = 5, steps: int = 3, fit: bool = True, **options):
    """(net, guide, optim, generator): a few SVI steps (SWAG collects, Laplace is fitted)."""
    net = network(hidden)
    model = bdl.models.classifier(net, N)
    factory = GUIDES[name]
    guide = factory(model, **options) if options else factory(model)
    optim = pyro.optim.Adam({"lr": 0.05})
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    for _ in range(steps):
        svi.step(x, y)
        if isinstance(guide, AutoSWAG):
            guide.collect()
    if isinstance(guide, AutoSubnetLaplace) and fit:
        guide.fit((x, y))
    return net, guide, optim, torch.Generator().manual_seed(7)


def save_run(path: Path, name: str = "AutoMeanField", **options):
    net, guide, optim, gen = trained(name, **options)
    save_checkpoint(path, guide=guide, optim=optim, modules={"net": net}, generators={"g": gen})
    return net, guide, optim, gen


def fresh(name: str = "AutoMeanField", **options):
    """A new run of the same kind, set up (one step, so it differs from the saved one)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(123)
    return trained(name, steps=1, **options)


def forge(path: Path, edit) -> None:
    """Rewrite a checkpoint with ``edit(payload)`` applied (a damaged or forged file)."""
    payload = torch.load(path, weights_only=True)
    edit(payload)
    # Without checksums, as a release before them wrote it: the part checks are what is tested
    # (a file that keeps its checksums is refused as corrupt, test_checkpoint_corruption.py).
    payload.pop("checksums", None)
    torch.save(payload, path)


def load_refused(path: Path, objects, match: str, error=CheckpointMismatchError, **kwargs):
    """``load_checkpoint`` into ``objects`` raises ``error`` matching ``match``, naming the path,
    and leaves every piece of state (and the folder) as it was."""
    net, guide, optim, gen = objects
    before = snapshot(net, guide, optim, gen, folder=path.parent)
    with pytest.raises(error, match=match) as err:
        load_checkpoint(
            path, guide=guide, optim=optim, modules={"net": net}, generators={"g": gen}, **kwargs
        )
    assert path.name in str(err.value)
    assert_same(before, snapshot(net, guide, optim, gen, folder=path.parent))
    return str(err.value)


# ---------------------------------------------------------------------------------------------
# Class 2: interrupted writes

SIZE = 4 << 20  # float32 numbers: a 16 MiB file, tens of milliseconds to write and fsync


def _save_forever(path: Path) -> None:
    """The body of the forked writer: save the same checkpoint again and again, until killed."""
    try:
        for step in range(1, 10**9):
            save_checkpoint(path, step=step, rng=False)
    finally:
        os._exit(1)  # never return into the test runner's code


def _temporaries(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".tmp-" in n)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and fork are POSIX")
def test_saves_killed_mid_write_leave_a_whole_file_and_no_temporary_after_the_next_save(tmp_path):
    """A writer killed by SIGKILL at random moments of its save loop, five times: the target is
    always absent or a whole checkpoint, and the next save removes every temporary file."""
    weights = torch.randn(SIZE, generator=torch.Generator().manual_seed(0))
    pyro.param("w", weights)
    path = tmp_path / "c.ckpt"
    started = time.perf_counter()
    save_checkpoint(path, rng=False)
    write_time = time.perf_counter() - started
    path.unlink()
    moments = random.Random(0)
    mid_write = 0
    for kill in range(5):
        pid = os.fork()  # the writer inherits the imported library: no second interpreter start
        if pid == 0:
            _save_forever(path)
        reaped = False
        try:
            deadline = time.monotonic() + 30
            while not any(f".tmp-{pid}-" in n for n in os.listdir(tmp_path)):
                assert time.monotonic() < deadline, "the writer never started a save"
                time.sleep(0.0005)
            # The writer removed the temporaries of earlier (dead) writers before starting.
            assert all(f".tmp-{pid}-" in n for n in _temporaries(tmp_path))
            time.sleep(moments.uniform(0.0, write_time / 2))  # somewhere inside the write
            os.kill(pid, signal.SIGKILL)
            if kill < 4 or not hasattr(os, "waitid"):
                os.waitpid(pid, 0)
                reaped = True
            else:  # the last one stays a zombie (dead, not yet reaped by its parent)
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            left = [n for n in _temporaries(tmp_path) if f".tmp-{pid}-" in n]
            mid_write += bool(left)
            if path.exists():  # a whole checkpoint or nothing
                pyro.clear_param_store()
                info = load_checkpoint(path, rng=False)
                assert info["step"] >= 1
                assert torch.equal(pyro.param("w").detach(), weights)
            if kill == 4:  # one more save: it removes the zombie writer's temporary
                pyro.clear_param_store()
                pyro.param("w", weights)
                save_checkpoint(path, step=99, rng=False)
        finally:
            if not reaped:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    # The kills must have hit writes for this test to mean anything: with a delay of at most
    # half a write after the temporary file appears, a kill misses only if the write finished
    # first; all five missing would mean the file is too small for this machine.
    assert mid_write >= 1, f"no kill landed mid-write ({write_time=:.3f}s): raise SIZE"
    assert os.listdir(tmp_path) == ["c.ckpt"]
    assert load_checkpoint(path, rng=False)["step"] == 99


def test_stale_cleanup_removes_only_dead_writers_of_its_own_target(tmp_path):
    """The next save removes its own target's temporaries whose writer is gone; those of a live
    writer (a save in progress elsewhere), of other targets and other files stay."""
    pid = os.fork() if hasattr(os, "fork") else None
    if pid == 0:
        os._exit(0)
    dead = pid if pid is not None else 2**22 + 1  # reaped below: no process has that pid now
    if pid is not None:
        os.waitpid(pid, 0)
    path = tmp_path / "c.ckpt"
    own_dead = Path(temporary_name(str(path), dead))
    own_live = Path(temporary_name(str(path), os.getppid()))  # the test runner's parent
    own_mine = Path(temporary_name(str(path)))  # this process: perhaps another thread's save
    other = Path(temporary_name(str(tmp_path / "other.ckpt"), dead))
    unrelated = tmp_path / ".c.ckpt.tmp-notes"
    for f in (own_dead, own_live, own_mine, other, unrelated):
        f.write_bytes(b"partial")
    pyro.param("a", torch.ones(3))
    save_checkpoint(path)
    assert not own_dead.exists()
    assert own_live.exists() and own_mine.exists() and other.exists() and unrelated.exists()
    assert remove_stale(str(path)) == []


@pytest.mark.parametrize("where", ["fsync", "replace", "folder as target"])
def test_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch, where):
    pyro.param("a", torch.ones(3))
    path = tmp_path / "c.ckpt"
    if where == "folder as target":
        path.mkdir()
    else:
        save_checkpoint(path, step=1)
    before = snapshot(folder=tmp_path)

    def fail(*args, **kwargs):
        raise OSError("disk failure")

    if where != "folder as target":
        monkeypatch.setattr(os, where, fail)
    match = r"c\.ckpt.*is a folder" if where == "folder as target" else "disk failure"
    with pytest.raises(OSError, match=match):
        save_checkpoint(path, step=2)
    monkeypatch.undo()
    assert_same(before, snapshot(folder=tmp_path))
    assert _temporaries(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Class 2: missing, truncated, foreign and pickled files


def test_missing_truncated_and_foreign_files_name_the_path_and_change_nothing(tmp_path):
    path = tmp_path / "run.ckpt"
    objects = save_run(path)
    whole = path.read_bytes()
    objects = fresh()
    load_refused(
        tmp_path / "absent.ckpt", objects, r"absent\.ckpt.*does not exist", FileNotFoundError
    )
    for cut in (0, 1, 100, len(whole) // 2, len(whole) - 1):
        path.write_bytes(whole[:cut])
        load_refused(path, objects, r"run\.ckpt.*truncated or corrupt", CheckpointError)
    path.write_bytes(os.urandom(4096))
    load_refused(path, objects, r"run\.ckpt.*truncated or corrupt", CheckpointError)
    torch.save({"weights": torch.ones(2)}, path)
    load_refused(path, objects, r"run\.ckpt.*not a pyro_bdl checkpoint", CheckpointError)
    torch.save({"format": FORMAT, "version": VERSION + 1}, path)
    load_refused(path, objects, r"run\.ckpt.*format version 2", CheckpointError)
    path.unlink()
    path.mkdir()
    load_refused(path, objects, r"run\.ckpt.*a folder", IsADirectoryError)


class _CreatesAFile:
    """A pickle payload: unpickling it would create ``marker`` (open(marker, "w"))."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("container", ["torch zip file", "plain pickle"])
def test_a_pickle_payload_is_refused_without_running_it(tmp_path, container):
    path, marker = tmp_path / "evil.ckpt", tmp_path / "pwned"
    objects = save_run(tmp_path / "good.ckpt")
    payload = torch.load(tmp_path / "good.ckpt", weights_only=True)
    payload["extra"] = {"x": _CreatesAFile(marker)}
    if container == "torch zip file":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    objects = fresh()
    load_refused(
        path, objects, r"evil\.ckpt.*(truncated or corrupt|more than tensors)", CheckpointError
    )
    assert not marker.exists()


def test_torch_load_with_weights_only_is_the_only_loader():
    """No module of the library unpickles with anything but ``torch.load(weights_only=True)``."""
    calls = []
    for file in (ROOT / "pyro_bdl").rglob("*.py"):
        text = file.read_text()
        assert not re.search(r"\bpickle\.loads?\(|\bdill\.|cloudpickle", text), file
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start() : text.find(")", match.start()) + 1]
            calls.append(file.name)
            assert "weights_only=True" in call, f"{file}: {call}"
        assert "allow_pickle=True" not in text, file
    assert "_files.py" in calls


# ---------------------------------------------------------------------------------------------
# Class 2: malformed parts are refused before anything is restored


def _rng(payload) -> dict:
    return payload["rng"]


MALFORMED_RNG = {
    "torch state of floats": (
        lambda p: _rng(p).__setitem__("torch", _rng(p)["torch"].float()),
        r"rng\['torch'\]: expected a uint8 tensor",
    ),
    "torch state too short": (
        lambda p: _rng(p).__setitem__("torch", _rng(p)["torch"][:100]),
        r"rng\['torch'\]: not a generator state",
    ),
    "python state of the wrong length": (
        lambda p: _rng(p)["python"].__setitem__("internal", _rng(p)["python"]["internal"][:10]),
        r"rng\['python'\]: not a Python random state",
    ),
    "python state not a dict": (
        lambda p: _rng(p).__setitem__("python", [3, 1, 4]),
        r"rng\['python'\]: not a Python random state",
    ),
    "numpy keys too short": (
        lambda p: _rng(p)["numpy"].__setitem__("keys", _rng(p)["numpy"]["keys"][:5]),
        r"rng\['numpy'\]: not a NumPy MT19937 state",
    ),
    "numpy generator kind": (
        lambda p: _rng(p)["numpy"].__setitem__("kind", "PCG64"),
        r"rng\['numpy'\]: not a NumPy MT19937 state",
    ),
    "cuda state of floats": (
        lambda p: _rng(p).__setitem__("cuda", [torch.zeros(16)]),
        r"rng\['cuda'\]\[0\]: expected .*uint8",
    ),
    "cuda states not a list": (
        lambda p: _rng(p).__setitem__("cuda", "cuda:0"),
        r"rng\['cuda'\]: expected a list",
    ),
    "rng not a dict": (lambda p: p.__setitem__("rng", [1, 2]), r"rng: expected a dict"),
}


@pytest.mark.parametrize("case", list(MALFORMED_RNG))
def test_malformed_rng_state_is_refused_before_anything_is_restored(tmp_path, case):
    edit, match = MALFORMED_RNG[case]
    path = tmp_path / "c.ckpt"
    save_run(path)
    forge(path, edit)
    load_refused(path, fresh(), match)


def test_cuda_rng_states_for_absent_devices_warn_and_the_rest_restores(tmp_path):
    """Well-formed CUDA states for devices this process lacks (a GPU run resumed on CPU) are not
    an error: everything else restores, and the warning says GPU sampling is not bit-exact."""
    path = tmp_path / "c.ckpt"
    save_run(path)
    count = torch.cuda.device_count() + 1  # more devices than this machine has, GPU or not
    forge(path, lambda p: _rng(p).__setitem__("cuda", [torch.zeros(16, dtype=torch.uint8)] * count))
    expected = torch.load(path, weights_only=True)["rng"]["torch"]
    net, guide, optim, gen = fresh()
    with pytest.warns(CheckpointWarning, match="CUDA RNG states for"):
        info = load_checkpoint(
            path, guide=guide, optim=optim, modules={"net": net}, generators={"g": gen}
        )
    assert info["rng_restored"] and torch.equal(torch.get_rng_state(), expected)


def _first_optim_state(payload) -> dict:
    return next(iter(payload["optim"].values()))


DAMAGED_PARTS = {
    "optimizer moment of another shape": (
        lambda p: _first_optim_state(p)["state"][0].__setitem__("exp_avg", torch.zeros(7)),
        r"optim 'AutoMeanField.loc_rho': 'exp_avg' has shape \(7,\)",
    ),
    "optimizer state for two parameters": (
        lambda p: _first_optim_state(p)["param_groups"][0].__setitem__("params", [0, 1]),
        r"optim 'AutoMeanField.loc_rho': the file has state for 2 parameter",
    ),
    "optimizer state not a state_dict": (
        lambda p: p["optim"].__setitem__("AutoMeanField.loc_rho", {"lr": 0.1}),
        r"optim 'AutoMeanField.loc_rho': expected an optimizer state_dict",
    ),
    "generator state of floats": (
        lambda p: p["generators"].__setitem__("g", torch.zeros(5056)),
        r"generator 'g': expected a uint8 tensor",
    ),
    "guide entry of another shape": (
        lambda p: p["guide"].__setitem__("loc_rho", torch.zeros(2, 3)),
        r"guide key 'loc_rho': the state has shape \(2, 3\)",
    ),
    "guide entry not a tensor": (
        lambda p: p["guide"].__setitem__("loc_rho", [0.0] * 5),
        r"guide key 'loc_rho': the state holds a list, not a tensor",
    ),
    "module entry it does not have": (
        lambda p: p["modules"]["net"].__setitem__("0.bias", torch.zeros(5)),
        r"module 'net' key '0.bias': not in this module \(unexpected\)",
    ),
    "param value not a tensor": (
        lambda p: p["param_store"]["values"].__setitem__("AutoMeanField.loc_rho", 1.5),
        r"param 'AutoMeanField.loc_rho': the file holds a float",
    ),
    "param value of another shape than its fingerprint says": (
        lambda p: p["param_store"]["values"].__setitem__(
            "AutoMeanField.loc_rho", torch.zeros(2, 7)
        ),
        r"param 'AutoMeanField.loc_rho': the file has shape \(2, 7\), this process \(2, 38\)",
    ),
    "step not a number": (lambda p: p.__setitem__("step", "5"), r"step: expected an int >= 0"),
    "extra not a dict": (lambda p: p.__setitem__("extra", [1]), r"extra: expected a dict"),
    "fingerprint of another form": (
        lambda p: p.__setitem__("fingerprint", {"params": {}}),
        r"is damaged: a part of it does not have the form",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED_PARTS))
def test_a_damaged_part_is_refused_before_any_part_is_restored(tmp_path, case):
    """Restoring goes part by part; a part that would fail is found before the first one."""
    edit, match = DAMAGED_PARTS[case]
    path = tmp_path / "c.ckpt"
    save_run(path)
    forge(path, edit)
    load_refused(path, fresh(), match, error=CheckpointError)


def test_a_param_that_cannot_be_recreated_is_refused_before_any_is_created(tmp_path):
    """Into an empty param store (nothing set up) the file's params are created from their
    constraints; one without a plain-value constraint refuses the whole file first."""
    path = tmp_path / "c.ckpt"
    save_run(path)
    unknown = {"name": None, "repr": "interval(tensor([0.]), tensor([1.]))"}
    forge(
        path,
        lambda p: (
            p["param_store"]["values"].__setitem__("zz", torch.ones(2)),
            p["param_store"]["constraints"].__setitem__("zz", unknown),
        ),
    )
    pyro.clear_param_store()
    with pytest.raises(CheckpointMismatchError, match=r"cannot recreate param 'zz'.*example_args"):
        load_checkpoint(path, rng=False)
    assert list(pyro.get_param_store().keys()) == []


def test_a_refusal_after_the_lazy_set_up_gives_the_random_numbers_back(tmp_path):
    """With example_args, load_checkpoint sets a fresh guide up (drawing random numbers) before it
    can compare; a refusal then restores every RNG as it was."""
    path = tmp_path / "c.ckpt"
    save_run(path)
    forge(path, MALFORMED_RNG["torch state too short"][0])
    pyro.clear_param_store()
    guide = AutoMeanField(bdl.models.classifier(network(), N))
    rng = snapshot()["rng"]
    with pytest.raises(CheckpointMismatchError, match=r"rng\['torch'\]"):
        load_checkpoint(path, guide=guide, example_args=data())
    assert_same(rng, snapshot()["rng"])


# ---------------------------------------------------------------------------------------------
# Class 2: checkpoints of another architecture or configuration, for every guide and VOGN

MISMATCHES = {
    "AutoMeanField, other width": ("AutoMeanField", {}, {"hidden": 6}, r"guide key 'loc_rho'"),
    "AutoRadial, other width": ("AutoRadial", {}, {"hidden": 6}, r"guide key 'loc_rho'"),
    "AutoSWAG, other rank": (
        "AutoSWAG",
        {},
        {"rank": 5},
        r"guide key 'swag_deviations': the file has shape \(3, 38\), this process shape \(5, 38\)",
    ),
    "AutoSubnetLaplace, fitted on another size": (
        "AutoSubnetLaplace",
        {},
        {"size": 7},
        r"guide key 'ggn': the file has shape \(5, 5\), this process shape \(7, 7\)",
    ),
    "AutoSubnetLaplace, unfitted, rule of another size": (
        "AutoSubnetLaplace",
        {},
        {"size": 7, "fit": False},
        r"subnetwork of 5 weights; this guide's rule \(subnetwork='random'\) selects 7",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_checkpoint_of_another_configuration_is_refused_naming_keys(tmp_path, case):
    name, saved, loaded, match = MISMATCHES[case]
    path = tmp_path / "c.ckpt"
    save_run(path, name, **saved)
    pyro.clear_param_store()
    # Set up by one step; an unfitted Laplace guide's fitted buffers are empty placeholders.
    objects = trained(name, steps=1, **loaded)
    load_refused(path, objects, match)


def vogn_run(hidden: int = 5, batchnorm: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, hidden)]
    layers += [torch.nn.BatchNorm1d(hidden)] if batchnorm else []
    net = bdl.bayesianize(torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(hidden, 3)))
    return net, bdl.infer.VOGN(bdl.models.classifier(net, N), dataset_size=N, lr=1e-2)


def _vogn_state(**changes) -> dict:
    _, vogn = vogn_run(**changes.pop("arch", {}))
    x, y = data()
    vogn.step(x, y)
    state = vogn.state_dict()
    for key, value in changes.items():
        state[key] = value(state) if callable(value) else value
    return state


VOGN_STATES = {
    "other width": (
        lambda: _vogn_state(arch={"hidden": 6}),
        r"different model.*site '0.weight' \(6, 3\): only in the state",
    ),
    "other hidden parameters": (
        lambda: _vogn_state(arch={"batchnorm": True}),
        r"different model.*hidden '1.weight': the state has \(5,\), this model None",
    ),
    "hidden moment of another shape": (
        lambda: _vogn_state(
            arch={"batchnorm": True},
            hidden_curvature=lambda s: {k: torch.zeros(2) for k in s["hidden"]},
        ),
        r"'hidden_curvature' has entries",
    ),
    "optimizer without lr": (
        lambda: _vogn_state(optimizer={"state": {}, "param_groups": [{"betas": (0.9, 0.9)}]}),
        r"'optimizer' must be the state_dict",
    ),
    "optimizer with a beta of 1": (
        lambda: _vogn_state(
            optimizer=lambda s: {
                "state": {},
                "param_groups": [{**s["optimizer"]["param_groups"][0], "betas": (0.9, 1.0)}],
            }
        ),
        r"betas, two numbers in \[0, 1\)",
    ),
    "negative step": (lambda: _vogn_state(step=-1), r"'step' must be an int >= 0"),
    "zero temperature": (lambda: _vogn_state(temperature=0.0), r"'temperature' must be"),
    "mean of another size": (
        lambda: _vogn_state(mean=torch.zeros(3)),
        r"'mean' must have shape \(38,\)",
    ),
    "sites not pairs": (lambda: _vogn_state(sites=[1, 2]), r"'sites' must be a list"),
}


@pytest.mark.parametrize("case", list(VOGN_STATES))
def test_vogn_refuses_a_state_it_cannot_restore_before_any_change(case):
    make, match = VOGN_STATES[case]
    state = make()
    pyro.clear_param_store()
    net, vogn = vogn_run()
    x, y = data()
    vogn.step(x, y)
    before = snapshot(net, vogn)
    with pytest.raises(ValueError, match=match):
        vogn.load_state_dict(state)
    assert_same(before, snapshot(net, vogn))
    vogn.step(x, y)  # and it still trains


def test_vogn_of_another_architecture_into_a_fresh_vogn_is_refused_at_set_up():
    """The issue's example: the state is kept until VOGN first reads the model, then compared
    before anything is installed; no ``KeyError`` at the first step."""
    state = _vogn_state(arch={"hidden": 6})
    pyro.clear_param_store()
    net, vogn = vogn_run()
    vogn.load_state_dict(state)  # VOGN has not seen the model: checked when it does
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"different model.*'0.weight'"):
        vogn.step(*data())
    assert_same(before, snapshot(net))


def test_vogn_checkpoint_of_another_architecture_is_refused_naming_sites(tmp_path):
    net, vogn = vogn_run()
    vogn.step(*data())
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, modules={"vogn": vogn, "net": net})
    pyro.clear_param_store()
    net, vogn = vogn_run(hidden=6)
    vogn.step(*data())
    before = snapshot(net, vogn, folder=tmp_path)
    # The lifted network holds no tensors of its own here: only VOGN can tell.
    match = (
        r"(?s)c\.ckpt.*module 'vogn': the state_dict is from a different model.*'0.weight' \(5, 3\)"
    )
    with pytest.raises(CheckpointMismatchError, match=match):
        load_checkpoint(path, modules={"vogn": vogn, "net": net})
    assert_same(before, snapshot(net, vogn, folder=tmp_path))


# ---------------------------------------------------------------------------------------------
# Class 1: a guide's load_state_dict checks every entry before it copies any


def _other_rank(sd):
    sd["swag_deviations"] = torch.ones(5, sd["swag_deviations"].shape[1])


STATE_DICTS = {
    # The example: torch copies swag_mean and swag_sq_mean, then fails on the deviations.
    "AutoSWAG, other rank": ("AutoSWAG", _other_rank, "'swag_deviations': the state has shape"),
    "AutoSWAG, counter not a tensor": (
        "AutoSWAG",
        lambda sd: sd.__setitem__("swag_num_collected", 3),
        "'swag_num_collected': the state holds a int",
    ),
    "AutoMeanField, other width": (
        "AutoMeanField",
        lambda sd: sd.__setitem__("loc_rho", torch.zeros(2, 7)),
        r"'loc_rho': the state has shape \(2, 7\), this module \(2, 38\)",
    ),
    "AutoRadial, unexpected key": (
        "AutoRadial",
        lambda sd: sd.__setitem__("scales", torch.zeros(3)),
        "'scales': not in this module",
    ),
    "AutoMeanField, missing key": (
        "AutoMeanField",
        lambda sd: sd.pop("loc_rho"),
        "'loc_rho': missing from the state",
    ),
    "AutoSubnetLaplace, ggn of another size": (
        "AutoSubnetLaplace",
        lambda sd: sd.__setitem__("ggn", torch.zeros(4, 4)),
        r"'ggn': a subnetwork of 5 weights needs shape \(5, 5\)",
    ),
    "AutoSubnetLaplace, index out of range": (
        "AutoSubnetLaplace",
        lambda sd: sd.__setitem__("subnet_index", sd["subnet_index"] + 1000),
        r"subnet_index: indices outside \[0, 38\)",
    ),
    "AutoSubnetLaplace, other size": (
        "AutoSubnetLaplace",
        lambda sd: sd.update(
            subnet_index=torch.arange(7), ggn=torch.eye(7), scale_tril=torch.eye(7)
        ),
        r"fitted on a subnetwork of 7 weights; this guide's rule .* selects 5",
    ),
}


@pytest.mark.parametrize("case", list(STATE_DICTS))
def test_guide_load_state_dict_refuses_before_copying_any_entry(case):
    name, edit, match = STATE_DICTS[case]
    _, guide, _, _ = trained(name)
    state = {
        k: v.clone() + 1 if v.is_floating_point() else v.clone()
        for k, v in guide.state_dict().items()
    }
    edit(state)
    before = snapshot(guide)
    with pytest.raises(StateDictMismatchError, match=match) as err:
        guide.load_state_dict(state)
    assert "nothing was loaded" in str(err.value)
    assert_same(before, snapshot(guide))


def test_non_strict_load_still_checks_shapes_and_loads_what_fits():
    _, guide, _, _ = trained("AutoSWAG")
    state = {k: v.clone() for k, v in guide.state_dict().items()}
    _other_rank(state)
    before = snapshot(guide)
    with pytest.raises(StateDictMismatchError, match="swag_deviations"):
        guide.load_state_dict(state, strict=False)
    assert_same(before, snapshot(guide))
    state = {"swag_mean": guide.swag_mean + 1}
    result = guide.load_state_dict(state, strict=False)
    assert "loc" in result.missing_keys and torch.equal(guide.swag_mean, state["swag_mean"])


def test_a_guide_nested_in_a_module_is_checked_whole_too():
    _, guide, _, _ = trained("AutoSWAG")
    holder = torch.nn.Module()
    holder.guide = guide
    state = {k: v.clone() + 1 for k, v in holder.state_dict().items() if v.is_floating_point()}
    state["guide.swag_num_collected"] = guide.swag_num_collected.clone()
    state["guide.swag_deviations"] = torch.zeros(7, guide.swag_mean.numel())
    before = snapshot(guide)
    with pytest.raises(StateDictMismatchError, match=r"'guide\.swag_deviations'"):
        holder.load_state_dict(state)
    assert_same(before, snapshot(guide))


# ---------------------------------------------------------------------------------------------
# Each part goes back where it came from, and a damaged or missing part is named


def test_several_modules_and_generators_each_get_their_own_state_back(tmp_path):
    """Two modules of the same shape and two generators: every state goes back to the object
    of its own name (a state restored into a namesake of the same shape would load silently)."""
    torch.manual_seed(0)
    saved = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)}
    gens = {"a": torch.Generator().manual_seed(1), "b": torch.Generator().manual_seed(2)}
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, modules=saved, generators=gens)
    modules = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)}
    generators = {"a": torch.Generator(), "b": torch.Generator()}
    load_checkpoint(path, modules=modules, generators=generators)
    for name in ("a", "b"):
        assert torch.equal(modules[name].weight, saved[name].weight), name
        assert torch.equal(generators[name].get_state(), gens[name].get_state()), name


def test_a_module_the_file_does_not_hold_is_named(tmp_path):
    path = tmp_path / "c.ckpt"
    save_run(path)
    net, guide, optim, gen = fresh()
    before = snapshot(net, guide, optim, gen)
    with pytest.raises(CheckpointMismatchError, match=r"module 'other': only in this process"):
        load_checkpoint(path, guide=guide, optim=optim, modules={"net": net, "other": net})
    assert_same(before, snapshot(net, guide, optim, gen))


def test_a_negative_step_in_the_file_is_refused(tmp_path):
    path = tmp_path / "c.ckpt"
    save_run(path)
    forge(path, lambda p: p.__setitem__("step", -1))
    load_refused(path, fresh(), r"step: expected an int >= 0; got -1", error=CheckpointError)


def test_a_checksums_entry_missing_a_tensor_is_refused_naming_it(tmp_path):
    """The checksums entry must cover every tensor of the file: a digest gone missing (a
    damaged checksums entry) is a mismatch too, not a tensor that goes unchecked."""
    path = tmp_path / "c.ckpt"
    save_run(path)
    payload = torch.load(path, weights_only=True)
    where = "rng['torch']"
    del payload["checksums"][where]
    torch.save(payload, path)
    message = load_refused(path, fresh(), r"is corrupt: the data of", error=CheckpointError)
    assert where in message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads zombies from /proc")
def test_stale_cleanup_removes_the_temporary_of_a_dead_writer_not_reaped_yet(tmp_path):
    """A writer killed mid-write whose parent has not reaped it is a zombie: its pid still
    answers ``os.kill(pid, 0)``, yet it will never finish the file."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10.0
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit within 10 s"
            time.sleep(0.01)
        path = tmp_path / "c.ckpt"
        stale = Path(temporary_name(str(path), pid))
        stale.write_bytes(b"partial")
        assert remove_stale(str(path)) == [stale.name] and not stale.exists()
    finally:
        os.waitpid(pid, 0)


def test_a_file_of_a_newer_format_version_is_refused_naming_both_versions(tmp_path):
    """A newer release may store a part differently: reading it as this version's would
    restore the wrong values, so the header's version is checked before anything else."""
    path = tmp_path / "c.ckpt"
    save_run(path)
    forge(path, lambda p: p.__setitem__("version", VERSION + 1))
    load_refused(
        path,
        fresh(),
        rf"of format version {VERSION + 1} .*this version reads version {VERSION}",
        error=CheckpointError,
    )
