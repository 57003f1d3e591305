"""Fault injection, class 3 (data-parallel desync): one rank's batch is refused, and every rank
must raise the same error at the same step, change nothing, and stay in step for the next batch.

Two ``gloo`` ranks on 127.0.0.1 run every case in turn (one spawn for the module: importing the
package dominates a rank's start-up, about 2 s of CPU each). A rank writes its verdict of each
case (the error it raised, whether its state is what it was before the step, its parameters after
the next good step) to a file; the tests below read them. The parent owns a ``TCPStore`` bound to
port 0 (a free port picked atomically), every collective has a timeout, and the parent joins the
ranks with a deadline and terminates them after it, so a hang fails the tests instead of blocking
CI. Under pytest-xdist the workers share one run through a file lock.
"""

from __future__ import annotations

import json
import os
import random
import socket
import traceback
import warnings
from datetime import timedelta

import numpy as np
import pyro
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.distributed import (
    DataParallelSVI,
    StepAgreement,
    StepRefusedError,
    agree_on_refusal,
    allreduce_mean_,
)
from pyro_bdl.infer import VOGN
from pyro_bdl.nn import init_to_network
from pyro_bdl.priors import Normal

pytestmark = pytest.mark.distributed

WORLD = 2
N = 40
B = 4
BAD_STEP = 1  # step 0 is good on every rank; step 1 is refused on rank 1
# A collective waits for the slower rank; on a two-core machine busy with other work a rank was
# seen 30 s behind (it then aborted), so the bound is generous: a real hang still fails, in
# minutes, instead of blocking CI.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# Two spawned interpreters importing torch, Pyro and the package take about 7 s of wall time on a
# loaded two-core machine; the cases themselves take well under a second each.
JOIN_TIMEOUT_S = 300

SVI_CASES = [
    "nan",
    "labels",
    "shape",
    "nonfinite_loss",
    "nonfinite_grad",
    "both",
    "kinds",
    "evaluate",
]
VOGN_CASES = ["vogn_nan", "vogn_labels"]
CASES = SVI_CASES + VOGN_CASES


# -- shared set-up, used by the parent and by the ranks --------------------------------------


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (N,), generator=g
    )


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)]
    return bayesianize(nn.Sequential(*layers).double(), Normal(scale=1.0))


def _batch(case: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: good, except at BAD_STEP where the case breaks it."""
    x, y = _data()
    lo = (step * WORLD + rank) * B
    x, y = x[lo : lo + B].clone(), y[lo : lo + B].clone()
    if step != BAD_STEP:
        return x, y
    kind = "nan" if case == "evaluate" else case.removeprefix("vogn_")
    if kind == "both":  # rank 0's labels and rank 1's values are both bad
        kind = "labels" if rank == 0 else "nan"
    elif kind == "kinds":  # rank 0's labels are bad; rank 1's loss becomes NaN (_svi_case)
        kind = "labels" if rank == 0 else "good"
    elif rank != 1:
        return x, y
    if kind == "nan":
        x[2, 1] = float("nan")
    elif kind == "labels":
        y[0] = 7  # three classes
    elif kind == "shape":
        # Five features into a four-feature network (a private generator: the global one is state).
        x = torch.randn(B, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return x, y


def _same(a, b) -> bool:
    """Deep equality of nested dicts, lists, tuples, tensors and arrays (bitwise for tensors)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def snapshot(*objects) -> dict:
    """Everything a step may change: the random generators, the param store, and for each
    object its state (a module's state dict with its buffers, a Pyro optimizer's per-parameter
    state, VOGN's state dict), copied."""
    state: dict = {
        "rng": [torch.get_rng_state(), random.getstate(), np.random.get_state()],  # noqa: NPY002
        "params": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
    }
    for i, obj in enumerate(objects):
        if isinstance(obj, nn.Module):
            state[i] = {k: v.clone() for k, v in obj.state_dict().items()}
        elif isinstance(obj, pyro.optim.PyroOptim):
            state[i] = {k: _clone(v) for k, v in obj.get_state().items()}
        else:
            state[i] = _clone(obj.state_dict())
    return state


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _changed(before: dict, after: dict) -> list[str]:
    return [str(k) for k in before if not _same(before[k], after[k])]


# -- the ranks -------------------------------------------------------------------------------


def _poisoned_loss(poison: dict, where: str):
    """Trace_ELBO's loss, broken on the step where ``poison["on"]`` is set: NaN (a divergence),
    or finite with a NaN gradient for one parameter (d√(0·w)/dw = ∞·0)."""
    elbo = Trace_ELBO()

    def loss(model, guide, *args, **kwargs):
        value = elbo.differentiable_loss(model, guide, *args, **kwargs)
        if poison["on"] and where == "loss":
            return value * float("nan")
        if poison["on"]:
            return value + torch.sqrt(0.0 * pyro.param("AutoNormal.locs.0.weight")).sum()
        return value

    return loss


def _svi_case(case: str, rank: int) -> dict:
    model = models.classifier(_net(), N)
    guide = AutoNormal(model, init_loc_fn=init_to_network, init_scale=0.05)
    guide(*_batch(case, 0, rank))
    poison = {"on": False}
    nonfinite = case.startswith("nonfinite_") or case == "kinds"
    where = "loss" if case == "kinds" else case.removeprefix("nonfinite_")
    loss = _poisoned_loss(poison, where) if nonfinite else Trace_ELBO()
    optim = pyro.optim.Adam({"lr": 0.05})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNormWarning, checked in tests/distributed
        svi = DataParallelSVI(model, guide, optim, loss, seed=3)
    svi.step(*_batch(case, 0, rank))
    before = snapshot(model.net, optim)
    poison["on"] = rank == 1
    refused = svi.evaluate_loss if case == "evaluate" else svi.step
    verdict = _refusal(lambda: refused(*_batch(case, BAD_STEP, rank)))
    verdict["changed"] = _changed(before, snapshot(model.net, optim))
    poison["on"] = False
    svi.step(*_batch(case, 0, rank))  # the ranks are still in step: a good batch trains
    store = pyro.get_param_store()
    verdict["after"] = torch.cat([p.detach().reshape(-1) for _, p in sorted(store.items())])
    return verdict


def _vogn_case(case: str, rank: int) -> dict:
    model = models.classifier(_net(), N)
    agreement = StepAgreement(modules=[model.net])
    vogn = VOGN(model, dataset_size=N, lr=0.05, reduce_fn=agreement.wrap(allreduce_mean_))
    pyro.set_rng_seed(3 + rank)  # independent weight noise per rank
    with agreement.step():
        vogn.step(*_batch(case, 0, 0))  # the same first batch: the same initial curvature
    before = snapshot(model.net, vogn)

    def bad_step():
        with agreement.step():
            vogn.step(*_batch(case, BAD_STEP, rank))

    verdict = _refusal(bad_step)
    verdict["changed"] = _changed(before, snapshot(model.net, vogn))
    with agreement.step():
        vogn.step(*_batch(case, 0, rank))
    verdict["after"] = vogn.state_dict()["mean"]
    verdict["steps"] = agreement.num_steps_taken
    return verdict


def _refusal(step) -> dict:
    try:
        step()
    except Exception as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "ranks": getattr(error, "refused_ranks", None),
            "step": getattr(error, "step", None),
            "cause": type(error.__cause__).__name__ if error.__cause__ else None,
        }
    return {"type": None}


