"""IVON's cost: one :meth:`IVON.step` against one Adam step on one network (docs/design/ivon.md).

Each figure sets one IVON step (one MC sample, through the Pyro model of the lifted network,
the public API) beside one deterministic ``torch.optim.Adam`` step on the plain network, on the
same inputs. Networks: the small CNN of ``benchmarks/vogn_step.py`` on 1×28×28 inputs and
torchvision's ResNet-18 (10 classes) on 3×32×32 inputs; B = 32 and 128; random inputs and labels.

Time: one thread, process time; the two variants alternate step by step after a warm-up, in a
new random order every round (``benchmarks.resnet.interleaved``), and each takes the median of
its steps; the spread is the quartiles of the per-round ratios. ``--peer`` adds a third variant,
the reference implementation (the ``ivon-opt`` package of Shen et al., GPL, imported only here
and installed separately: ``pip install ivon-opt``) stepping the plain network with the same
hyperparameters, timed in the same rounds and set beside the same Adam step. Peak memory: the
most bytes of tensors alive at once during one step beyond those alive before it
(``benchmarks.resnet.peak_step_bytes``). Target: IVON/Adam ≤ 1.15 in time.

Usage::

    python -m benchmarks.ivon_step            # both networks, B = 32 and 128
    python -m benchmarks.ivon_step --quick    # a tiny network, few rounds (a smoke check)
    python -m benchmarks.ivon_step --nets resnet18 --peer   # with ivon-opt in the same rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import pyro
import torch
import torch.nn.functional as F
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


def peer_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> Callable[[], float]:
    """One step of ``ivon-opt``'s IVON on the plain network, as its README's training loop (one
    MC sample), with our IVON's settings: lr, β₁ = 0.9, β₂ = 0.99999, h₀ = 0.1, λ = N and the
    weight decay δ = 1/N of the N(0, 1) prior that :func:`ivon_step` lifts the network with."""
    import ivon  # benchmark-only peer, GPL: imported, never copied

    opt = ivon.IVON(
        net.parameters(),
        lr=LR_IVON,
        ess=n,
        hess_init=0.1,
        beta1=0.9,
        beta2=0.99999,
        weight_decay=1.0 / n,
    )

    def step() -> float:
        with opt.sampled_params(train=True):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
        opt.step()
        return loss.item()

    return step


def measure(
    build: Callable[[], nn.Module],
    shape: tuple[int, ...],
    n: int,
    batch: int,
    rounds: int,
    peer: bool = False,
) -> dict:
    """Median step times, peak memory and the IVON/Adam ratios for one network and batch (and,
    with ``peer``, ivon-opt's step in the same rounds, set beside the same Adam step)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    makers = {
        "adam": lambda net: resnet.plain_step(net, x, y, "adam"),
        "ivon": lambda net: ivon_step(net, x, y, n),
    }
    if peer:
        makers["ivon_opt"] = lambda net: peer_step(net, x, y, n)
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
    out: dict = {"seconds": seconds, "peak_bytes": peaks}
    for name in makers:
        if name == "adam":
            continue
        per_round = [a / b for a, b in zip(times[name], times["adam"])]
        out[f"{name}/adam"] = {
            "time": seconds[name] / seconds["adam"],
            "time_quartiles_per_round": resnet.quartiles(per_round),
            "peak_memory": peaks[name] / peaks["adam"] if peaks["adam"] else None,
        }
    return out


def _peer_version() -> str:
    from importlib.metadata import version

    return version("ivon-opt")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny network, few rounds")
    parser.add_argument("--batch-sizes", default="32,128", help="comma-separated, e.g. 32,128")
    parser.add_argument("--nets", default="cnn,resnet18", help="comma-separated: cnn,resnet18")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--peer", action="store_true", help="also time ivon-opt's IVON (pip install ivon-opt)"
    )
    parser.add_argument("--name", default="ivon_step", help="results/<name>.json")
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
            r = measure(build, shape, n, batch, rounds, peer=args.peer)
            figures[f"{name}/B={batch}"] = r
            for variant in ("ivon", "ivon_opt"):
                if f"{variant}/adam" not in r:
                    continue
                v = r[f"{variant}/adam"]
                q = v["time_quartiles_per_round"]
                print(
                    f"{name} B={batch} {variant}/adam: time {v['time']:.2f}x (per-round "
                    f"quartiles {q[0]:.2f}-{q[2]:.2f}; target <= {TARGET}), peak memory "
                    f"{v['peak_memory']:.2f}x",
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
        "ivon_opt": (
            {"package": "ivon-opt", "version": _peer_version(), "settings": "as ours"}
            if args.peer
            else None
        ),
        "adam": {"lr": resnet.LR_ADAM},
        "target_time_ratio": TARGET,
        # glibc returns freed D-long temporaries to the system (page faults on the next step)
        # unless MALLOC_MMAP_MAX_=0 with a large MALLOC_TRIM_THRESHOLD_ keeps them in the heap.
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
    }
    if not args.no_write and not args.quick:
        write(args.name, config, figures)
    return figures


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
