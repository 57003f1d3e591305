"""Step time of DataParallelSVI against PyTorch's DistributedDataParallel, two gloo ranks on CPU.

Both train the same hand-written mean-field Gaussian MLP (weights w = μ + softplus(ρ) ⊙ ε, loss
N/B · cross-entropy sum + the closed-form KL to N(0, I)) with plain SGD:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` around the module (bucketed all-reduce
  overlapped with backward), ``torch.optim.SGD``;
- ``dpsvi``: :class:`pyro_bdl.distributed.DataParallelSVI` with the module as its guide and the
  same loss as a callable, :class:`pyro_bdl.infer.FusedOptim` over ``torch.optim.SGD`` (one
  optimizer, as DDP's side has; gradient buckets overlapped with backward, plus the refusal
  agreement and the state snapshot of every step);
- ``dpsvi_no_overlap``: the same with ``overlap=False`` (one all-reduce after backward);
- ``dpsvi_pyro_optim``: ``dpsvi`` with Pyro's ``pyro.optim.SGD`` (one torch optimizer per
  parameter, stepped one by one, and new zero gradients allocated per parameter after the step):
  what a user who brings Pyro's optimizer pays.

Timing: process time is per process and misses the time a rank waits for the other, so this uses
wall time, measured on rank 0 between barriers, over blocks of steps; the variants run in
interleaved order, many rounds, and the figure is the median over rounds of the mean step time of
a block (with the quartiles as the spread). The two ranks share two cores with whatever else runs
on the machine: compare the ratios, not the absolute times.

Usage::

    python -m benchmarks.ddp            # writes benchmarks/results/ddp.json
    python -m benchmarks.ddp --smoke    # a few steps of a tiny network (a test, not the protocol)
    python -m benchmarks.ddp --profile digits_mlp   # cProfile of rank 0's DataParallelSVI steps
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import math
import os
import pstats
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import pyro
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from benchmarks.common import machine, write

WORLD = 2
VARIANTS = ("ddp", "dpsvi", "dpsvi_no_overlap", "dpsvi_pyro_optim")
# name -> (hidden width, local batch size, packed): packed keeps every μ and ρ in one flat tensor
# (as AutoMeanField does: one optimizer, one bucket on both sides); otherwise one tensor per μ and
# per ρ of each weight and bias (12 tensors: Pyro's optimizer then runs 12 torch optimizers).
CONFIGS = {
    "digits_mlp_packed": (100, 32, True),
    "digits_mlp": (100, 32, False),
    "wide_mlp": (512, 32, False),
}
DATASET_SIZE = 1000


def _init(sizes: list[int]) -> list[torch.Tensor]:
    """[μ, ρ] of each weight and bias, layer by layer."""
    torch.manual_seed(0)
    out = []
    for inp, o in itertools.pairwise(sizes):
        for shape in ((o, inp), (o,)):
            out += [torch.randn(shape) / math.sqrt(inp), torch.full(shape, -5.0)]
    return out


def _forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits at one weight draw w = μ + softplus(ρ) ⊙ ε."""
    ws = [m + F.softplus(r) * torch.randn_like(m) for m, r in zip(params[::2], params[1::2])]
    layers = len(ws) // 2
    for k in range(layers):
        x = F.linear(x, ws[2 * k], ws[2 * k + 1])
        if k < layers - 1:
            x = torch.relu(x)
    return x


def _loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """N/B · cross-entropy sum + KL(N(μ, σ²) ‖ N(0, 1))."""
    nll = F.cross_entropy(_forward(params, x), y, reduction="sum") * n / len(y)
    kl = sum(
        0.5 * (F.softplus(r) ** 2 + m**2 - 1).sum() - F.softplus(r).log().sum()
        for m, r in zip(params[::2], params[1::2])
    )
    return nll + kl