def _loopback() -> str | None:
    return next((n for _, n in socket.if_nameindex() if n in ("lo", "lo0")), None)


def _rank(rank: int, port: int, out_dir: str) -> None:
    if _loopback() is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback() or "")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        for case in CASES:
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            pyro.enable_validation(True)
            try:
                run = _vogn_case if case.startswith("vogn_") else _svi_case
                verdict = run(case, rank)
            except Exception:
                torch.save({"crash": traceback.format_exc()}, f"{out_dir}/{case}-{rank}.pt")
                return  # the ranks may be out of step now: run no further case
            torch.save(verdict, f"{out_dir}/{case}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """Every case's verdict from both ranks: one two-rank run, shared by the xdist workers."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, common to the workers
    shared = root / "faults-distributed"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / "lock")):
        status = shared / "status.json"
        if not status.exists():
            status.write_text(json.dumps(_spawn(str(shared))))
    problem = json.loads(status.read_text())
    out = {}
    for case in CASES:
        files = [shared / f"{case}-{r}.pt" for r in range(WORLD)]
        found = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
        out[case] = {"ranks": found, "problem": problem}
    return out


def _spawn(out_dir: str) -> str | None:
    """Run both ranks; a rank still alive at the deadline is a hang, and is terminated."""
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    procs = [context.Process(target=_rank, args=(r, store.port, out_dir)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=JOIN_TIMEOUT_S)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        codes = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        del store
    if hung:
        return f"ranks {hung} still running after {JOIN_TIMEOUT_S} s (a rank waits in a collective)"
    return None if codes == [0] * WORLD else f"exit codes {codes}"


def _ranks(verdicts: dict, case: str) -> list[dict]:
    found = verdicts[case]["ranks"]
    assert verdicts[case]["problem"] is None, verdicts[case]["problem"]
    for r, v in enumerate(found):
        assert v is not None, f"rank {r} wrote no verdict for {case!r}"
        assert "crash" not in v, f"rank {r}, {case!r}:\n{v['crash']}"
    return found


# -- what each rank would raise alone ----------------------------------------------------------


def _alone(case: str) -> Exception:
    """The error rank 1's bad batch raises in one process (the reason the ranks must quote)."""
    model = models.classifier(_net(), N)
    if case.startswith("vogn_"):
        vogn = VOGN(model, dataset_size=N, lr=0.05)
        vogn.step(*_batch(case, 0, 0))
        step = lambda: vogn.step(*_batch(case, BAD_STEP, 1))  # noqa: E731
    else:
        guide = AutoNormal(model, init_loc_fn=init_to_network, init_scale=0.05)
        guide(*_batch(case, 0, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svi = DataParallelSVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        svi.step(*_batch(case, 0, 1))
        step = lambda: svi.step(*_batch(case, BAD_STEP, 1))  # noqa: E731
    with pytest.raises(Exception) as caught:
        step()
    return caught.value


def _reason(error: Exception, agreed: type) -> str:
    return str(error) if type(error) is agreed else f"{type(error).__name__}: {error}"


# -- the tests ---------------------------------------------------------------------------------


def _assert_agreed(ranks: list[dict], expected_type: type, prefix: str, refused: list[int]):
    for r, v in enumerate(ranks):
        assert v["type"] == expected_type.__name__, (r, v)
        assert v["message"].startswith(prefix), (r, v["message"])
        assert "no rank changed any state" in v["message"]
        assert (v["ranks"], v["step"]) == (refused, BAD_STEP)
        assert v["changed"] == [], f"rank {r} changed {v['changed']} in the refused step"
        # A refusing rank chains its own error; the others had none.
        assert (v["cause"] is not None) == (r in refused)
    assert ranks[0]["message"] == ranks[1]["message"]


@pytest.mark.parametrize("case", ["nan", "labels", "shape", "evaluate", "vogn_nan", "vogn_labels"])
def test_one_rank_refuses_its_batch(verdicts, case):
    """Rank 1's batch has a NaN, a label out of range or a wrong feature width: both ranks raise
    the error rank 1 would raise alone, quoting it, at step 1, and change nothing."""
    ranks = _ranks(verdicts, case)
    alone = _alone(case)
    # The ranks raise rank 1's kind of error (a built-in base class for a project-specific one).
    kinds = [k for k in type(alone).__mro__ if k.__name__ == ranks[1]["type"]]
    assert kinds, f"{ranks[1]['type']} is not a kind of {type(alone).__name__}"
    agreed = kinds[0]
    prefix = f"rank 1 refused its batch at step {BAD_STEP}: {_reason(alone, agreed)}"
    _assert_agreed(ranks, agreed, prefix, [1])
    # Still in step: the next good batch trains both ranks to the same state.
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])
    if case.startswith("vogn_"):
        assert ranks[0]["steps"] == ranks[1]["steps"] == 2


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("nonfinite_loss", "its loss is nan"),
        ("nonfinite_grad", "the gradient of 'AutoNormal.locs.0.weight' is not finite"),
    ],
)
def test_one_rank_has_a_non_finite_loss_or_gradient(verdicts, case, reason):
    """Found on rank 1 before the gradients are averaged, so the message names the rank."""
    ranks = _ranks(verdicts, case)
    prefix = f"rank 1 refused its batch at step {BAD_STEP}: {reason}; nothing was updated"
    _assert_agreed(ranks, FloatingPointError, prefix, [1])
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])


