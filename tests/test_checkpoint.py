"""Checkpoints: bit-exact resume in a new process, atomic plain-value files, refusals."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal

import pyro_bdl as bdl
from pyro_bdl.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    load_checkpoint,
    save_checkpoint,
)
from pyro_bdl.checkpoint._parts import constraint_from_spec, constraint_label, constraint_spec
from tests.scenarios import BayesianLinearRegression

ROOT = Path(__file__).resolve().parents[1]
K, STEPS = 5, 9  # killed after step 5 of 9: mid-epoch (4 batches per epoch), so data order matters
# AutoSWAG keeps its posterior in buffers (collected every step here), so they are checked too.
GUIDES = ["AutoNormal", "AutoDelta", "AutoMeanField", "AutoSWAG"]
VARIANTS = ("exact", "norng", "noopt")

# One training run, in a process of its own. Every source of randomness a real loop has is used:
# the guide's weight noise (torch), input jitter from Python `random` and from NumPy, and the
# data order from a dedicated torch.Generator, reshuffled each epoch.
WORKER = textwrap.dedent(
    """
    import os, random, signal, sys
    import numpy as np, pyro, torch
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoDelta, AutoNormal
    import pyro_bdl as bdl
    from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint

    mode, work, k, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    guides, variants = sys.argv[5].split(","), sys.argv[6].split(",")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    N, B = 24, 6

    def make_guide(name, model):
        if name in ("AutoNormal", "AutoDelta"):
            return {"AutoNormal": AutoNormal, "AutoDelta": AutoDelta}[name](model)
        import pyro_bdl.guides as guides
        if name == "AutoSWAG":
            return guides.AutoSWAG(model, rank=3)
        return getattr(guides, name)(model)

    def build(name, seed):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)  # Python, NumPy and torch
        data = torch.Generator().manual_seed(1)
        x, y = torch.randn(N, 3, generator=data), torch.randint(0, 3, (N,), generator=data)
        net = bdl.bayesianize(
            torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        )
        model = bdl.models.classifier(net, N)
        guide = make_guide(name, model)
        optim = pyro.optim.Adam({"lr": 0.05})
        order = torch.Generator().manual_seed(seed + 1)
        return x, y, net, guide, optim, SVI(model, guide, optim, Trace_ELBO()), order

    def one_step(svi, guide, x, y, order, state):
        if state["pos"] == 0:
            state["perm"] = torch.randperm(N, generator=order)
        idx = state["perm"][state["pos"] * B : (state["pos"] + 1) * B]
        state["pos"] = (state["pos"] + 1) % (N // B)
        jitter = torch.from_numpy(np.random.normal(0.0, 0.01, size=(B, 3)))
        xb = x[idx] + jitter + random.gauss(0.0, 0.01)
        loss = svi.step(xb, y[idx])
        if hasattr(guide, "collect"):
            guide.collect()
        return idx.tolist(), loss

    def result(guide, optim, order, log, start):
        store = pyro.get_param_store().get_state()["params"]
        py = random.getstate()
        np_state = np.random.get_state()
        return {
            "params": {n: v.detach().clone() for n, v in store.items()},
            "guide": {n: v.clone() for n, v in guide.state_dict().items()},
            "optim": optim.get_state(),
            "log": log,
            "start": start,  # the step counter the comparison starts from
            "rng": {
                "python": list(py[1]),
                "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
                "numpy_pos": int(np_state[2]),
                "torch": torch.get_rng_state(),
                "order": order.get_state(),
            },
        }

    for name in guides:
        if mode == "first":
            # The uninterrupted reference run, then the run that saves at step k and is killed.
            for killed in (False, True):
                x, y, net, guide, optim, svi, order = build(name, seed=0)
                state, log = {"pos": 0, "perm": None}, []
                for step in range(k + 2 if killed else steps):  # killed one step past k
                    if killed and step == k:
                        kw = dict(guide=guide, modules={"net": net}, generators={"order": order},
                                  step=step, extra=dict(state))
                        save_checkpoint(f"{work}/{name}.exact.ckpt", optim=optim, **kw)
                        save_checkpoint(f"{work}/{name}.norng.ckpt", optim=optim, rng=False, **kw)
                        save_checkpoint(f"{work}/{name}.noopt.ckpt", **kw)
                    log.append(one_step(svi, guide, x, y, order, state))
                if not killed:
                    torch.save(result(guide, optim, order, log[k:], k), f"{work}/{name}.full.pt")
        else:
            for variant in variants:
                # A different seed: whatever the checkpoint does not restore shows up.
                x, y, net, guide, optim, svi, order = build(name, seed=12345)
                info = load_checkpoint(
                    f"{work}/{name}.{variant}.ckpt", guide=guide, optim=optim,
                    modules={"net": net}, generators={"order": order}, example_args=(x[:B], y[:B]),
                )
                state, log = dict(info["extra"]), []
                for step in range(info["step"], steps):
                    log.append(one_step(svi, guide, x, y, order, state))
                out = result(guide, optim, order, log, info["step"])
                torch.save(out, f"{work}/{name}.{variant}.pt")
    if mode == "first":
        # Die the hard way, mid-run: nothing but the checkpoint survives.
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _run(work: Path, mode: str, guides, variants=("exact",)) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(work / "worker.py"), mode, str(work), str(K), str(STEPS)]
    cmd += [",".join(guides), ",".join(variants)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _resume_runs(work: Path) -> str:
    """The uninterrupted and the killed runs in one process, the resumed runs in a new one.

    Importing pyro_bdl costs seconds, so the runs of the different guides and variants share
    these two processes; each run starts from a cleared param store, new objects and its seed.
    """
    (work / "worker.py").write_text(WORKER)
    first = _run(work, "first", GUIDES)
    assert first.returncode == -9, first.stderr  # killed by SIGKILL after saving
    resumed = _run(work, "resume", GUIDES, VARIANTS)
    assert resumed.returncode == 0, resumed.stderr
    return resumed.stderr


def _load(work: Path, name: str, kind: str):
    return torch.load(work / f"{name}.{kind}.pt", weights_only=True)


def _assert_identical(a, b, where="result"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            _assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _check_exact(work: Path, name: str) -> None:
    full, resumed = _load(work, name, "full"), _load(work, name, "exact")
    assert len(full["log"]) == STEPS - K
    if name == "AutoSWAG":  # the buffers hold a real SWAG posterior, not zeros
        assert int(full["guide"]["swag_num_collected"]) == STEPS
    # Bit for bit: every parameter, the Adam moments and step counts, the data order and the
    # losses of steps k+1..n, the step counter, and all four generators at the end.
    _assert_identical(resumed, full, name)


def _check_differs(work: Path, stderr: str, name: str, variant: str) -> None:
    """Proves the exact check can fail: drop one part of the state and the runs part ways."""
    full, resumed = _load(work, name, "full"), _load(work, name, variant)
    for key in full["params"]:
        assert not torch.equal(full["params"][key], resumed["params"][key]), (variant, key)
    assert [i for i, _ in full["log"]] == [i for i, _ in resumed["log"]], name  # same batches
    assert [loss for _, loss in full["log"]] != [loss for _, loss in resumed["log"]], name
    if variant == "norng":
        assert f"{name}.norng.ckpt' was saved without RNG state" in stderr
        assert not torch.equal(full["rng"]["torch"], resumed["rng"]["torch"])
    else:
        assert f"{name}.noopt.ckpt' holds no optimizer state" in stderr
        for key in full["optim"]:
            moments = full["optim"][key]["state"][0], resumed["optim"][key]["state"][0]
            assert not torch.equal(moments[0]["exp_avg"], moments[1]["exp_avg"]), key


def test_resume_in_new_process_is_bit_exact_and_needs_every_part(tmp_path):
    """A run killed after step k and resumed from its checkpoint in a new process continues
    bit for bit like the uninterrupted run, for every guide; without the RNG or the optimizer
    state it does not. One test, so that pytest-xdist starts the processes only once."""
    stderr = _resume_runs(tmp_path)
    for name in GUIDES:
        _check_exact(tmp_path, name)
        for variant in ("norng", "noopt"):
            _check_differs(tmp_path, stderr, name, variant)


# ---------------------------------------------------------------------------------------------
# In-process checks: small, float64


def _setup(
    *, hidden=5, out=3, guide_cls=AutoNormal, likelihood="categorical", noise=0.5, device="cpu"
):
    torch.manual_seed(0)
    net = bdl.bayesianize(
        torch.nn.Sequential(
            torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out)
        )
    ).to(device)
    if likelihood == "categorical":
        model = bdl.models.classifier(net, 12)
        y = torch.randint(0, out, (6,))
    else:
        model = bdl.models.regressor(net, 12, noise)
        y = torch.randn(6)
    x, y = torch.randn(6, 3, dtype=torch.float64).to(device), y.to(device)
    guide = guide_cls(model)
    optim = pyro.optim.Adam({"lr": 0.05})
    svi = SVI(model, guide, optim, Trace_ELBO())
    return net, guide, optim, svi, x, y


@pytest.fixture
def f64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def test_file_loads_with_weights_only_and_holds_every_part(tmp_path, f64):
    net, guide, optim, svi, x, y = _setup()
    svi.step(x, y)
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "run.ckpt"
    save_checkpoint(
        path, guide=guide, optim=optim, modules={"net": net}, generators={"g": gen}, step=1,
        extra={"epoch": 0, "perm": torch.arange(4)},
    )  # fmt: skip
    payload = torch.load(path, weights_only=True)
    assert payload["step"] == 1 and payload["extra"]["epoch"] == 0
    assert set(payload["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert set(payload["optim"]) == set(pyro.get_param_store().keys())
    assert payload["fingerprint"]["guide"].endswith("AutoNormal")
    assert payload["fingerprint"]["likelihood"] == {"likelihood": "categorical"}
    assert os.listdir(tmp_path) == ["run.ckpt"]


@pytest.mark.parametrize("bad", [np.float64(1.0), np.zeros(2), object(), {1.5: 2}])
def test_non_plain_values_are_refused_before_writing(tmp_path, bad):
    with pytest.raises(TypeError, match=r"extra\['x'\]|key 1.5"):
        save_checkpoint(tmp_path / "c.ckpt", extra={"x": bad})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fail_at", ["save", "fsync", "replace"])
def test_write_is_atomic(tmp_path, monkeypatch, fail_at):
    pyro.param("a", torch.ones(3))
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, step=1)
    before = path.read_bytes()

    def partial_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    if fail_at == "save":
        monkeypatch.setattr(torch, "save", partial_save)
    else:
        monkeypatch.setattr(os, fail_at, fail)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, step=2)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c.ckpt"]  # no temporary file left behind
    assert path.read_bytes() == before  # the previous checkpoint is intact
    assert load_checkpoint(path)["step"] == 1


def test_missing_truncated_and_foreign_files_name_the_path(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match=r"nope\.ckpt"):
        load_checkpoint(missing)
    pyro.param("a", torch.ones(3))
    path = tmp_path / "c.ckpt"
    save_checkpoint(path)
    data = path.read_bytes()
    for cut in (0, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"c\.ckpt.*truncated or corrupt"):
            load_checkpoint(path)
    torch.save({"state": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match=r"c\.ckpt.*not a pyro_bdl checkpoint"):
        load_checkpoint(path)


def test_different_architecture_is_refused_naming_keys_before_any_change(tmp_path, f64):
    net, guide, optim, svi, x, y = _setup(hidden=5)
    svi.step(x, y)
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, guide=guide, optim=optim, modules={"net": net})
    pyro.clear_param_store()
    net, guide, optim, svi, x, y = _setup(hidden=6)
    guide(x, y)
    before = {n: v.detach().clone() for n, v in pyro.get_param_store().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(path, guide=guide, optim=optim, modules={"net": net})
    msg = str(err.value)
    assert "c.ckpt" in msg
    assert (
        "param 'AutoNormal.scales.0.weight': the file has shape (5, 3) softplus_positive, "
        "this process shape (6, 3) softplus_positive"
    ) in msg
    assert "guide key 'locs.2.weight_unconstrained': the file has shape (3, 5)" in msg
    assert "'AutoNormal.locs.2.bias'" not in msg  # unchanged shapes are not listed
    for n, v in pyro.get_param_store().items():
        assert torch.equal(v, before[n])


def test_different_guide_is_refused_naming_keys(tmp_path, f64):
    _, guide, _, svi, x, y = _setup()
    svi.step(x, y)
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, guide=guide)
    pyro.clear_param_store()
    _, guide, _, _, x, y = _setup(guide_cls=AutoDelta)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(path, guide=guide, example_args=(x, y))
    msg = str(err.value)
    assert (
        "guide 'class': the file has 'pyro.infer.autoguide.guides.AutoNormal', this process "
        "'pyro.infer.autoguide.guides.AutoDelta'"
    ) in msg
    assert "param 'AutoDelta.0.weight': only in this process" in msg
    assert "param 'AutoNormal.scales.0.weight': only in the file" in msg


@pytest.mark.parametrize("other", [{"likelihood": "gaussian"}, {"noise": 0.25}])
def test_different_likelihood_is_refused(tmp_path, f64, other):
    first = {"likelihood": "gaussian", "noise": 0.5} if "noise" in other else {}
    _, guide, _, svi, x, y = _setup(out=1, **first)
    svi.step(x, y)
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, guide=guide)
    pyro.clear_param_store()
    _, guide, _, _, x, y = _setup(out=1, **{"likelihood": "gaussian", "noise": 0.5, **other})
    key = "likelihood" if "likelihood" in other else "noise_scale"
    with pytest.raises(CheckpointMismatchError, match=f"model '{key}'"):
        load_checkpoint(path, guide=guide, example_args=(x, y))


