"""Checkpoints detect damage to tensor data, not only to their structure: every guide and
optimizer kind round-trips through :func:`~pyro_bdl.checkpoint.save_checkpoint` /
:func:`~pyro_bdl.checkpoint.load_checkpoint` with identical predictions, and a file with 16
bytes flipped inside one tensor is refused naming the file and the entry, with nothing changed.
"""

from __future__ import annotations

import copy
import hashlib
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, init_to_sample

import pyro_bdl as bdl
from pyro_bdl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pyro_bdl.checkpoint._files import checksums
from pyro_bdl.guides import (
    AutoEnsemble,
    AutoLaplace,
    AutoMeanField,
    AutoMultiSWAG,
    AutoRadial,
    AutoSubnetLaplace,
    AutoSWAG,
)
from tests.faults.common import assert_same, rng_states

N = 12


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 3, generator=g), torch.randint(0, 3, (N,), generator=g)


def network(seed: int):
    torch.manual_seed(seed)
    return bdl.bayesianize(
        torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    )


@dataclass
class Run:
    """What one kind saves and loads, and how it predicts."""

    net: torch.nn.Module
    model: Callable
    guide: object = None
    optim: object = None
    modules: dict = field(default_factory=dict)
    predict: Callable[[], torch.Tensor] | None = None

    def kwargs(self, load: bool = False) -> dict:
        out: dict = {"modules": {"net": self.net, **self.modules}}
        if self.guide is not None:
            out["guide"] = self.guide
            if load:  # a fresh autoguide is set up by load_checkpoint (VOGN and IVON stepped)
                out["example_args"] = data()
        if self.optim is not None:
            out["optim"] = self.optim
        return out

    def state(self) -> dict:
        """Copies of the param store, every RNG and each saved object's state."""
        out: dict = {
            "params": {n: v.detach().clone() for n, v in pyro.get_param_store().items()},
            "rng": rng_states(),
            "net": copy.deepcopy(self.net.state_dict()),
        }
        if isinstance(self.guide, torch.nn.Module):
            out["guide"] = copy.deepcopy(self.guide.state_dict())
        if self.optim is not None:
            out["optim"] = copy.deepcopy(self.optim.get_state())
        for name, m in self.modules.items():
            out[name] = copy.deepcopy(m.state_dict())
        return out


def _predictive(model, guide) -> Callable[[], torch.Tensor]:
    def predict():
        pyro.set_rng_seed(0)
        predictive = Predictive(model, guide=guide, num_samples=3, return_sites=["_RETURN"])
        return predictive(*data())["_RETURN"]

    return predict


def _svi_run(make_guide, *, seed: int, steps: int, swag: bool = False, fit: bool = False) -> Run:
    net = network(seed)
    model = bdl.models.classifier(net, N)
    guide = make_guide(model)
    optim = pyro.optim.Adam({"lr": 0.05})
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    for _ in range(steps):
        svi.step(x, y)
        if swag:
            guide.collect()
    if fit:
        guide.fit((x, y))
    return Run(net, model, guide, optim, predict=_predictive(model, guide))


