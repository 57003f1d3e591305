"""VOGN's cost: squared per-example gradients and one VOGN step, as ratios (docs/design/vogn.md).

Figures, each measured side by side in one process on the same network and batch:

- ``sqgrad/fwd_bwd``: :class:`~pyro_bdl.curvature.PerExampleGradients` (forward with hooks,
  backward, Σg and Σg²) over a plain forward + ``loss.backward()``; ``vmap/fwd_bwd`` the same for
  the ``torch.func.vmap(grad)`` oracle, for reference.
- ``vogn/adam``: one :meth:`VOGN.step` (one MC sample, through the Pyro model of a lifted
  network) over one deterministic Adam step on the plain network; ``svi_autonormal/adam``: plain
  Pyro ``SVI`` + ``AutoNormal`` + ``Trace_ELBO`` on the same lifted network, for comparison.

CPU: MLP and small CNN on MNIST-size inputs, B ∈ {32, 128}, one thread. The five variants
(plain, hooks, Adam, VOGN, SVI) alternate step by step after a warm-up, in a new random order each
round, so a burst of load from a neighbour hits all of them alike and none always inherits a warm
cache from another; each figure is a ratio of medians of process time.

Wall clock: a step of this process never sleeps or waits (no voluntary context switch, about no
system time, one thread), but on a shared machine with more runnable processes than cores the
scheduler preempts it, and the other process's time slice then lands inside the step. A step
shorter than a slice (Adam on the MLP) escapes that in most repetitions, a longer one (VOGN) in
few, so the median wall ratio over-states the cost on a loaded machine. The benchmark counts the
involuntary context switches of every step (``getrusage``) and reports, besides the plain wall
ratio, the wall ratio over the steps that were not preempted (what a user sees on a machine of
their own) and the preempted fraction of each variant's steps; ``why wall differs`` gives per
variant the wall/process ratio, the preempted share, voluntary switches per step and the share of
system time, the evidence for this explanation.

GPU (when CUDA is present): ResNet-18 on CIFAR-size inputs, B = 128, CUDA events.

Usage::

    python -m benchmarks.vogn_step            # CPU figures (a few minutes on a loaded machine)
    python -m benchmarks.vogn_step --quick    # fewer repeats (a smoke test, not the protocol)
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time
from collections.abc import Callable

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from benchmarks.common import gpu_times, write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.app.compare.problem import cnn, mlp
from pyro_bdl.curvature import PerExampleGradients, substitute, vmap_squared_gradients
from pyro_bdl.infer import VOGN
from pyro_bdl.nn import init_to_network

N = 60_000  # dataset size for the plate's N/B scaling (MNIST-like)


def networks(device: str):
    if device == "cpu":
        shape = (1, 28, 28)
        return {"mlp": (lambda: mlp(shape, 10), shape), "cnn": (lambda: cnn(shape, 10), shape)}
    import torchvision

    return {"resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (3, 32, 32))}


def interleaved(fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 4) -> dict:
    """Alternate the variants step by step; per variant the median process time, the median
    wall time over all steps and over the steps not preempted, and the preempted fraction."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    rows: dict[str, list[tuple[float, float, int, int, float]]] = {k: [] for k in fns}
    # A fresh random order every round: a variant that always ran right after another on the
    # same network (hooks after plain) would find its weights in cache, the other never.
    rng = random.Random(0)
    names = list(fns)
    for _ in range(repeats):
        rng.shuffle(names)
        for name in names:
            fn = fns[name]
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            p0, w0 = time.process_time(), time.perf_counter()
            fn()
            proc, wall = time.process_time() - p0, time.perf_counter() - w0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            rows[name].append(
                (
                    proc,
                    wall,
                    r1.ru_nivcsw - r0.ru_nivcsw,  # preempted by the scheduler
                    r1.ru_nvcsw - r0.ru_nvcsw,  # gave up the CPU itself (sleep, lock, I/O)
                    r1.ru_stime - r0.ru_stime,  # in the kernel (page faults, system calls)
                )
            )
    out = {}
    for name, r in rows.items():
        quiet = [w for _, w, n, _, _ in r if n == 0]
        out[name] = {
            "median": statistics.median(p for p, *_ in r),
            "wall_median": statistics.median(w for _, w, *_ in r),
            # At least five unpreempted steps for a median; otherwise no figure.
            "wall_quiet": statistics.median(quiet) if len(quiet) >= 5 else None,
            "preempted": sum(n > 0 for _, _, n, _, _ in r) / len(r),
            "voluntary_switches_per_step": sum(v for *_, v, _ in r) / len(r),
            "system_time_share": sum(st for *_, st in r) / max(sum(p for p, *_ in r), 1e-12),
        }
    return out