def test_module_and_generator_mismatches(tmp_path, f64):
    net = torch.nn.Linear(2, 3)
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, modules={"net": net}, generators={"data": torch.Generator()})
    with pytest.raises(
        CheckpointMismatchError, match=r"module 'net' key 'weight': the file has shape \(3, 2\)"
    ):
        load_checkpoint(path, modules={"net": torch.nn.Linear(2, 4)})
    with pytest.raises(CheckpointMismatchError, match="generator 'other': only in this process"):
        load_checkpoint(path, generators={"other": torch.Generator()})
    with pytest.warns(CheckpointWarning, match="module 'net', generator 'data'.*not restored"):
        load_checkpoint(path)


def test_no_rng_state_warns(tmp_path):
    pyro.param("a", torch.ones(3))
    save_checkpoint(tmp_path / "c.ckpt", rng=False)
    with pytest.warns(CheckpointWarning, match="without RNG state.*not be bit-exact"):
        info = load_checkpoint(tmp_path / "c.ckpt")
    assert info["rng_restored"] is False


def _draws() -> list:
    """One draw of each generator, Gaussians first (they use the cached second Gaussian)."""
    return [
        random.gauss(0.0, 1.0),
        random.random(),
        float(np.random.standard_normal()),  # noqa: NPY002
        float(np.random.rand()),  # noqa: NPY002
        torch.rand(3).tolist(),
    ]