def _unpack(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [t.view(shape) for t, shape in zip(flat.split(sizes), shapes)]


class MeanFieldMLP(nn.Module):
    """The mean-field MLP as a module, for DistributedDataParallel."""

    def __init__(self, sizes: list[int], packed: bool = False):
        super().__init__()
        init = _init(sizes)
        self.shapes = [t.shape for t in init] if packed else None
        tensors = [torch.cat([t.reshape(-1) for t in init])] if packed else init
        self.params = nn.ParameterList([nn.Parameter(t) for t in tensors])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = list(self.params)
        if self.shapes is not None:
            params = _unpack(params[0], self.shapes)
        return _loss(params, x, y, DATASET_SIZE)


def _data(batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _steps(hidden: int, batch: int, rank: int, packed: bool = False, lr: float = 1e-4) -> dict:
    """One step function per variant, each with its own parameters and optimizer."""
    from pyro_bdl.distributed import DataParallelSVI
    from pyro_bdl.infer import FusedOptim

    x, y = _data(batch, rank)
    sizes = [64, hidden, hidden, 10]
    pyro.clear_param_store()  # a previous configuration's parameters have the same names
    ddp = nn.parallel.DistributedDataParallel(MeanFieldMLP(sizes, packed))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)

    def ddp_step() -> None:
        opt.zero_grad(set_to_none=True)
        ddp(x, y).backward()
        opt.step()

    steps = {"ddp": ddp_step}
    for name, overlap, fused in (
        ("dpsvi", True, True),
        ("dpsvi_no_overlap", False, True),
        ("dpsvi_pyro_optim", True, False),
    ):
        init = _init(sizes)
        shapes = [t.shape for t in init]
        if packed:
            init = [torch.cat([t.reshape(-1) for t in init])]
        names = [f"{name}.{k}" for k in range(len(init))]
        # Each variant's DataParallelSVI takes every parameter in the store when it is built:
        # show it only its own (the others are put back for their own steps).
        store = pyro.get_param_store()
        others = store.get_state()
        store.clear()
        for key, value in zip(names, init):
            pyro.param(key, value)

        def loss_fn(model, guide, x, y, names=names, shapes=shapes):
            params = [pyro.param(k) for k in names]
            if len(params) == 1:
                params = _unpack(params[0], shapes)
            return _loss(params, x, y, DATASET_SIZE)

        optim = FusedOptim(torch.optim.SGD, {"lr": lr}) if fused else pyro.optim.SGD({"lr": lr})
        svi = DataParallelSVI(_no_model, _no_model, optim, loss_fn, overlap=overlap)
        store.set_state(others)
        steps[name] = lambda svi=svi: svi.step(x, y)
    return steps


def _no_model(x, y) -> None:
    pass


def _loopback() -> str | None:
    return next((n for _, n in socket.if_nameindex() if n in ("lo", "lo0")), None)


def _rank(rank: int, port: int, args: dict, out: str) -> None:
    if _loopback() is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback() or "")
    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        results = {}
        for name, (hidden, batch, packed) in args["configs"].items():
            steps = _steps(hidden, batch, rank, packed)
            if args.get("profile"):
                n = args["rounds"] * args["block"]
                results[name] = "\n".join(
                    f"== {v}\n{_profile(steps[v], n, rank)}" for v in ("ddp", "dpsvi")
                )
            else:
                results[name] = _measure(steps, args["rounds"], args["block"])
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _measure(steps: dict, rounds: int, block: int) -> dict:
    """Per variant, the mean wall time and process time (this process, its communication threads
    included) of a step in each round's block (seconds)."""
    for step in steps.values():  # warm-up
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                steps[name]()
            c1 = time.process_time()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / block)
            cpu[name].append((c1 - c0) / block)
    return {"wall": times, "cpu": cpu}


def _profile(step, steps: int, rank: int, top: int = 30) -> str:
    """``cProfile`` of ``steps`` calls of ``step`` on rank 0 (the other rank steps along): the
    functions with the largest own time, then the largest cumulative time."""
    for _ in range(3):  # warm-up, and the buckets' reordering after the first step
        step()
    dist.barrier()
    profiler = cProfile.Profile(time.process_time)
    if rank == 0:
        profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    dist.barrier()
    text = io.StringIO()
    if rank == 0:
        stats = pstats.Stats(profiler, stream=text)
        text.write(f"{steps} steps\n")
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        # Our share of a step, and Pyro's.
        stats.sort_stats("cumulative").print_stats("pyro_bdl|pyro/", top)
    return text.getvalue()


def _quartiles(ts: list[float]) -> dict:
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    return {"median": statistics.median(ts), "q1": q[0], "q3": q[2]}


