"""IVON's cost: one :meth:`IVON.step` against one Adam step on one network (docs/design/ivon.md).

Each figure sets one IVON step (one MC sample, through the Pyro model of the lifted network,
the public API) beside one deterministic ``torch.optim.Adam`` step on the plain network, on the
same inputs. Networks: the small CNN of ``benchmarks/vogn_step.py`` on 1×28×28 inputs and
torchvision's ResNet-18 (10 classes) on 3×32×32 inputs; B = 32 and 128; random inputs and labels.

Time: one thread, process time; the two variants alternate step by step after a warm-up, in a
new random order every round (``benchmarks.resnet.interleaved``), and each takes the median of
its steps; the spread is the quartiles of the per-round ratios. Peak memory: the most bytes of
tensors alive at once during one step beyond those alive before it
(``benchmarks.resnet.peak_step_bytes``). Target: IVON/Adam ≤ 1.15 in time.

Usage::

    python -m benchmarks.ivon_step            # both networks, B = 32 and 128
    python -m benchmarks.ivon_step --quick    # a tiny network, few rounds (a smoke check)
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import pyro
import torch
from torch import nn

import pyro_bdl as bdl
from benchmarks import resnet
from benchmarks.common import write
from pyro_bdl.app.compare.problem import cnn

LR_IVON = 0.1
TARGET = 1.15

#: name -> (builder, input shape, dataset size N of the plate's scaling).
NETS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "cnn": (lambda: cnn((1, 28, 28), 10), (1, 28, 28), 60_000),
    "resnet18": (lambda: resnet.resnet18((3, 32, 32)), (3, 32, 32), 50_000),
}


def ivon_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> Callable[[], float]:
    model = bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(scale=1.0)), n)
    ivon = bdl.infer.IVON(model, dataset_size=n, lr=LR_IVON)
    return lambda: ivon.step(x, y)


def measure(
    build: Callable[[], nn.Module], shape: tuple[int, ...], n: int, batch: int, rounds: int
) -> dict:
    """Median step times, peak memory and the IVON/Adam ratios for one network and batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    makers = {
        "adam": lambda net: resnet.plain_step(net, x, y, "adam"),
        "ivon": lambda net: ivon_step(net, x, y, n),
    }
    steps = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        pyro.clear_param_store()
        fn = make(build())
        fn()  # the first step sets up (IVON reads the model, Adam allocates its moments)
        steps[name] = resnet._WithStore(fn, pyro.get_param_store().get_state())
    times = resnet.interleaved(steps, rounds=rounds)
    peaks = {k: resnet.peak_step_bytes(fn, "cpu") for k, fn in steps.items()}
    seconds = {k: statistics.median(v) for k, v in times.items()}
    per_round = [a / b for a, b in zip(times["ivon"], times["adam"])]
    return {
        "seconds": seconds,
        "peak_bytes": peaks,
        "ivon/adam": {
            "time": seconds["ivon"] / seconds["adam"],
            "time_quartiles_per_round": resnet.quartiles(per_round),
            "peak_memory": peaks["ivon"] / peaks["adam"] if peaks["adam"] else None,
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny network, few rounds")
    parser.add_argument("--batch-sizes", default="32,128", help="comma-separated, e.g. 32,128")
    parser.add_argument("--nets", default="cnn,resnet18", help="comma-separated: cnn,resnet18")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args, _ = parser.parse_known_args(argv)  # run_all passes its own argv through
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    nets = dict(NETS)
    if args.quick:
        nets = {"tiny": (lambda: resnet.wide_mlp((3, 4, 4), width=16), (3, 4, 4), 100)}
        batches = [4]
    else:
        unknown = [n for n in args.nets.split(",") if n and n not in NETS]
        if unknown:
            parser.error(f"--nets: unknown {unknown}; choose from {sorted(NETS)}.")
        nets = {n: NETS[n] for n in args.nets.split(",") if n}
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
    rounds = args.rounds or (2 if args.quick else 15)
    load = list(os.getloadavg())
    figures: dict = {}
    for name, (build, shape, n) in nets.items():
        for batch in batches:
            r = measure(build, shape, n, batch, rounds)
            figures[f"{name}/B={batch}"] = r
            v = r["ivon/adam"]
            q = v["time_quartiles_per_round"]
            print(
                f"{name} B={batch} ivon/adam: time {v['time']:.2f}x (per-round quartiles "
                f"{q[0]:.2f}-{q[2]:.2f}; target <= {TARGET}), peak memory {v['peak_memory']:.2f}x",
                flush=True,
            )
    config = {
        "nets": {
            "cnn": "compare.problem.cnn((1, 28, 28), 10): 2 conv + BatchNorm, N = 60000",
            "resnet18": "torchvision resnet18(num_classes=10), 3x32x32, N = 50000",
        },
        "batch_sizes": batches,
        "rounds": rounds,
        "threads": 1,
        "timer": "process time, interleaved",
        "ivon": {"lr": LR_IVON, "mc_samples": 1},
        "adam": {"lr": resnet.LR_ADAM},
        "target_time_ratio": TARGET,
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
    }
    if not args.no_write and not args.quick:
        write("ivon_step", config, figures)
    return figures


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