def test_every_rng_resumes_with_its_cached_gaussian(tmp_path):
    """Python's ``random.gauss`` and NumPy's legacy ``standard_normal`` draw Gaussians in pairs
    and keep the second for the next call; a resumed run must get that very number."""
    random.seed(1)
    np.random.seed(2)  # noqa: NPY002
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()  # noqa: NPY002
    save_checkpoint(tmp_path / "c.ckpt")
    expected = _draws()
    random.seed(9)  # another state, with no Gaussian cached
    np.random.seed(9)  # noqa: NPY002
    torch.manual_seed(9)
    assert load_checkpoint(tmp_path / "c.ckpt")["rng_restored"]
    assert _draws() == expected


def test_rng_false_leaves_every_generator_alone(tmp_path):
    save_checkpoint(tmp_path / "c.ckpt")
    _draws()  # move past the saved state
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())  # noqa: NPY002
    info = load_checkpoint(tmp_path / "c.ckpt", rng=False)
    assert info["rng_restored"] is False
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[2])
    assert (np.random.get_state()[1] == state[1]).all()  # noqa: NPY002


def test_lazy_guide_needs_example_args(tmp_path, f64):
    _, guide, _, _, _, _ = _setup()
    with pytest.raises(ValueError, match=r"has not created its parameters yet.*example_args"):
        load_checkpoint(tmp_path / "whatever.ckpt", guide=guide)
    with pytest.raises(TypeError, match="example_args must be a tuple"):
        load_checkpoint(tmp_path / "whatever.ckpt", guide=guide, example_args=[1])


