"""SWAG, VOGN and sharded metrics across two ``gloo`` ranks, against one process.

One spawn of two ranks runs every phase (importing the package dominates a rank's start-up); each
rank writes its results to a file and the tests below compare them with one process on the
concatenated batches. The set-up (data, model, shards) is shared with test_data_parallel.py.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_bdl.diagnostics import metrics
from pyro_bdl.distributed import (
    DataParallelSVI,
    allreduce_mean,
    shard_range,
    sharded_metrics,
)
from pyro_bdl.distributed.overlap import decode_rows, encode_row
from pyro_bdl.guides import AutoSWAG
from pyro_bdl.infer import VOGN
from pyro_bdl.nn import init_to_network
from tests.distributed.test_data_parallel import (
    SEED,
    WORLD,
    _batch,
    _dataset,
    _model,
    spawn_phases,
)

pytestmark = pytest.mark.distributed

STEPS = 12
SWAG_START = 4  # collect after every step from this one on: 8 snapshots, rank 3 keeps 3
# Uneven test shards: rank 0 scores 23 examples, rank 1 the other 14.
N_TEST, SPLIT = 37, 23


# -- the phases, run on each rank and (for the reference) in one process ---------------------


def _swag_run(step_fn, guide) -> dict:
    for t in range(STEPS):
        step_fn(t)
        if t >= SWAG_START:
            guide.collect()
    return {
        "mean": guide.swag_mean.clone(),
        "m2": guide.swag_m2.clone(),
        "deviations": guide.swag_deviations.clone(),
        "collected": guide.num_collected,
        "loc": guide.loc.detach().clone(),
    }


def _swag_setup():
    x, y = _dataset()
    model = _model()
    guide = AutoSWAG(model, rank=3)
    guide(x[_batch(0, 0)], y[_batch(0, 0)])
    return x, y, model, guide, pyro.optim.SGD({"lr": 0.05, "momentum": 0.9})


def _phase_swag(rank: int) -> dict:
    """AutoSWAG's point estimate trained by DataParallelSVI, collected on every rank."""
    x, y, model, guide, optim = _swag_setup()
    svi = DataParallelSVI(model, guide, optim, Trace_ELBO(), shared_noise=True, seed=SEED)

    def step(t):
        idx = _batch(t, rank)
        svi.step(x[idx], y[idx])

    return _swag_run(step, guide)


def _swag_single() -> dict:
    x, y, model, guide, optim = _swag_setup()
    svi = SVI(model, guide, optim, Trace_ELBO())
    pyro.set_rng_seed(SEED)

    def step(t):
        idx = torch.cat([_batch(t, r) for r in range(WORLD)])
        svi.step(x[idx], y[idx])

    return _swag_run(step, guide)


def _vogn_run(reduce_fn, batch) -> dict:
    x, y = _dataset()
    vogn = VOGN(_model(), dataset_size=len(y), lr=0.05, reduce_fn=reduce_fn)
    # Each rank sets up on its own first batch: the first step averages the initial curvature
    # s₀ across the ranks before it draws the weights, so the draw's σ is one process's.
    pyro.set_rng_seed(SEED)  # the same weight noise on every rank and in the reference
    losses = []
    for t in range(STEPS):
        idx = batch(t)
        losses.append(vogn.step(x[idx], y[idx]))
    state = vogn.state_dict()
    return {"mean": state["mean"], "state": state, "losses": losses}


def _phase_vogn(rank: int) -> dict:
    return _vogn_run(allreduce_mean(), lambda t: _batch(t, rank))


def _vogn_single() -> dict:
    return _vogn_run(None, lambda t: torch.cat([_batch(t, r) for r in range(WORLD)]))


def _test_set() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(3 * torch.randn(N_TEST, 4, generator=g, dtype=torch.float64), -1)
    return probs, torch.randint(0, 4, (N_TEST,), generator=g)