def measure(build, shape, batch: int, device: str, repeats: int, with_vmap: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    torch.manual_seed(0)
    net = build().to(device)

    def plain():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y, reduction="sum").backward()

    def hooks():
        with PerExampleGradients(net) as tape:
            losses = F.cross_entropy(net(x), y, reduction="none")
        tape.squared_gradients(losses)

    # Adam trains a copy, so that plain and hooks see the same fixed network throughout.
    torch.manual_seed(0)
    adam_net = build().to(device)
    adam = torch.optim.Adam(adam_net.parameters(), lr=1e-3)

    def adam_step():
        adam.zero_grad(set_to_none=True)
        F.cross_entropy(adam_net(x), y).backward()
        adam.step()

    # The same network lifted, in a Pyro model, for VOGN and plain Pyro SVI + AutoNormal (each
    # on its own copy: SVI would otherwise also train the hidden BatchNorm parameters VOGN owns).
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = models.classifier(bayesianize(build().to(device), priors.Normal(scale=1.0)), N)
    vogn = VOGN(model, dataset_size=N, lr=1e-3, num_particles=1)
    torch.manual_seed(0)
    svi_model = models.classifier(bayesianize(build().to(device), priors.Normal(scale=1.0)), N)
    guide = AutoNormal(svi_model, init_loc_fn=init_to_network, init_scale=1e-2)
    svi = SVI(svi_model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    steps = {
        "fwd_bwd": plain,
        "sqgrad": hooks,
        "adam": adam_step,
        "vogn": lambda: vogn.step(x, y),
        "svi_autonormal": lambda: svi.step(x, y),
    }
    if device == "cpu":
        t = interleaved(steps, repeats=repeats)
    else:
        t = {k: gpu_times(fn, repeats=repeats) for k, fn in steps.items()}

    def ratio(a: str, b: str, key: str = "median"):
        return t[a][key] / t[b][key] if t[a].get(key) and t[b].get(key) else None

    out: dict = {
        "sqgrad/fwd_bwd": ratio("sqgrad", "fwd_bwd"),
        "vogn/adam": ratio("vogn", "adam"),
        "svi_autonormal/adam": ratio("svi_autonormal", "adam"),
        "vogn/svi_autonormal": ratio("vogn", "svi_autonormal"),
    }
    if device == "cpu":
        out["sqgrad/fwd_bwd (wall)"] = ratio("sqgrad", "fwd_bwd", "wall_median")
        out["vogn/adam (wall)"] = ratio("vogn", "adam", "wall_median")
        out["vogn/adam (wall, steps not preempted)"] = ratio("vogn", "adam", "wall_quiet")
        out["preempted steps"] = {k: v["preempted"] for k, v in t.items()}
        out["why wall differs"] = {
            k: {
                "wall/process": v["wall_median"] / v["median"],
                "preempted": v["preempted"],
                "voluntary switches per step": v["voluntary_switches_per_step"],
                "system time share": v["system_time_share"],
            }
            for k, v in t.items()
        }
    if with_vmap:
        net.eval()  # vmap over single examples needs per-example BatchNorm (running statistics)
        params = {k: v.detach() for k, v in net.named_parameters()}

        def loss_fn(p, xi, yi):
            with substitute(net, p):
                return F.cross_entropy(net(xi[None]), yi[None])

        vmap_steps = {
            "fwd_bwd": plain,
            "vmap": lambda: vmap_squared_gradients(loss_fn, params, x, y),
        }
        tv = interleaved(vmap_steps, repeats=max(5, repeats // 3), warmup=2)
        out["vmap/fwd_bwd"] = tv["vmap"]["median"] / tv["fwd_bwd"]["median"]
        net.train()
    out["seconds"] = {k: v["median"] for k, v in t.items()}
    return {k: v for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv if argv is not None else [])
    repeats = 5 if args.quick else 21
    torch.set_num_threads(1)
    load = list(os.getloadavg())
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    figures: dict = {}
    for device in devices:
        batches = [32, 128] if device == "cpu" else [128]
        for name, (build, shape) in networks(device).items():
            for batch in batches:
                key = f"{device}/{name}/B={batch}"
                result = measure(build, shape, batch, device, repeats, with_vmap=device == "cpu")
                figures[key] = result
                for figure, value in result.items():
                    if isinstance(value, float):
                        print(f"{key} {figure}: {value:.2f}x", flush=True)
                    elif figure == "preempted steps":
                        shares = ", ".join(f"{k} {v:.0%}" for k, v in value.items())
                        print(f"{key} preempted steps: {shares}", flush=True)
    if "cuda" not in devices:
        figures["cuda"] = "not measured: no GPU lent"
        print("cuda: not measured: no GPU lent")
    config = {
        "dataset_size": N,
        "repeats": repeats,
        "interleaved": True,
        "threads": 1,
        "mc_samples": 1,
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
    }
    write("vogn_step", config, figures)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