@pytest.mark.parametrize("kind", ["AutoNormal", "AutoEnsemble"])
def test_a_guide_that_has_not_seen_the_model_is_refused_when_saving(tmp_path, f64, kind):
    """Its state_dict is empty then (an ensemble's members wait unpacked), so the file could
    never be loaded into the set-up guide: refused before anything is written."""
    _, guide, _, _, x, y = _setup()
    if kind == "AutoEnsemble":
        plain = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        members = [{n: p.detach().clone() for n, p in plain.named_parameters()}]
        guide = bdl.guides.AutoEnsemble(guide.model, members)
    with pytest.raises(ValueError, match=rf"the guide {kind} has not seen the model yet.*guide\("):
        save_checkpoint(tmp_path / "c.ckpt", guide=guide)
    assert os.listdir(tmp_path) == []
    guide(x, y)
    save_checkpoint(tmp_path / "c.ckpt", guide=guide)  # once set up, it saves and loads back
    load_checkpoint(tmp_path / "c.ckpt", guide=guide)


def test_resume_in_the_same_process_restores_live_optimizers(tmp_path, f64):
    """The optimizers already exist here, so their state is loaded into them directly."""
    net, guide, optim, svi, x, y = _setup()
    for _ in range(3):
        svi.step(x, y)
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim, modules={"net": net}, step=3)
    losses = [svi.step(x, y) for _ in range(3)]
    info = load_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim, modules={"net": net})
    assert info == {"step": 3, "extra": {}, "rng_restored": True, "optim_restored": True}
    assert [svi.step(x, y) for _ in range(3)] == losses