def _phase_metrics(rank: int) -> dict:
    probs, y = _test_set()
    part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, N_TEST)
    uneven = sharded_metrics(probs[part], y[part], num_bins=10)
    even = shard_range(N_TEST)  # 19 and 18
    balanced = sharded_metrics(probs[even], y[even], num_bins=10)
    empty = sharded_metrics(probs[:0] if rank else probs, y[:0] if rank else y, num_bins=10)
    for scores in (uneven, balanced, empty):
        scores["reliability"] = scores["reliability"].to_dict()
    out = {"uneven": uneven, "balanced": balanced, "empty": empty, "slice": (even.start, even.stop)}
    bad = probs[part].clone()
    if rank == 1:
        bad[0, 0] = float("nan")
    try:
        sharded_metrics(bad, y[part])
    except ValueError as error:
        out["refusal"] = str(error)
    return out


def _two_backward_passes(model, guide, *args, **kwargs) -> float:
    """A loss that runs backward twice per step (half the ELBO each), more passes than the
    buckets expect: its gradients arrive after their bucket started, so the step is stale. It
    returns a number, so SVI runs no backward of its own."""
    total = 0.0
    for _ in range(2):
        loss = TraceMeanField_ELBO().differentiable_loss(model, guide, *args, **kwargs) / 2
        loss.backward()
        total += loss.item()
    return total


def _overlap_run(rank: int, loss, **options) -> dict:
    pyro.clear_param_store()
    x, y = _dataset()
    model = _model()
    # AutoNormal keeps a loc and a scale per site: 8 tensors to split into buckets.
    guide = AutoNormal(model, init_loc_fn=init_to_network, init_scale=0.05)
    guide(x[_batch(0, rank)], y[_batch(0, rank)])
    optim = pyro.optim.Adam({"lr": 0.05})
    svi = DataParallelSVI(model, guide, optim, loss, shared_noise=True, seed=SEED, **options)
    started, stale = [], []
    for t in range(4):
        idx = _batch(t, rank)
        svi.step(x[idx], y[idx])
        if svi._buckets is not None:
            started.append(svi._buckets.started_in_backward)
            stale.append(svi._buckets.stale)
    buckets = 0 if svi._buckets is None else len(svi._buckets.buckets)
    first, ordered = None, False
    if svi._buckets is not None:
        names = {id(p): n for n, p in pyro.get_param_store().named_parameters()}
        first = names[id(svi._buckets.buckets[0].params[0])]
        ordered = svi._buckets.ordered
    store = pyro.get_param_store()
    params = torch.cat([p.detach().reshape(-1) for _, p in sorted(store.named_parameters())])
    return {
        "params": params,
        "started": started,
        "stale": stale,
        "buckets": buckets,
        "first": first,
        "ordered": ordered,
    }


def _phase_overlap(rank: int) -> dict:
    """The same run with one bucket, with 8 small buckets (200 bytes each at most), without
    overlap, and with a loss whose extra backward pass makes every step stale."""
    return {
        "one": _overlap_run(rank, TraceMeanField_ELBO()),
        "small": _overlap_run(rank, TraceMeanField_ELBO(), bucket_cap_mb=200 / 2**20),
        "off": _overlap_run(rank, TraceMeanField_ELBO(), overlap=False),
        "two_passes": _overlap_run(rank, _two_backward_passes, bucket_cap_mb=200 / 2**20),
        "two_passes_off": _overlap_run(rank, _two_backward_passes, overlap=False),
    }


