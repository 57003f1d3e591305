"""Host overhead of a step: the ResNet-18 steps of :mod:`benchmarks.resnet` on a tiny-width copy.

On a GPU a ResNet-18 step at B = 128 is host-bound: the kernels take a few milliseconds, the
Python and dispatcher work per step (Pyro's trace of every weight site, the lifted forward, the
model's checks, the guide, the ELBO's log-probs, the optimizers) takes more. This proxy measures
that work alone on a CPU: torchvision's ResNet-18 module tree (20 convolutions, 20 BatchNorms, one
Linear) with every width divided by 32 (64 -> 2 channels, fc 16 -> 10), batch 2 of 3×8×8 inputs,
one thread, so the arithmetic is negligible and the step time is host time. Pyro's validation is
off, as ``benchmarks.gpu_check`` times the steps. The plain SGD step is the floor; each method's
step is set beside its plain reference as in :mod:`benchmarks.resnet`
(``swag@pyro``: the same step with Pyro's per-parameter optimizer and Trace_ELBO).

Time: the variants alternate step by step in a new random order every round; each takes the
median process time of its steps (ms). ``--profile VARIANT`` prints cProfile's top functions by
total and by cumulative time, and torch.profiler's operator counts, for one variant.

Usage::

    python -m benchmarks.host_overhead                      # writes results/host_overhead.json
    python -m benchmarks.host_overhead --rounds 40 --variants swag,sgd
    python -m benchmarks.host_overhead --profile swag --no-write
    python -m benchmarks.host_overhead --variants sgd,swag,swag@pyro --no-write
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics

import pyro
import torch
from torch import nn

from benchmarks.common import write
from benchmarks.resnet import CLASSES, build_steps, interleaved, quartiles, reference

SHRINK = 32
BATCH, SHAPE = 2, (3, 8, 8)
VARIANTS = ["sgd", "adam", "mf_plain", "swag", "laplace_map", "meanfield"]


def _narrow(n: int) -> int:
    return n if n == 3 else max(1, n // SHRINK)


def tiny_resnet18() -> nn.Module:
    """torchvision's ResNet-18 with every conv/BatchNorm width and the fc input divided by 32."""
    import torchvision

    net = torchvision.models.resnet18(num_classes=CLASSES)
    for name, mod in list(net.named_modules()):
        if isinstance(mod, nn.Conv2d):
            new: nn.Module = nn.Conv2d(
                _narrow(mod.in_channels),
                _narrow(mod.out_channels),
                mod.kernel_size,  # type: ignore[arg-type]
                mod.stride,  # type: ignore[arg-type]
                mod.padding,  # type: ignore[arg-type]
                bias=mod.bias is not None,
            )
        elif isinstance(mod, nn.BatchNorm2d):
            new = nn.BatchNorm2d(_narrow(mod.num_features))
        elif isinstance(mod, nn.Linear):
            new = nn.Linear(_narrow(mod.in_features), mod.out_features)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, attr, new)
    return net


def profile(variant: str, steps: int = 20, top: int = 25) -> None:
    built = build_steps(tiny_resnet18, *_batch(), "cpu", [variant])
    fn = built[variant]
    for _ in range(3):
        fn()
    fn.activate()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn.step()
    prof.disable()
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats(key)
        calls = stats.total_calls  # type: ignore[attr-defined]
        print(f"--- {variant}: {calls / steps:.0f} calls per step, by {key} ---")
        stats.print_stats(top)
        print(out.getvalue())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        fn.step()
    events = tp.key_averages()
    print(f"--- {variant}: {sum(e.count for e in events)} profiler events in one step ---")
    print(events.table(sort_by="count", row_limit=top))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, *SHAPE, generator=g), torch.randint(CLASSES, (BATCH,), generator=g)


def measure(variants: list[str], rounds: int) -> dict:
    steps = build_steps(tiny_resnet18, *_batch(), "cpu", variants)
    times = interleaved(steps, rounds=rounds, warmup=3)
    out: dict = {
        name: {"ms": 1e3 * statistics.median(ts), "quartiles_ms": [1e3 * q for q in quartiles(ts)]}
        for name, ts in times.items()
    }
    for name in variants:
        ref = reference(name)
        if ref in times:
            per_round = [a / b for a, b in zip(times[name], times[ref])]
            out[name]["ratio_to"] = ref
            out[name]["ratio"] = statistics.median(per_round)
            out[name]["ratio_quartiles"] = quartiles(per_round)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--profile", default=None, help="profile one variant instead of timing")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--name", default="host_overhead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.enable_validation(False)  # as benchmarks.gpu_check times the steps: no argument checks
    if args.profile:
        profile(args.profile)
        return
    variants = args.variants.split(",")
    figures = measure(variants, args.rounds)
    for name, f in figures.items():
        ratio = f" ({f['ratio']:.2f}x {f['ratio_to']})" if "ratio" in f else ""
        print(f"{name:12s} {f['ms']:7.2f} ms{ratio}")
    if not args.no_write:
        config = {"shrink": SHRINK, "batch": BATCH, "shape": SHAPE, "rounds": args.rounds}
        write(args.name, config, figures)


if __name__ == "__main__":
    main()