def test_a_live_lr_scheduler_gets_its_schedule_and_its_optimizers_moments_back(tmp_path, f64):
    """A Pyro scheduler holds a torch scheduler and its optimizer per parameter: both states
    go back, so the resumed steps use the saved rate and Adam moments."""
    _, guide, _, _, x, y = _setup()
    optim = pyro.optim.ExponentialLR(
        {"optimizer": torch.optim.Adam, "optim_args": {"lr": 0.05}, "gamma": 0.5}
    )
    svi = SVI(guide.model, guide, optim, Trace_ELBO())

    def steps(n):
        losses = []
        for _ in range(n):
            losses.append(svi.step(x, y))
            optim.step()
        return losses

    steps(2)
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)
    expected = steps(3)
    assert load_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)["optim_restored"]
    assert steps(3) == expected


def _saved_after_two_steps(path: Path, then: int) -> list[float]:
    """Save a run of :func:`_setup` after two steps; returns the losses of ``then`` more."""
    _, guide, optim, svi, x, y = _setup()
    for _ in range(2):
        svi.step(x, y)
    save_checkpoint(path, guide=guide, optim=optim)
    return [svi.step(x, y) for _ in range(then)]


def _resumed(path: Path):
    """``(guide, optim, svi, x, y)`` of a fresh run (new store, guide and optimizer) restored
    from ``path`` the way a new process would."""
    pyro.clear_param_store()
    _, guide, optim, svi, x, y = _setup()
    load_checkpoint(path, guide=guide, optim=optim, example_args=(x, y))
    return guide, optim, svi, x, y


def test_a_save_right_after_a_load_keeps_the_optimizer_state_not_used_yet(tmp_path, f64):
    """Into a fresh run the optimizer state waits for the first step; a checkpoint written
    before that step must still hold it, or a run resumed from it restarts Adam."""
    expected = _saved_after_two_steps(tmp_path / "a.ckpt", then=2)
    guide, optim, _, _, _ = _resumed(tmp_path / "a.ckpt")
    save_checkpoint(tmp_path / "b.ckpt", guide=guide, optim=optim)
    _, _, svi, x, y = _resumed(tmp_path / "b.ckpt")
    assert [svi.step(x, y) for _ in range(2)] == expected


def test_rng_must_be_restored_after_the_lazy_set_up(tmp_path, f64):
    """The ordering rule: Pyro's guide draws random numbers while it sets itself up."""
    expected = _saved_after_two_steps(tmp_path / "c.ckpt", then=3)
    _, _, svi, x, y = _resumed(tmp_path / "c.ckpt")
    assert [svi.step(x, y) for _ in range(3)] == expected
    # Wrong order: everything restored first (guide=None fills the store), and the guide sets
    # itself up inside the first step, drawing from the restored stream.
    pyro.clear_param_store()
    _, _, optim, svi, x, y = _setup()
    load_checkpoint(tmp_path / "c.ckpt", optim=optim)
    assert [svi.step(x, y) for _ in range(3)] != expected


class _DrawsWhenLoaded(torch.nn.Module):
    """A module whose ``load_state_dict`` draws a random number, as one that re-samples a
    buffer on loading would."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.zeros(2))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        torch.rand(1)
        return super().load_state_dict(state_dict, strict, assign)


def test_the_rng_is_restored_after_every_part_has_loaded(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "c.ckpt", modules={"m": _DrawsWhenLoaded()})
    expected = torch.rand(3)
    load_checkpoint(tmp_path / "c.ckpt", modules={"m": _DrawsWhenLoaded()})
    assert torch.equal(torch.rand(3), expected)


def _point_sigma_run():
    """A regressor with a point σ (param ``model.param_names[0]``) after one Adam step."""
    torch.manual_seed(0)
    net = bdl.bayesianize(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    )
    model = bdl.models.regressor(net, 12, 2.0, noise="point")
    x, y = torch.randn(6, 3), torch.randn(6)
    guide, optim = AutoNormal(model), pyro.optim.Adam({"lr": 0.1})
    svi = SVI(model, guide, optim, Trace_ELBO())
    svi.step(x, y)
    return model, guide, optim, svi, x, y


def test_an_old_plain_sigma_entry_resumes_with_its_optimizer_state(tmp_path):
    """A file from before per-model param names holds the point σ, and its Adam state, under
    plain ``"sigma"``; resumed into today's model the next step is the uninterrupted one."""
    model, guide, optim, svi, x, y = _point_sigma_run()
    (name,) = model.param_names
    path = tmp_path / "old.ckpt"
    save_checkpoint(path, guide=guide, optim=optim)
    svi.step(x, y)
    expected = {n: v.detach().clone() for n, v in pyro.get_param_store().items()}
    payload = torch.load(path, weights_only=True)
    for part in (
        payload["param_store"]["values"],
        payload["param_store"]["constraints"],
        payload["fingerprint"]["params"],
        payload["optim"],
    ):
        part["sigma"] = part.pop(name)
    payload.pop("checksums")  # such a file had none
    torch.save(payload, path)

    pyro.clear_param_store()
    guide, optim = AutoNormal(model), pyro.optim.Adam({"lr": 0.1})
    load_checkpoint(path, guide=guide, optim=optim, example_args=(x, y))
    SVI(model, guide, optim, Trace_ELBO()).step(x, y)
    store = pyro.get_param_store()
    assert sorted(store.keys()) == sorted(expected) and "sigma" not in store
    for n, value in expected.items():
        assert torch.equal(store[n].detach(), value), n