def _members(kind: str, seed: int, trained: bool) -> Run:
    """An ensemble of two members, trained each after clearing the store, or a fresh one."""
    x, y = data()
    net = network(seed)
    model = bdl.models.classifier(net, N)
    if not trained:
        guide = (
            AutoEnsemble(model, 2) if kind == "AutoEnsemble" else AutoMultiSWAG(model, 2, rank=2)
        )
        return Run(net, model, guide, predict=_predictive(model, guide))
    members = []
    for k in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed + k)
        # SWAG starts at the network's weights and its SGD draws no noise: each member starts
        # from a prior draw of its own seed, or both runs would be one.
        member = (
            AutoDelta(model)
            if kind == "AutoEnsemble"
            else AutoSWAG(model, rank=2, init_loc_fn=init_to_sample)
        )
        svi = SVI(model, member, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        for _ in range(3):
            svi.step(x, y)
            if kind == "AutoMultiSWAG":
                member.collect()
        members.append(member.median() if kind == "AutoEnsemble" else member)
    pyro.clear_param_store()
    guide = (
        AutoEnsemble(model, members) if kind == "AutoEnsemble" else AutoMultiSWAG(model, members)
    )
    guide(x, y)
    return Run(net, model, guide, predict=_predictive(model, guide))


def _natural(kind: str, seed: int, steps: int) -> Run:
    net = network(seed)
    model = bdl.models.classifier(net, N)
    method = bdl.infer.VOGN if kind == "VOGN" else bdl.infer.IVON
    fit = method(model, dataset_size=N, lr=0.05)
    x, y = data()
    for _ in range(steps):
        fit.step(x, y)

    def predict():
        pyro.set_rng_seed(0)
        return torch.cat([fit.guide.loc.detach().reshape(-1), fit.guide.scale.detach().reshape(-1)])

    return Run(net, model, modules={"fit": fit}, predict=predict)


def _laplace(structure: str):
    return lambda model: AutoLaplace(model, hessian_structure=structure)


KINDS: dict[str, Callable[[int, bool], Run]] = {
    "AutoMeanField": lambda s, t: _svi_run(AutoMeanField, seed=s, steps=3 if t else 1),
    "AutoRadial": lambda s, t: _svi_run(AutoRadial, seed=s, steps=3 if t else 1),
    "AutoSWAG": lambda s, t: _svi_run(
        lambda m: AutoSWAG(m, rank=2), seed=s, steps=3 if t else 1, swag=True
    ),
    "AutoEnsemble": lambda s, t: _members("AutoEnsemble", s, t),
    "AutoMultiSWAG": lambda s, t: _members("AutoMultiSWAG", s, t),
    **{
        f"AutoLaplace ({h})": (
            lambda s, t, h=h: _svi_run(_laplace(h), seed=s, steps=3 if t else 1, fit=t)
        )
        for h in ("full", "kron", "diag")
    },
    "AutoSubnetLaplace": lambda s, t: _svi_run(
        lambda m: AutoSubnetLaplace(m, subnetwork="random", size=5),
        seed=s,
        steps=3 if t else 1,
        fit=t,
    ),
    "VOGN": lambda s, t: _natural("VOGN", s, 3 if t else 1),
    "IVON": lambda s, t: _natural("IVON", s, 3 if t else 1),
}


def _saved(kind: str, path: Path) -> tuple[Run, torch.Tensor]:
    run = KINDS[kind](0, True)
    save_checkpoint(path, step=3, **run.kwargs())
    assert run.predict is not None
    return run, run.predict()


def _fresh(kind: str) -> Run:
    """Another run of the same kind in a cleared store, set up (other weights than the file)."""
    pyro.clear_param_store()
    return KINDS[kind](1, False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_round_trips_with_identical_predictions(kind, tmp_path):
    path = tmp_path / "run.ckpt"
    _, expected = _saved(kind, path)
    run = _fresh(kind)
    assert run.predict is not None
    assert not torch.equal(run.predict(), expected)  # the load below has something to do
    info = load_checkpoint(path, **run.kwargs(load=True))
    assert info["step"] == 3
    assert torch.equal(run.predict(), expected)


def _tensor_records(path: Path) -> list[tuple[int, int]]:
    """(offset, size) of every tensor storage record inside a torch zip file."""
    out = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            if "/data/" not in info.filename or info.file_size < 16:
                continue
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            out.append((info.header_offset + 30 + name_len + extra_len, info.file_size))
    return out


def flip_16_bytes(path: Path) -> set[str]:
    """Flip 16 bytes in the middle of the largest tensor record; returns the entries whose
    bytes changed (read back without any check)."""
    before = checksums(torch.load(path, weights_only=True))
    offset, size = max(_tensor_records(path), key=lambda r: r[1])
    start = offset + size // 2 - 8
    raw = bytearray(path.read_bytes())
    raw[start : start + 16] = bytes(b ^ 0xFF for b in raw[start : start + 16])
    path.write_bytes(bytes(raw))
    after = checksums(torch.load(path, weights_only=True))  # torch itself reads it silently
    return {k for k in before if before[k] != after[k]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_byte_flip_inside_a_tensor_is_refused_naming_the_file_and_entry(kind, tmp_path):
    path = tmp_path / "run.ckpt"
    _saved(kind, path)
    damaged = flip_16_bytes(path)
    assert damaged, "the flip must land inside a saved tensor"
    run = _fresh(kind)
    before = run.state()
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, **run.kwargs(load=True))
    message = str(err.value)
    assert message.startswith(f"{str(path)!r} is corrupt: the data of {sorted(damaged)[0]}")
    assert "does not match the checksum saved with it" in message
    assert "Resume from another copy or an earlier checkpoint" in message
    assert_same(before, run.state())
    assert files == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    # Files written before checksums existed have none: they load unchecked.
    path = tmp_path / "old.ckpt"
    _, expected = _saved("AutoMeanField", path)
    payload = torch.load(path, weights_only=True)
    del payload["checksums"]
    torch.save(payload, path)
    run = _fresh("AutoMeanField")
    load_checkpoint(path, **run.kwargs(load=True))
    assert run.predict is not None and torch.equal(run.predict(), expected)


def test_damaged_plain_values_and_a_damaged_checksums_entry_are_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    _saved("AutoMeanField", path)
    payload = torch.load(path, weights_only=True)
    payload["step"] = 4  # what a flipped bit in the pickled step would do
    torch.save(payload, path)
    run = _fresh("AutoMeanField")
    with pytest.raises(
        CheckpointError, match=r"is corrupt: the data of <plain values> does not match"
    ):
        load_checkpoint(path, **run.kwargs(load=True))
    payload["checksums"] = "garbage"
    torch.save(payload, path)
    with pytest.raises(
        CheckpointError, match=r"is corrupt: its checksums entry is a str, not a dict"
    ):
        load_checkpoint(path, **run.kwargs(load=True))