def _wb_loss(model, guide, x: torch.Tensor, replace: str) -> float:
    """½(x − w − b)², differentiated here. ``replace``: "new" replaces the gradient of b by a new
    tensor three times as large (not the bucket's view that autograd wrote into); "inplace"
    triples it in place, as ``clip_grad_norm_`` scales gradients; "graph" differentiates with
    ``create_graph=True`` and adds the penalty ½(w.grad² + b.grad²), which reads the gradients'
    graph (the double-backward pattern of a gradient penalty)."""
    w, b = pyro.param("w"), pyro.param("b")
    loss = 0.5 * (x - w - b) ** 2
    if replace == "graph":
        with warnings.catch_warnings():
            # torch's note that .grad and the parameter now form a reference cycle.
            warnings.filterwarnings("ignore", "Using backward\\(\\) with create_graph=True")
            loss.backward(create_graph=True)
        (0.5 * (w.grad**2 + b.grad**2)).backward()
        return loss.item()
    loss.backward()
    if replace == "new":
        b.grad = 3 * b.grad
    elif replace == "inplace":
        with torch.no_grad():
            b.grad.mul_(3)
    elif replace == "raise":
        b.grad = 3 * b.grad
        raise ValueError("this batch is refused after backward")
    return loss.item()


def _no_sites(x: torch.Tensor, replace: str) -> None:
    pass


def _wb_run(rank: int, loss, steps: list[str], *, momentum=0.0, hook=False, **options) -> dict:
    """Steps of SGD (learning rate 1) on w = 1 and b = 0 with ``loss(..., x, steps[t])``, where
    x = 2 on rank 0 and 4 on rank 1; ``hook`` doubles w's gradients (a user's gradient hook)."""
    pyro.clear_param_store()
    w = pyro.param("w", torch.tensor(1.0, dtype=torch.float64))
    pyro.param("b", torch.tensor(0.0, dtype=torch.float64))
    if hook:
        w.register_hook(lambda g: 2 * g)
    optim = pyro.optim.SGD({"lr": 1.0, "momentum": momentum})
    svi = DataParallelSVI(_no_sites, _no_sites, optim, loss, **options)
    x = torch.tensor(2.0 if rank == 0 else 4.0, dtype=torch.float64)
    store = pyro.get_param_store()
    out: dict = {"values": [], "grads_after": [], "stale": [], "refused": []}
    for arg in steps:
        try:
            svi.step(x, arg)
        except ValueError as error:
            out["refused"].append(str(error))
        out["values"].append((store["w"].item(), store["b"].item()))
        grads = [p.grad for _, p in store.named_parameters()]
        out["grads_after"].append(all(g is None or not g.any() for g in grads))
        if svi._buckets is not None:
            out["stale"].append(svi._buckets.stale)
    return out


def _skip_loss(model, guide, x: torch.Tensor, use: str) -> float:
    """½(x − w − b)², where b is read and differentiated ("yes"), not read ("no": ½(x − w)²),
    or read but not differentiated ("detached")."""
    w = pyro.param("w")
    b = torch.zeros((), dtype=w.dtype) if use == "no" else pyro.param("b")
    loss = 0.5 * (x - w - (b.detach() if use == "detached" else b)) ** 2
    loss.backward()
    return loss.item()


def _phase_grad_views(rank: int) -> dict:
    """A gradient hook and a replaced ``.grad`` with the gradients as bucket views: one bucket,
    a bucket per parameter (8 bytes each), and without overlap; a gradient scaled in place, a
    gradient penalty, a parameter skipped for a step then read without a gradient, and a loss
    that raises after replacing a gradient."""
    small, off = {"bucket_cap_mb": 8 / 2**20}, {"overlap": False}
    skipping = ["yes", "no", "detached"]
    refusing = ["none", "raise" if rank == 1 else "none", "none"]
    return {
        "one": _wb_run(rank, _wb_loss, ["new"] * 2, hook=True),
        "small": _wb_run(rank, _wb_loss, ["new"] * 2, hook=True, **small),
        "off": _wb_run(rank, _wb_loss, ["new"] * 2, hook=True, **off),
        **{
            f"{how}_{name}": _wb_run(rank, _wb_loss, [how] * 2, **options)
            for how in ("inplace", "graph")
            for name, options in (("small", small), ("off", off))
        },
        "skip_one": _wb_run(rank, _skip_loss, skipping, momentum=0.5),
        "skip_off": _wb_run(rank, _skip_loss, skipping, momentum=0.5, **off),
        "refused_small": _wb_run(rank, _wb_loss, refusing, **small),
        "refused_off": _wb_run(rank, _wb_loss, refusing, **off),
    }