def test_a_users_own_sigma_param_is_not_taken_for_an_old_point_sigma(tmp_path):
    """The rename applies only to files without the model's own entry: a param the user named
    ``"sigma"`` beside it keeps its value, and so does the model's σ."""
    model, guide, optim, _, x, y = _point_sigma_run()
    (name,) = model.param_names
    pyro.param("sigma", torch.tensor(7.0))
    expected = {n: v.detach().clone() for n, v in pyro.get_param_store().items()}
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)
    pyro.clear_param_store()
    pyro.param("sigma", torch.tensor(0.0))  # the user's set-up creates it again
    load_checkpoint(tmp_path / "c.ckpt", guide=AutoNormal(model), example_args=(x, y))
    store = pyro.get_param_store()
    assert store["sigma"].detach().item() == 7.0
    assert torch.equal(store[name].detach(), expected[name])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_resume_on_device_restores_its_generator(tmp_path, f64, device):
    """On CUDA the guide's noise comes from the CUDA generator, which must be restored too."""
    _, guide, optim, svi, x, y = _setup(device=device)
    for _ in range(2):
        svi.step(x, y)
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)
    expected = [svi.step(x, y) for _ in range(3)] + [torch.randn(4, device=device)]
    pyro.clear_param_store()
    pyro.set_rng_seed(7)  # also reseeds CUDA
    _, guide, optim, svi, x, y = _setup(device=device)
    info = load_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim, example_args=(x, y))
    assert info["rng_restored"] and info["optim_restored"]
    resumed = [svi.step(x, y) for _ in range(3)] + [torch.randn(4, device=device)]
    assert resumed[:3] == expected[:3]
    assert torch.equal(resumed[3], expected[3])
    assert pyro.param("AutoNormal.locs.0.weight").device.type == device


def test_fitted_laplace_guide_resumes_into_an_unfitted_one(tmp_path, f64):
    """Post-hoc posteriors live in buffers that are empty until fit(): the placeholders accept
    the stored shapes, and the loaded guide holds exactly the saved posterior."""
    from pyro_bdl.guides import AutoSubnetLaplace

    laplace = functools.partial(AutoSubnetLaplace, subnetwork="last_layer")
    _, guide, optim, svi, x, y = _setup(guide_cls=laplace)
    for _ in range(3):
        svi.step(x, y)
    guide.fit((x, y))
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)
    expected = {k: v.clone() for k, v in guide.state_dict().items() if torch.is_tensor(v)}
    assert expected["scale_tril"].numel() > 0
    pyro.clear_param_store()
    _, guide, optim, _, x, y = _setup(guide_cls=laplace)
    load_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim, example_args=(x, y))
    assert guide.fitted
    _assert_identical({k: v for k, v in guide.state_dict().items() if torch.is_tensor(v)}, expected)
    torch.testing.assert_close(
        guide.covariance, expected["scale_tril"] @ expected["scale_tril"].T, rtol=0, atol=0
    )


def test_unfitted_laplace_guide_resumes_into_a_fitted_one_as_unfitted(tmp_path, f64):
    """The other way round: a run saved before fit() resumes into a guide fitted since; the
    file's empty placeholders fit any live shape, and the guide is unfitted again, as saved."""
    from pyro_bdl.guides import AutoSubnetLaplace

    laplace = functools.partial(AutoSubnetLaplace, subnetwork="last_layer")
    _, guide, optim, svi, x, y = _setup(guide_cls=laplace)
    for _ in range(3):
        svi.step(x, y)
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)
    expected = {k: v.clone() for k, v in guide.state_dict().items() if torch.is_tensor(v)}
    guide.fit((x, y))
    assert guide.fitted and guide.state_dict()["scale_tril"].numel() > 0
    load_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim)
    assert not guide.fitted
    _assert_identical({k: v for k, v in guide.state_dict().items() if torch.is_tensor(v)}, expected)