def _summary(measured: dict[str, dict[str, list[float]]]) -> dict:
    times, cpu = measured["wall"], measured["cpu"]
    out: dict = {
        "seconds_per_step": {k: _quartiles(ts) for k, ts in times.items()},
        "cpu_seconds_per_step_rank0": {k: _quartiles(ts) for k, ts in cpu.items()},
    }
    ddp = out["seconds_per_step"]["ddp"]["median"]
    out["ratio_to_ddp"] = {
        k: v["median"] / ddp for k, v in out["seconds_per_step"].items() if k != "ddp"
    }
    ddp_cpu = out["cpu_seconds_per_step_rank0"]["ddp"]["median"]
    out["cpu_ratio_to_ddp"] = {
        k: v["median"] / ddp_cpu for k, v in out["cpu_seconds_per_step_rank0"].items() if k != "ddp"
    }
    # The ratio within each round (the variants ran back to back) has a spread of its own.
    per_round = [a / b for a, b in zip(times["dpsvi"], times["ddp"])]
    out["dpsvi_over_ddp_per_round"] = _quartiles(per_round)
    return out


def run(
    configs: dict[str, tuple[int, int, bool]], rounds: int, block: int, *, profile: bool = False
) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        args = {"configs": configs, "rounds": rounds, "block": block, "profile": profile}
        try:
            mp.spawn(_rank, args=(store.port, args, out), nprocs=WORLD, join=True)
        finally:
            del store
        times = torch.load(out, weights_only=False)
    if profile:
        return times
    return {name: _summary(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps of a tiny network")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--out", help="the JSON to write (default benchmarks/results/ddp.json)")
    parser.add_argument(
        "--profile",
        choices=sorted(CONFIGS),
        help="print cProfile's view of rank 0 over rounds x block steps of DDP and of "
        "DataParallelSVI in this configuration, instead of timing them",
    )
    args = parser.parse_args(argv)
    if args.profile:
        report = run({args.profile: CONFIGS[args.profile]}, args.rounds, args.block, profile=True)
        print(report[args.profile])
        return report
    load_before = os.getloadavg()
    if args.smoke:
        figures = run({"tiny": (8, 4, False), "tiny_packed": (8, 4, True)}, rounds=2, block=2)
    else:
        figures = run(CONFIGS, args.rounds, args.block)
    # The ratios move with the load of the shared machine: record it with them.
    load = {"before": list(load_before), "after": list(os.getloadavg())}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    for name, f in figures.items():
        ratio = f["ratio_to_ddp"]
        print(
            f"{name}: ddp {f['seconds_per_step']['ddp']['median'] * 1e3:.2f} ms/step; "
            f"DataParallelSVI / DDP = {ratio['dpsvi']:.3f} "
            f"(per round: median {f['dpsvi_over_ddp_per_round']['median']:.3f}, "
            f"IQR {f['dpsvi_over_ddp_per_round']['q1']:.3f}-"
            f"{f['dpsvi_over_ddp_per_round']['q3']:.3f}); without overlap "
            f"{ratio['dpsvi_no_overlap']:.3f}, with Pyro's per-parameter optimizer "
            f"{ratio['dpsvi_pyro_optim']:.3f}  (target <= 1.1); process time on rank 0: "
            f"{f['cpu_ratio_to_ddp']['dpsvi']:.3f}, "
            f"{f['cpu_ratio_to_ddp']['dpsvi_no_overlap']:.3f} and "
            f"{f['cpu_ratio_to_ddp']['dpsvi_pyro_optim']:.3f}"
        )
    if not args.smoke and not args.no_write:
        config = {
            "world": WORLD,
            "backend": "gloo",
            "configs": {
                k: {"hidden": h, "batch_per_rank": b, "packed": p}
                for k, (h, b, p) in CONFIGS.items()
            },
            "rounds": args.rounds,
            "block": args.block,
            "clock": "wall time on rank 0 between barriers, variants interleaved",
            "machine_note": "2 ranks share 2 cores with other work",
            "threads_per_rank": 1,
            "load_average": load,
        }
        write("ddp", config, {**figures, "machine": machine()}, out=args.out)
    return figures


if __name__ == "__main__":
    main()
