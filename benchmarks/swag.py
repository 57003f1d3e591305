"""SWAG costs: collect() vs an epoch, one sample vs a test-batch forward pass, and memory.

Targets: collect cost / epoch time ≤ 2%; one sample (before BatchNorm refresh)
≤ 2× one test-batch forward pass (256 rows; 1024 rows reported too), with no host–device copies;
memory exactly (rank + 2)·D numbers beyond the model. Also reported: the floor of a sample (one
normal draw of D + K numbers plus one read of the K × D deviations), the guide's full call, the
``cache_std=True`` variant, and operators reading values back to the host (counted on any device;
on a GPU, profiled memcpy events too). Run: ``python -m benchmarks.swag [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from benchmarks.common import cpu_times, gpu_times, write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.app.compare import problem as compare_networks
from pyro_bdl.app.data import load_digits
from pyro_bdl.guides import AutoSWAG

RANK = 20
BATCH = 64
TEST_BATCH = 256


def networks(quick: bool) -> dict[str, nn.Module]:
    def mlp(width):
        return compare_networks.mlp((64,), 10, width)

    def cnn(width=16):
        return compare_networks.cnn((1,), 10, width)

    nets = {"mlp100": mlp(100), "cnn16": cnn()}
    if not quick:
        nets["mlp512"] = mlp(512)
    return nets


def _timer(device: torch.device):
    """``time(fn)`` -> dict of median/min seconds: process time on CPU, CUDA events on GPU."""
    if device.type != "cuda":
        return lambda fn, repeats=15: cpu_times(fn, warmup=4, repeats=repeats)

    return lambda fn, repeats=15: gpu_times(fn, warmup=4, repeats=repeats)


def side_by_side(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int = 4,
    repeats: int = 41,
) -> dict[str, float]:
    """Median seconds of each of ``fns``, timed **interleaved** (one call of each per round, in a
    fresh random order each round), so that load from neighbours on a shared machine, and what
    the previous call left in the caches, hit every figure alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order, shuffle = list(fns.items()), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name, fn in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.process_time()
                fn()
                times[name].append(time.process_time() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _host_device_copies(fn) -> int:
    """Number of host<->device memcpy events while ``fn`` runs (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return sum(("HtoD" in n or "DtoH" in n) for n in names)


def _host_reads(fn) -> int:
    """Operators that read a tensor's value back to the host (``.item()``, ``bool(t)``, ``.cpu()``,
    ``.tolist()``...) while ``fn`` runs: each is a host–device copy and sync on a GPU. Counted on
    any device by dispatch-level interception, so the CPU run checks it too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"_local_scalar_dense", "_to_copy", "_copy_from", "_copy_from_and_resize"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in reads:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def measure(name: str, net: nn.Module, device: torch.device) -> dict:
    ds = load_digits(seed=0)
    x_train, y_train = ds.x_train.to(device), ds.y_train.to(device)
    x_test = ds.x_test[:TEST_BATCH].to(device)
    pyro.clear_param_store()
    bnn = bayesianize(net.to(device), priors.Normal(scale=1.0))
    model = models.classifier(bnn, len(y_train))
    guide = AutoSWAG(model, rank=RANK)
    n = len(y_train)
    svi = SVI(model, guide, pyro.optim.SGD({"lr": 0.05 / n, "momentum": 0.9}), Trace_ELBO())
    steps_per_epoch = math.ceil(n / BATCH)
    time_it = _timer(device)
    batch = [0]

    def step():
        i = (batch[0] % steps_per_epoch) * BATCH
        batch[0] += 1
        svi.step(x_train[i : i + BATCH], y_train[i : i + BATCH])

    step_t = time_it(step)
    d = guide.latent_dim

    # Memory: what the guide holds beyond the point estimate loc (the model's weights).
    if device.type == "cuda":
        torch.cuda.synchronize()
    before = {b.data_ptr() for b in guide.buffers()}
    mem0 = torch.cuda.memory_allocated() if device.type == "cuda" else None
    collect_t = time_it(guide.collect, repeats=max(15, RANK + 5))
    mem1 = torch.cuda.memory_allocated() if device.type == "cuda" else None
    floats = sum(b.numel() for b in guide.buffers() if b.is_floating_point())
    counters = sum(b.numel() for b in guide.buffers() if not b.is_floating_point())
    reallocated = before != {b.data_ptr() for b in guide.buffers()}

    weights = guide.sample_weights()
    bnn.eval()
    # The test set repeated to 4 × 256 rows for the larger batch.
    x_big = ds.x_test.repeat(3, *([1] * (ds.x_test.dim() - 1)))[: 4 * TEST_BATCH].to(device)

    def forward(x):
        def run():
            with torch.no_grad(), poutine.condition(data=weights):
                bnn(x)

        return run

    def guide_call():
        # One posterior draw: the guide samples the SWAG posterior only when asked to.
        with torch.no_grad(), guide.sampling():
            guide(x_test)

    # The same statistics in a guide with cache_std=True (σ kept between collections: D more
    # numbers). It shares loc with ``guide`` through Pyro's param store, which sampling never reads.
    cached = AutoSWAG(model, rank=RANK, cache_std=True)
    cached(x_train[:BATCH], y_train[:BATCH])
    cached.load_state_dict(guide.state_dict())

    def sample_cached_std():
        cached.get_posterior().sample()

    # The floor of one sample: D + K normal draws and one read of the K × D deviations.
    dev = guide.swag_deviations
    z = torch.randn(d + RANK, device=device)
    out = torch.empty(d, device=device)
    t = side_by_side(
        {
            "forward": forward(x_test),
            "forward_1024": forward(x_big),
            "sample": lambda: guide.get_posterior().sample(),
            "sample_weights": guide.sample_weights,
            "sample_cached_std": sample_cached_std,
            "guide_call": guide_call,
            "floor_randn": lambda: torch.randn(d + RANK, device=device),
            "floor_gemv": lambda: torch.mv(dev.T, z[d:], out=out),
        },
        device,
    )
    epoch = step_t["median"] * steps_per_epoch
    floor = t["floor_randn"] + t["floor_gemv"]
    figures = {
        "D": d,
        "forward_rows": TEST_BATCH,
        "collect_over_epoch": collect_t["median"] / epoch,
        "sample_over_forward": t["sample"] / t["forward"],
        "sample_weights_over_forward": t["sample_weights"] / t["forward"],
        "guide_call_over_forward": t["guide_call"] / t["forward"],
        "sample_cached_std_over_forward": t["sample_cached_std"] / t["forward"],
        "sample_over_forward_batch_1024": t["sample"] / t["forward_1024"],
        "sample_weights_over_forward_batch_1024": t["sample_weights"] / t["forward_1024"],
        "guide_call_over_forward_batch_1024": t["guide_call"] / t["forward_1024"],
        "floor_over_forward": floor / t["forward"],
        "sample_over_floor": t["sample"] / floor,
        "sample_host_reads": _host_reads(lambda: guide.get_posterior().sample()),
        "guide_call_host_reads": _host_reads(guide_call),
        "buffer_floats_over_D": floats / d,
        "buffer_floats_equal_rank_plus_2_D": floats == (RANK + 2) * d,
        "cached_std_floats_over_D": 0 if cached._std is None else cached._std[1].numel() / d,
        "integer_counters": counters,
        "collect_reallocates": reallocated,
        "seconds": {
            "step": step_t["median"],
            "epoch": epoch,
            "collect": collect_t["median"],
            **t,
        },
    }
    if device.type == "cuda":
        figures["collect_allocated_bytes_delta"] = mem1 - mem0  # type: ignore[operator]
        figures["sample_host_device_copies"] = _host_device_copies(
            lambda: guide.get_posterior().sample()
        )
        figures["guide_call_host_device_copies"] = _host_device_copies(guide_call)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the wide MLP")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results: dict = {}
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    start = time.perf_counter()
    for device in devices:
        for name, net in networks(args.quick).items():
            fig = measure(name, net, device)
            key = f"{device.type}/{name}"
            results[key] = fig
            print(
                f"{key}: D={fig['D']}  collect/epoch {100 * fig['collect_over_epoch']:.3f}% "
                f"(target <= 2%)  sample/forward({TEST_BATCH} rows) "
                f"{fig['sample_over_forward']:.2f}x (sample_weights "
                f"{fig['sample_weights_over_forward']:.2f}x, guide call "
                f"{fig['guide_call_over_forward']:.2f}x, with cache_std "
                f"{fig['sample_cached_std_over_forward']:.2f}x; target <= 2x; floor "
                f"{fig['floor_over_forward']:.2f}x; vs {4 * TEST_BATCH} rows "
                f"{fig['sample_over_forward_batch_1024']:.2f}x / "
                f"{fig['guide_call_over_forward_batch_1024']:.2f}x)  host reads per sample "
                f"{fig['sample_host_reads']} / guide call {fig['guide_call_host_reads']}  buffers "
                f"{fig['buffer_floats_over_D']:.0f}·D (= rank+2: "
                f"{fig['buffer_floats_equal_rank_plus_2_D']}) + {fig['integer_counters']} int, "
                f"reallocated {fig['collect_reallocates']}",
                flush=True,
            )
            if device.type == "cuda":
                print(
                    f"{key}: host-device copies per sample {fig['sample_host_device_copies']} "
                    f"/ guide call {fig['guide_call_host_device_copies']}, "
                    f"allocated bytes change over collects {fig['collect_allocated_bytes_delta']}"
                )
    if not torch.cuda.is_available():
        print("gpu: not measured: no GPU lent")
        results["gpu"] = "not measured: no GPU lent"
    config = {
        "rank": RANK,
        "batch_size": BATCH,
        "test_batch": TEST_BATCH,
        "dataset": "digits",
        "quick": args.quick,
        "forward_rows": [TEST_BATCH, 4 * TEST_BATCH],
        "timing": (
            "CPU process time, 1 thread (CUDA events on GPU); sample, forward and floor timed "
            "interleaved in a random order per round, median of 41 rounds after 4 warm-up rounds; "
            "step and collect median of >= 15 after 4 warm-up calls"
        ),
        "elapsed_seconds": time.perf_counter() - start,
    }
    write("swag", config, results)


if __name__ == "__main__":
    main()