class _FrozenGuide(nn.Module):
    """A guide module holding a frozen parameter outside the param store (a fixed encoder)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)

    def forward(self, x: torch.Tensor, use: str) -> None:
        pass


def _params_run(rank: int, *, tied: bool = False, frozen: bool = False, **options) -> dict:
    """One SGD step (lr 1) of _skip_loss on w = 1 and b = 0, where b is w under a second name
    (``tied``, as a PyroModule's tied weights land in the param store) or a frozen parameter
    sits in the guide (``frozen``); then whether the step loop's buckets outlive it."""
    pyro.clear_param_store()
    w = pyro.param("w", torch.tensor(1.0, dtype=torch.float64))
    pyro.param("b", w if tied else torch.tensor(0.0, dtype=torch.float64))
    guide = _FrozenGuide() if frozen else _no_sites
    optim = pyro.optim.SGD({"lr": 1.0})
    try:
        svi = DataParallelSVI(_no_sites, guide, optim, _skip_loss, **options)
        svi.step(torch.tensor(2.0 if rank == 0 else 4.0, dtype=torch.float64), "yes")
    except RuntimeError as error:
        return {"error": str(error)}
    store = pyro.get_param_store()
    buckets = weakref.ref(svi._buckets) if svi._buckets is not None else None
    del svi
    gc.collect()
    return {
        "values": (store["w"].item(), store["b"].item()),
        "buckets_alive": buckets is not None and buckets() is not None,
    }


def _phase_params(rank: int) -> dict:
    """Tied and frozen parameters, with one bucket, a bucket per parameter and no overlap."""
    small, off = {"bucket_cap_mb": 8 / 2**20}, {"overlap": False}
    return {
        f"{case}_{name}": _params_run(rank, **{case: True}, **options)
        for case in ("tied", "frozen")
        for name, options in (("one", {}), ("small", small), ("off", off))
    }


PHASES = {
    "swag": _phase_swag,
    "vogn": _phase_vogn,
    "metrics": _phase_metrics,
    "overlap": _phase_overlap,
    "grad_views": _phase_grad_views,
    "params": _phase_params,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_phases(tmp_path_factory.mktemp("methods"), PHASES)


# Two ranks and one process compute the same float64 quantities with sums in a different order
# (relative rounding 1e-16 per operation, amplified by at most a few hundred operations over
# 12 steps), so they agree far below 1e-12; every rank holds the same bits.
TOL = {"rtol": 1e-12, "atol": 1e-12}


def test_swag_moments_match_one_process(ranks):
    pyro.clear_param_store()
    single = _swag_single()
    swag = [r["swag"] for r in ranks]
    assert swag[0]["collected"] == swag[1]["collected"] == single["collected"] == STEPS - SWAG_START
    for key in ("mean", "m2", "deviations", "loc"):
        assert torch.equal(swag[0][key], swag[1][key]), key  # identical snapshots on every rank
        torch.testing.assert_close(swag[0][key], single[key], **TOL)
    # SGD moved the snapshots apart, so the second moment and deviations are not all zero.
    assert single["m2"].abs().max() > 1e-6 and single["deviations"].abs().max() > 1e-4


def test_vogn_with_shared_noise_matches_one_process(ranks):
    pyro.clear_param_store()
    single = _vogn_single()
    vogn = [r["vogn"] for r in ranks]
    assert vogn[0]["state"]["step"] == single["state"]["step"] == STEPS
    for key in ("mean", "momentum", "curvature"):
        assert torch.equal(vogn[0]["state"][key], vogn[1]["state"][key]), key
        torch.testing.assert_close(vogn[0]["state"][key], single["state"][key], **TOL)
    # The ranks report their own batch's loss (VOGN does not average it); the mean of the two
    # equals the loss on the concatenated batch, up to rounding of the KL added to each.
    local = torch.tensor([r["losses"] for r in vogn], dtype=torch.float64).mean(0)
    torch.testing.assert_close(local, torch.tensor(single["losses"], dtype=torch.float64), **TOL)
    assert (single["mean"] - _vogn_initial_mean()).abs().max() > 1e-3  # it trained


def _vogn_initial_mean() -> torch.Tensor:
    x, y = _dataset()
    vogn = VOGN(_model(), dataset_size=len(y))
    vogn.setup(x[:4], y[:4])
    return vogn.state_dict()["mean"]


@pytest.mark.parametrize("split", ["uneven", "balanced", "empty"])
def test_sharded_metrics_equal_unsharded(ranks, split):
    probs, y = _test_set()
    got = [r["metrics"][split] for r in ranks]
    assert got[0] == got[1] or all(
        got[0][k] == got[1][k] for k in ("n", "accuracy", "nll", "brier", "ece")
    )
    table = metrics.reliability(probs, y, num_bins=10).to_dict()
    assert got[0]["n"] == N_TEST
    # Counts are integers, exact in float64: accuracy and bin counts are equal, not close.
    assert got[0]["accuracy"] == metrics.accuracy(probs, y)
    assert got[0]["reliability"]["counts"] == table["counts"]
    assert got[0]["reliability"]["accuracy"] == table["accuracy"]
    # The NLL, Brier and confidence sums only change the order of 37 float64 additions:
    # relative error below 37 · 2^-53 ≈ 4e-15.
    for name, want in [
        ("nll", metrics.nll(probs, y)),
        ("brier", metrics.brier(probs, y)),
        ("ece", metrics.ece(probs, y, num_bins=10)),
    ]:
        assert got[0][name] == pytest.approx(want, rel=1e-14, abs=1e-15), name


def test_shard_range_covers_the_test_set(ranks):
    assert [r["metrics"]["slice"] for r in ranks] == [(0, 19), (19, 37)]
    for size, world in [(37, 2), (5, 3), (2, 4), (9, 1)]:
        parts = [shard_range(size, rank=r, world_size=world) for r in range(world)]
        assert list(range(size)) == [i for p in parts for i in range(p.start, p.stop)]
        assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) <= 1
    with pytest.raises(ValueError, match="rank must be"):
        shard_range(10, rank=2, world_size=2)


def test_a_bad_shard_is_refused_on_every_rank(ranks):
    messages = [r["metrics"].get("refusal") for r in ranks]
    assert messages[0] == messages[1]
    assert messages[0] is not None and "rank 1 refused its batch" in messages[0]
    assert "non-finite" in messages[0]


def test_one_process_scores_directly():
    probs, y = _test_set()
    scores = sharded_metrics(probs, y)
    assert scores["accuracy"] == metrics.accuracy(probs, y)
    assert scores["nll"] == pytest.approx(metrics.nll(probs, y), rel=1e-15)
    with pytest.raises(ValueError, match="probs contains 6 non-finite"):
        sharded_metrics(torch.full((2, 3), float("nan")), torch.zeros(2, dtype=torch.long))


def test_overlapped_buckets_give_the_same_bits(ranks):
    runs = [r["overlap"] for r in ranks]
    for run in runs:
        # Averaging in buckets during backward adds the same two numbers per entry as one
        # all-reduce after it, so the trajectories are bitwise equal, not just close.
        for name in ("one", "small"):
            assert torch.equal(run[name]["params"], run["off"]["params"]), name
        assert torch.equal(run["two_passes"]["params"], run["two_passes_off"]["params"])
        assert run["off"]["buckets"] == 0 and run["one"]["buckets"] == 1
        # Eight tensors of 3 to 24 float64 numbers, in buckets of at most 200 bytes.
        assert run["small"]["buckets"] > 4
        # Every bucket but the last started inside backward (that is the overlap); the last
        # waits for the ranks' control row (refusal status, loss, checksums). None was stale.
        # (The first step's buckets follow a guessed order and may be cut differently.)
        assert run["small"]["started"][1:] == [run["small"]["buckets"] - 1] * 3
        assert run["small"]["started"][0] > 0
        assert run["small"]["stale"] == [False] * 4
        # After the first step the buckets follow the order in which rank 0's gradients
        # arrived: the output layer's (site "2.weight" or "2.bias") first.
        assert run["small"]["ordered"] and ".2." in run["small"]["first"], run["small"]["first"]
        # Two backward passes: the first pass's hooks started buckets that the second pass then
        # changed, so each step was re-reduced after backward.
        assert run["two_passes"]["stale"] == [True] * 4
    assert torch.equal(runs[0]["small"]["params"], runs[1]["small"]["params"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_control_rows_survive_the_sum_bit_for_bit(dtype):
    # The ranks' control rows ride in the last gradient bucket: summed over ranks (as the
    # all-reduce does) each row must come back with the same bits, NaN, −0 and subnormals too.
    values = torch.tensor(
        [float("nan"), -0.0, 1e300, -3.7e-310, 123.456, float("-inf"), 2.0**32 - 1],
        dtype=torch.float64,
    )
    rows = torch.stack([values, values * 2, values - 1])
    total = sum(encode_row(rows[r], dtype, r, 3) for r in range(3))
    assert total.dtype == dtype
    back = decode_rows(total, len(values), 3)
    assert torch.equal(back.view(torch.int64), rows.view(torch.int64))


def test_gradient_hooks_and_replaced_gradients_survive_bucket_views(ranks):
    # ½(x − w − b)² at w = 1, b = 0 with x = 2 on rank 0 and 4 on rank 1: ∂/∂w = ∂/∂b = −1 and
    # −3. The hook doubles w's gradients (mean −4) and the loss triples b's (mean −6), so SGD
    # with lr 1 gives w = 5, b = 6; the second step's residuals −9 and −7 then give
    # w = 5 − 2·8 = −11 and b = 6 − 3·8 = −18. Small integers: exact in float64.
    for r in ranks:
        for name in ("one", "small", "off"):
            run = r["grad_views"][name]
            assert run["values"] == [(5.0, 6.0), (-11.0, -18.0)], name
            # Gradients do not outlive a step: none, or zeros, never the bucket's means.
            assert run["grads_after"] == [True, True], name
    # With a bucket per parameter, b's gradient arrives first in backward, so after the first
    # step's reorder its bucket starts during backward; replacing b.grad after that makes the
    # step stale, and the ranks reduce the replaced gradient again after backward.
    assert ranks[0]["grad_views"]["small"]["stale"] == [False, True]
    assert ranks[0]["grad_views"]["one"]["stale"] == [False, False]


def test_gradients_changed_in_place_after_their_bucket_started_are_averaged(ranks):
    # As above without the hook: ∂/∂w = −1 and −3 (mean −2), b's tripled in place (mean −6):
    # w = 3, b = 6; then ∂/∂w = 7 and 5 (mean 6) give w = 3 − 6 = −3, b = 6 − 18 = −12.
    # With a bucket per parameter, b's bucket starts during backward in the second step, before
    # the loss scales b.grad: the step must notice and average the scaled gradient.
    for r in ranks:
        for name in ("inplace_small", "inplace_off"):
            run = r["grad_views"][name]
            assert run["values"] == [(3.0, 6.0), (-3.0, -12.0)], name
            assert run["grads_after"] == [True, True], name
    assert ranks[0]["grad_views"]["inplace_small"]["stale"] == [False, True]


def test_a_gradient_penalty_reads_the_graph_of_the_gradients(ranks):
    # backward(create_graph=True) leaves g = w + b − x in w.grad and b.grad, with its graph; the
    # penalty ½(g² + g²) = g² adds 2g to each: 3g in all. g = −1 and −3 (mean −2): w = 1 + 6 = 7,
    # b = 6; then g = 11 and 9 (mean 10): w = 7 − 30 = −23, b = 6 − 30 = −24. Bucket views must
    # not cut the graph of a gradient that the loss still reads when its bucket starts.
    for r in ranks:
        for name in ("graph_small", "graph_off"):
            run = r["grad_views"][name]
            assert run["values"] == [(7.0, 6.0), (-23.0, -24.0)], name
            assert run["grads_after"] == [True, True], name


def test_a_parameter_skipped_for_a_step_keeps_its_zero_gradient(ranks):
    # SVI leaves the zero gradient of a parameter that a step does not read, so when a later
    # step reads it without differentiating it, the optimizer still steps it (SGD's momentum
    # moves it). Step 0: ∂/∂w = ∂/∂b = −1 and −3 (mean −2): w = 3, b = 2 (momentum buffers −2).
    # Step 1 reads w only: ∂/∂w = 1 and −1 (mean 0), buffer −1: w = 4. Step 2 reads b detached:
    # ∂/∂w = 4 and 2 (mean 3), buffer 2.5: w = 1.5; b's zero gradient, buffer −1: b = 3.
    # Halves and integers: exact. With and without overlap alike.
    for r in ranks:
        for name in ("skip_one", "skip_off"):
            assert r["grad_views"][name]["values"] == [(3.0, 2.0), (4.0, 2.0), (1.5, 3.0)], name


def test_a_gradient_replaced_before_a_refusal_does_not_outlive_the_step(ranks):
    # ∂/∂w = ∂/∂b = −1 and −3 (mean −2): w = 3, b = 2. Rank 1's loss then triples b.grad (whose
    # bucket started during backward) and refuses: nothing changes, and no gradient of the
    # refused step reaches the next one: ∂ = 3 and 1 (mean 2) give w = 1, b = 0 on both ranks.
    for r in ranks:
        for name in ("refused_small", "refused_off"):
            run = r["grad_views"][name]
            assert run["values"] == [(3.0, 2.0), (3.0, 2.0), (1.0, 0.0)], name
            assert len(run["refused"]) == 1 and "rank 1 refused" in run["refused"][0], name
            assert run["grads_after"] == [True, True, True], name


def test_a_parameter_under_two_names_is_stepped_once(ranks):
    # b is w: ½(x − 2w)² at w = 1 has ∂/∂w = −2(x − 2) = 0 and −4 (mean −2), so one SGD step
    # (lr 1) gives w = 3, as SVI gives; stepping the tensor once per name gave 5.
    for r in ranks:
        for name in ("one", "small", "off"):
            assert r["params"][f"tied_{name}"]["values"] == (3.0, 3.0), name


def test_a_frozen_guide_parameter_is_no_obstacle_to_overlap(ranks):
    # torch refuses a gradient hook on a tensor that does not require grad: the buckets must
    # not hook it. ∂/∂w = ∂/∂b = −1 and −3 (mean −2): w = 3, b = 2, as without overlap.
    for r in ranks:
        for name in ("one", "small", "off"):
            assert r["params"][f"frozen_{name}"].get("values") == (3.0, 2.0), name


def test_dropped_buckets_do_not_outlive_their_step_loop(ranks):
    # The parameters' gradient hooks held the buckets (two buffers the size of the gradients)
    # alive after the DataParallelSVI that built them was dropped.
    for r in ranks:
        for case in ("tied", "frozen"):
            for name in ("one", "small"):
                assert r["params"][f"{case}_{name}"]["buckets_alive"] is False, (case, name)