def test_empty_param_store_is_filled_from_the_file(tmp_path):
    pyro.param("loc", torch.randn(2, 3))
    pyro.param("scale", torch.rand(3) + 0.1, constraint=constraints.softplus_positive)
    pyro.param("p", torch.tensor([0.2, 0.7]), constraint=constraints.interval(0.0, 1.0))
    saved = {n: v.detach().clone() for n, v in pyro.get_param_store().items()}
    save_checkpoint(tmp_path / "c.ckpt")
    pyro.clear_param_store()
    load_checkpoint(tmp_path / "c.ckpt")
    store = pyro.get_param_store()
    assert store._constraints["scale"] is constraints.softplus_positive
    for n, v in saved.items():
        assert torch.equal(store[n].detach(), v)
        assert store.get_state()["params"][n].requires_grad


@pytest.mark.parametrize(
    "c",
    [
        constraints.real,
        constraints.positive,
        constraints.simplex,
        constraints.lower_cholesky,
        constraints.interval(-1.0, 2.0),
        constraints.greater_than(0.5),
        constraints.less_than(3.0),
        constraints.independent(constraints.positive, 1),
    ],
)
def test_constraints_round_trip_as_plain_values(c):
    spec = constraint_spec(c)
    back = constraint_from_spec(spec, param="p", path="c.ckpt")
    assert type(back) is type(c) and constraint_label(constraint_spec(back)) == constraint_label(
        spec
    )
    for attr in ("lower_bound", "upper_bound"):
        assert getattr(back, attr, None) == getattr(c, attr, None)


def test_unknown_constraint_asks_for_set_up():
    spec = constraint_spec(constraints.interval(torch.zeros(2), torch.ones(2)))
    with pytest.raises(CheckpointError, match=r"param 'p'.*example_args"):
        constraint_from_spec(spec, param="p", path="c.ckpt")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step": True}, "step must be an int >= 0"),
        ({"optim": object()}, "optim must be a pyro.optim.PyroOptim"),
        ({"modules": [torch.nn.Linear(1, 1)]}, "modules must be a dict"),
        ({"generators": {"g": 3}}, "generators must be a dict"),
        ({"extra": [1]}, "extra must be a dict"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(TypeError, match=match):
        save_checkpoint(tmp_path / "c.ckpt", **kwargs)
    assert os.listdir(tmp_path) == []


def test_negative_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="step must be >= 0"):
        save_checkpoint(tmp_path / "c.ckpt", step=-1)


# -- VOGN: a module that reads the model lazily and checks the state it is given ---------------


def vogn_cnn(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3, padding=1),
        torch.nn.BatchNorm2d(3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 4 * 4, 3),
    )
    bnn = bdl.bayesianize(net, bdl.priors.Normal(scale=0.5))
    model = bdl.models.classifier(bnn, 40)
    return bnn, bdl.infer.VOGN(model, dataset_size=40, lr=1e-2, num_particles=2)


def vogn_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 1, 4, 4, generator=g), torch.randint(0, 3, (40,), generator=g)


