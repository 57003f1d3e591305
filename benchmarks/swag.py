"""SWAG costs: collect() vs an epoch, one sample vs a test-batch forward pass, and memory.

Targets (BENCHMARKS.md): collect cost / epoch time ≤ 2%; one sample (before BatchNorm refresh)
≤ 2× one test-batch forward pass, with no host–device copies; memory exactly (rank + 2)·D numbers
beyond the model. Run: ``python -m benchmarks.swag [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import time

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from benchmarks.common import cpu_times, gpu_times, write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.compare import problem as compare_networks
from pyro_bdl.data import load_digits
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


def _host_device_copies(fn) -> int:
    """Number of host<->device memcpy events while ``fn`` runs (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return sum(("HtoD" in n or "DtoH" in n) for n in names)


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

    posterior_sample = lambda: guide.get_posterior().sample()  # noqa: E731
    weights = guide.sample_weights()
    bnn.eval()

    def forward():
        with torch.no_grad(), poutine.condition(data=weights):
            bnn(x_test)

    def guide_call():
        with torch.no_grad():
            guide(x_test)

    x_big = ds.x_test.repeat(3, 1, 1, 1)[: 4 * TEST_BATCH].to(device)

    def forward_big():
        with torch.no_grad(), poutine.condition(data=weights):
            bnn(x_big)

    sample_t = time_it(posterior_sample)
    sample_dict_t = time_it(guide.sample_weights)
    guide_t = time_it(guide_call)
    forward_t = time_it(forward)
    forward_big_t = time_it(forward_big)
    epoch = step_t["median"] * steps_per_epoch
    figures = {
        "D": d,
        "collect_over_epoch": collect_t["median"] / epoch,
        "sample_over_forward": sample_t["median"] / forward_t["median"],
        "sample_weights_over_forward": sample_dict_t["median"] / forward_t["median"],
        "guide_call_over_forward": guide_t["median"] / forward_t["median"],
        "sample_over_forward_batch_1024": sample_t["median"] / forward_big_t["median"],
        "buffer_floats_over_D": floats / d,
        "buffer_floats_equal_rank_plus_2_D": floats == (RANK + 2) * d,
        "integer_counters": counters,
        "collect_reallocates": reallocated,
        "seconds": {
            "step": step_t["median"],
            "epoch": epoch,
            "collect": collect_t["median"],
            "sample": sample_t["median"],
            "forward": forward_t["median"],
        },
    }
    if device.type == "cuda":
        figures["collect_allocated_bytes_delta"] = mem1 - mem0  # type: ignore[operator]
        figures["sample_host_device_copies"] = _host_device_copies(posterior_sample)
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
                f"(target <= 2%)  sample/forward {fig['sample_over_forward']:.2f}x "
                f"(sample_weights {fig['sample_weights_over_forward']:.2f}x, guide call "
                f"{fig['guide_call_over_forward']:.2f}x; target <= 2x; vs a 1024-row batch "
                f"{fig['sample_over_forward_batch_1024']:.2f}x)  buffers "
                f"{fig['buffer_floats_over_D']:.0f}·D (= rank+2: "
                f"{fig['buffer_floats_equal_rank_plus_2_D']}) + {fig['integer_counters']} int, "
                f"reallocated {fig['collect_reallocates']}",
                flush=True,
            )
            if device.type == "cuda":
                print(
                    f"{key}: host-device copies per sample {fig['sample_host_device_copies']}, "
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
        "timing": "CPU process time, 1 thread, median of >= 15 after 4 warm-up calls",
        "elapsed_seconds": time.perf_counter() - start,
    }
    write("swag", config, results)


if __name__ == "__main__":
    main()