def test_both_ranks_refuse_with_different_reasons(verdicts):
    """The lowest refusing rank's error kind wins, and each rank's reason is quoted."""
    ranks = _ranks(verdicts, "both")
    prefix = f"ranks 0, 1 refused their batches at step {BAD_STEP}: rank 0: "
    _assert_agreed(ranks, ValueError, prefix, [0, 1])
    assert "[0, 3)" in ranks[0]["message"] and "rank 1: " in ranks[0]["message"]
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])


def test_the_lowest_refusing_ranks_kind_of_error_wins(verdicts):
    """Rank 0 refuses its labels (ValueError), rank 1 its NaN loss (FloatingPointError): every
    rank raises rank 0's kind, quoting both reasons."""
    ranks = _ranks(verdicts, "kinds")
    prefix = f"ranks 0, 1 refused their batches at step {BAD_STEP}: rank 0: "
    _assert_agreed(ranks, ValueError, prefix, [0, 1])
    assert "rank 1: its loss is nan" in ranks[0]["message"]
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])


# -- one process: the same entry points, without a group ---------------------------------------


def test_one_process_raises_the_error_itself():
    with pytest.raises(KeyError, match="mine"):
        agree_on_refusal(KeyError("mine"), step=0)
    assert agree_on_refusal(None, [1.5, 2.0], step=0).tolist() == [[1.5, 2.0]]


def test_step_agreement_rolls_back_and_refuses_misuse():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    agreement = StepAgreement(modules=[net])
    before = snapshot(net)
    with pytest.raises(ValueError, match="bad batch"):
        with agreement.step():
            net(torch.randn(B, 4, dtype=torch.float64))  # moves the BatchNorm statistics
            torch.rand(3)  # and the generator
            raise ValueError("bad batch")
    assert _changed(before, snapshot(net)) == [] and agreement.num_steps_taken == 0
    with agreement.step():
        pass
    assert agreement.num_steps_taken == 1
    reduce = agreement.wrap(allreduce_mean_)
    with pytest.raises(RuntimeError, match=r"only inside `with agreement\.step"):
        reduce([torch.zeros(2)])
    with pytest.raises(TypeError, match="modules must be"):
        StepAgreement(modules=[object()])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="reduce_fn must be callable"):
        agreement.wrap(3)  # type: ignore[arg-type]
    assert issubclass(StepRefusedError, RuntimeError)