def test_vogn_resumes_bit_for_bit_through_a_checkpoint(tmp_path):
    x, y = vogn_data()
    bnn, vogn = vogn_cnn()
    for i in range(2):
        vogn.step(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    path = tmp_path / "vogn.ckpt"
    save_checkpoint(path, modules={"vogn": vogn, "net": bnn}, step=2)
    for i in range(2, 5):
        vogn.step(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])

    pyro.clear_param_store()
    fresh_bnn, fresh = vogn_cnn(seed=1)  # other initial weights: everything must come from the file
    with pytest.raises(ValueError, match=r"module 'vogn' has not seen the model.*example_args"):
        load_checkpoint(path, modules={"vogn": fresh, "net": fresh_bnn})
    info = load_checkpoint(path, modules={"vogn": fresh, "net": fresh_bnn}, example_args=(x, y))
    assert info["step"] == fresh.step_count == 2
    for i in range(2, 5):
        fresh.step(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    assert torch.equal(fresh.guide.loc, vogn.guide.loc)
    assert torch.equal(fresh.guide.scale, vogn.guide.scale)
    assert torch.equal(fresh_bnn[1].running_mean, bnn[1].running_mean)
    assert torch.equal(fresh_bnn[1].weight, bnn[1].weight)


def forge_earlier_vogn_state(path: Path) -> None:
    """Rewrite a checkpoint's VOGN state in the layout VOGN wrote when its μ, σ lived in the
    guide's state_dict and m, s in the optimizer's."""
    payload = torch.load(path, weights_only=True)
    new = payload["modules"]["vogn"]
    payload["modules"]["vogn"] = {
        "step": new["step"],
        "sites": new["sites"],
        "hidden": new["hidden"],
        "guide": {"loc": new["mean"], "scale": torch.ones_like(new["mean"])},
        "optimizer": {"state": {0: {"m": new["momentum"]}}, "param_groups": []},
    }
    payload.pop("checksums", None)  # that release wrote none
    torch.save(payload, path)


@pytest.mark.parametrize("case", ["earlier format", "other architecture"])
def test_a_vogn_state_it_cannot_restore_is_refused_before_any_change(tmp_path, case):
    x, y = vogn_data()
    _, vogn = vogn_cnn()
    vogn.step(x[:8], y[:8])
    path = tmp_path / "vogn.ckpt"
    save_checkpoint(path, modules={"vogn": vogn}, step=1)
    if case == "earlier format":
        forge_earlier_vogn_state(path)
        fresh_bnn, fresh = vogn_cnn(seed=1)
        match = "earlier layout"
    else:
        # The same module names, another architecture; without net= in the checkpoint only VOGN
        # itself can tell.
        sc = BayesianLinearRegression(n=40, d=3)
        fresh_bnn = sc.network()
        fresh = bdl.infer.VOGN(sc.model(fresh_bnn), dataset_size=40)
        x, y = sc.x, sc.y
        match = "different model"
    before = {k: v.clone() for k, v in fresh_bnn.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=match):
        load_checkpoint(path, modules={"vogn": fresh}, example_args=(x, y))
    # Set up (its initial state, as before a first step), but nothing restored or trained.
    assert fresh.step_count == 0
    mean = torch.cat([s.spec.init_value.reshape(-1) for s in fresh.layout])
    assert torch.equal(fresh.state.mean, mean)
    for k, v in fresh_bnn.state_dict().items():
        assert torch.equal(v, before[k]), k
    if case == "earlier format":  # and VOGN says the same when given the state directly
        state = torch.load(path, weights_only=True)["modules"]["vogn"]
        with pytest.raises(ValueError, match="earlier layout"):
            bdl.infer.VOGN(vogn.model, dataset_size=40).load_state_dict(state)


# map_location: a checkpoint saved on one device loads on another


def _saved_run(tmp_path):
    net, guide, optim, svi, x, y = _setup()
    for _ in range(2):
        svi.step(x, y)
    save_checkpoint(tmp_path / "c.ckpt", guide=guide, optim=optim, modules={"net": net})
    return net, guide, optim, svi, x, y


def _param_values() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


@pytest.mark.parametrize("meta", ["meta", torch.device("meta"), {"cpu": "meta"}])
def test_map_location_meta_is_refused_before_anything_changes(tmp_path, f64, meta):
    net, guide, optim, svi, x, y = _saved_run(tmp_path)
    svi.step(x, y)  # the live state now differs from the file's
    before, rng = _param_values(), torch.get_rng_state()
    with pytest.raises(ValueError, match=r"map_location=.*meta.*no values.*'cpu' or 'cuda:0'"):
        load_checkpoint(
            tmp_path / "c.ckpt", guide=guide, optim=optim, modules={"net": net}, map_location=meta
        )
    after = _param_values()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (3.5, TypeError, r"map_location must be a device .* got float 3\.5"),
        ("nowhere", ValueError, r"map_location 'nowhere' is not a device"),
        ({"cpu": 0}, TypeError, r"map_location as a dict must map .* str -> str"),
    ],
)
def test_map_location_that_torch_load_cannot_use_is_refused_naming_it(tmp_path, bad, error, match):
    pyro.param("a", torch.ones(3))
    save_checkpoint(tmp_path / "c.ckpt")
    with pytest.raises(error, match=match):
        load_checkpoint(tmp_path / "c.ckpt", map_location=bad)


def test_map_location_is_honoured_for_every_tensor_of_the_file(tmp_path, f64):
    """torch.load calls a callable map_location once per stored tensor with the location it was
    saved on; the loaded values are copied into the live tensors and the run resumes exactly."""
    net, guide, optim, svi, x, y = _saved_run(tmp_path)
    expected = [svi.step(x, y) for _ in range(2)]
    seen: list[str] = []

    def to_cpu(storage, location):
        seen.append(location)
        return storage

    load_checkpoint(
        tmp_path / "c.ckpt", guide=guide, optim=optim, modules={"net": net}, map_location=to_cpu
    )
    assert seen and set(seen) == {"cpu"}
    assert [svi.step(x, y) for _ in range(2)] == expected


def test_new_param_store_entries_are_created_on_map_location(tmp_path, f64):
    """Without a guide the param store is filled from the file: its tensors are where
    map_location put them (here a torch.device and a saved-location dict, both the CPU)."""
    _saved_run(tmp_path)
    saved = _param_values()
    for where in (torch.device("cpu"), {"cpu": "cpu"}):
        pyro.clear_param_store()
        with pytest.warns(CheckpointWarning, match="module 'net'.*not restored"):
            load_checkpoint(tmp_path / "c.ckpt", map_location=where)
        loaded = _param_values()
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        assert {v.device.type for v in loaded.values()} == {"cpu"}
