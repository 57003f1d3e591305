"""Every method's step on a torchvision ResNet-18 and a wide MLP, against plain PyTorch.

A new user's view of the cost of each method: the network is lifted with ``bdl.bayesianize`` and
wrapped by ``bdl.models.classifier``; every method runs through its public API; each step is set
beside the plain PyTorch step of the same kind on the same network, batch and device:

=================  ==================================================  ===============
variant            the step                                            reference
=================  ==================================================  ===============
``meanfield``      ``SVI`` + ``AutoMeanField``, Adam                   ``mf_plain``
``radial``         ``SVI`` + ``AutoRadial``, Adam                      ``mf_plain``
``swag``           ``SVI`` + ``AutoSWAG``, SGD (point step)            ``sgd``
``laplace_map``    ``SVI`` + ``AutoSubnetLaplace``, SGD (MAP)          ``sgd``
``vogn``           ``VOGN.step`` (one MC sample)                       ``adam``
``ivon``           ``IVON.step`` (one MC sample)                       ``adam``
=================  ==================================================  ===============

The ``SVI`` steps use ``TraceSuffStat_ELBO`` (it sums every site's term on the device and reads
the loss once per step; Pyro's ``Trace_ELBO`` reads each site's log-density, a GPU sync per site)
and :class:`pyro_bdl.infer.FusedOptim` (one torch optimizer over every parameter, as the
references hold). A variant name with ``@pyro`` appended (``swag@pyro``) steps with Pyro's own
parts instead, as a user of Pyro's recipe does: a per-parameter ``pyro.optim`` optimizer and, for
``swag`` and ``laplace_map``, ``Trace_ELBO``; it is set beside the same reference.

``mf_plain`` is the mean-field step written by hand: per lifted parameter a (loc, ρ) pair,
w = loc + softplus(ρ)·ε through ``torch.func.functional_call``, cross-entropy × N/B plus the
closed-form Gaussian KL, ``torch.optim.Adam``; the normalisation layers' parameters stay point
estimates, as ``bayesianize`` leaves them. ``sgd`` and ``adam`` train the deterministic network.

Time: on a CPU (one thread) the variants alternate step by step after a warm-up, in a new random
order every round, and each takes the median process time of its steps; the spread of a ratio is
the quartiles of the per-round ratios (the two steps of a round ran seconds apart, so a burst of
load from a neighbour hits both). On CUDA: CUDA events. Peak memory: the largest number of bytes
of tensors allocated during one step beyond those alive before it (CPU: a ``TorchDispatchMode``
tracker, ``pyro_bdl.curvature.TensorMemoryTracker``; CUDA: ``torch.cuda.max_memory_allocated``).

``--autocast bf16`` runs every step, the references' included, under
``torch.autocast(device, torch.bfloat16)`` (mixed precision as a user would switch it on: the
parameters and the optimizers' state stay fp32).

Usage::

    python -m benchmarks.resnet                       # CPU, B = 32 and 128, ResNet-18 and MLP
    python -m benchmarks.resnet --quick               # few repeats, B = 32 (a smoke check)
    python -m benchmarks.resnet --device cuda --batch-sizes 32,128 --nets resnet18,mlp
    python -m benchmarks.resnet --device cuda --batch-sizes 128 --nets resnet18 --autocast bf16
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from torch.func import functional_call

import pyro_bdl as bdl
from benchmarks.common import write
from pyro_bdl.curvature.memory import TensorMemoryTracker

N = 50_000  # dataset size for the N/B scaling (CIFAR-10)
CLASSES = 10
LR_SGD, LR_ADAM = 1e-3, 1e-3
LR_IVON = 0.1  # IVON's own default (benchmarks/ivon_step.py); the time does not depend on it

Step = Callable[[], object]

#: variant -> its plain PyTorch reference.
REFERENCE = {
    "meanfield": "mf_plain",
    "radial": "mf_plain",
    "swag": "sgd",
    "laplace_map": "sgd",
    "vogn": "adam",
    "ivon": "adam",
}

#: The variants that step through ``SVI`` with a Pyro optimizer.
SVI_VARIANTS = ("meanfield", "radial", "swag", "laplace_map")
#: Appended to an SVI variant: Pyro's own optimizer (and ELBO for the point estimates) instead.
PYRO_PARTS = "@pyro"


def reference(variant: str) -> str | None:
    """The plain PyTorch reference of ``variant`` (``None`` for a reference itself)."""
    return REFERENCE.get(variant.removesuffix(PYRO_PARTS))


#: ``--autocast`` choices: the dtype every step runs under (``None``: no autocast, fp32).
AUTOCAST: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}


def resnet18(shape: tuple[int, ...] = (3, 32, 32)) -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=CLASSES)


def wide_mlp(shape: tuple[int, ...] = (3, 32, 32), width: int = 2048) -> nn.Module:
    """Two hidden layers of ``width``: 10.5M weights at 2048 on CIFAR inputs (ResNet-18: 11.2M)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(shape), width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, CLASSES),
    )


NETS: dict[str, Callable[..., nn.Module]] = {"resnet18": resnet18, "mlp": wide_mlp}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm))


def mf_plain_step(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    prior_scale: float = 1.0,
    init_scale: float = 1e-2,
    lr: float = LR_ADAM,
) -> Step:
    """The hand-written mean-field step; normalisation layers' parameters are point estimates."""
    point = {
        f"{m}.{p}" if m else p
        for m, mod in net.named_modules()
        if _is_norm(mod)
        for p, _ in mod.named_parameters(recurse=False)
    }
    names = [n for n, _ in net.named_parameters() if n not in point]
    params = dict(net.named_parameters())
    locs = [params[n].detach().clone().requires_grad_() for n in names]
    rhos = [torch.full_like(m, math.log(math.expm1(init_scale))).requires_grad_() for m in locs]
    points: list[torch.Tensor] = [params[n] for n in point]
    opt = torch.optim.Adam(locs + rhos + points, lr=lr)
    log_s0, s2 = math.log(prior_scale), prior_scale**2

    def step():
        opt.zero_grad(set_to_none=True)
        sigmas = [F.softplus(r) for r in rhos]
        ws = {n: m + s * torch.randn_like(m) for n, m, s in zip(names, locs, sigmas)}
        nll = F.cross_entropy(functional_call(net, ws, (x,)), y, reduction="sum")
        kl = sum(
            (log_s0 - s.log() + (s * s + m * m) / (2 * s2) - 0.5).sum()
            for m, s in zip(locs, sigmas)
        )
        loss = nll * (N / x.shape[0]) + kl
        loss.backward()
        opt.step()
        return loss.item()

    return step


def plain_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: str) -> Step:
    """One deterministic step: mean cross-entropy, ``torch.optim.SGD`` (momentum 0.9) or Adam."""
    opt = (
        torch.optim.SGD(net.parameters(), lr=LR_SGD, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(net.parameters(), lr=LR_ADAM)
    )

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _model(net: nn.Module):
    return bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(scale=1.0)), N)


def svi_step(net: nn.Module, x, y, guide: str, *, pyro_parts: bool = False) -> Step:
    """A pyro_bdl method's step through its public API (one fresh param store per variant), with
    :class:`~pyro_bdl.infer.FusedOptim` and ``TraceSuffStat_ELBO``, or (``pyro_parts``) Pyro's
    per-parameter optimizer and, for the point estimates, Pyro's ``Trace_ELBO``."""
    model = _model(net)
    if guide == "meanfield":
        g, opt = bdl.guides.AutoMeanField(model, init_scale=1e-2), "adam"
    elif guide == "radial":
        g, opt = bdl.guides.AutoRadial(model), "adam"
    elif guide == "swag":
        g, opt = bdl.guides.AutoSWAG(model, rank=20), "sgd"
    elif guide == "laplace_map":
        g, opt = bdl.guides.AutoSubnetLaplace(model, subnetwork="last_layer"), "sgd"
    else:
        raise ValueError(f"guide must be meanfield|radial|swag|laplace_map; got {guide!r}.")
    # The SVI loss sums the N/B-scaled NLL: the learning rate is per example (as the README's
    # SWAG recipe, lr / N), so the update size matches the plain step's on the mean loss.
    constructor, args = (
        (torch.optim.SGD, {"lr": LR_SGD / N, "momentum": 0.9})
        if opt == "sgd"
        else (torch.optim.Adam, {"lr": LR_ADAM})
    )
    optim = (
        pyro.optim.PyroOptim(constructor, args)
        if pyro_parts
        else bdl.infer.FusedOptim(constructor, args)
    )
    elbo = Trace_ELBO() if pyro_parts and opt == "sgd" else bdl.infer.TraceSuffStat_ELBO()
    svi = SVI(model, g, optim, elbo)
    return lambda: svi.step(x, y)


def vogn_step(net: nn.Module, x, y) -> Step:
    vogn = bdl.infer.VOGN(_model(net), dataset_size=N, lr=LR_ADAM, num_particles=1)
    return lambda: vogn.step(x, y)


def ivon_step(net: nn.Module, x, y) -> Step:
    ivon = bdl.infer.IVON(_model(net), dataset_size=N, lr=LR_IVON, num_particles=1)
    return lambda: ivon.step(x, y)


def under_autocast(step: Step, device: str, dtype: torch.dtype | None) -> Step:
    """``step`` run inside ``torch.autocast(device type, dtype)`` (``dtype=None``: unchanged)."""
    if dtype is None:
        return step
    kind = torch.device(device).type

    def run():
        with torch.autocast(kind, dtype=dtype):
            return step()

    return run


def build_steps(
    build: Callable[[], nn.Module],
    x,
    y,
    device: str,
    variants: list[str] | None = None,
    autocast: torch.dtype | None = None,
) -> dict[str, _WithStore]:
    """Every variant on its own fresh copy of the same network (seed 0), each step under
    ``torch.autocast`` to ``autocast`` where given."""
    makers: dict[str, Callable[[nn.Module], Step]] = {
        "sgd": lambda n: plain_step(n, x, y, "sgd"),
        "adam": lambda n: plain_step(n, x, y, "adam"),
        "mf_plain": lambda n: mf_plain_step(n, x, y),
        "meanfield": lambda n: svi_step(n, x, y, "meanfield"),
        "radial": lambda n: svi_step(n, x, y, "radial"),
        "swag": lambda n: svi_step(n, x, y, "swag"),
        "laplace_map": lambda n: svi_step(n, x, y, "laplace_map"),
        **{
            g + PYRO_PARTS: lambda n, g=g: svi_step(n, x, y, g, pyro_parts=True)
            for g in SVI_VARIANTS
        },
        "vogn": lambda n: vogn_step(n, x, y),
        "ivon": lambda n: ivon_step(n, x, y),
    }
    steps: dict[str, _WithStore] = {}
    for name in variants or [n for n in makers if not n.endswith(PYRO_PARTS)]:
        # pyro's global param store: each variant builds and warms its own before the next.
        torch.manual_seed(0)
        pyro.clear_param_store()
        fn = under_autocast(makers[name](build().to(device)), device, autocast)
        fn()  # first step: lazy setup (guides, optimizer state) out of the figures
        steps[name] = _WithStore(fn, pyro.get_param_store().get_state())
    return steps


class _WithStore:
    """A variant bound to its own param store contents (the store is global in Pyro):
    ``activate()`` installs them, outside the timed region."""

    def __init__(self, step: Step, state: dict):
        self.step, self.state = step, state

    def activate(self) -> None:
        store = pyro.get_param_store()
        store.clear()
        store.set_state(self.state)

    def __call__(self):
        self.activate()
        return self.step()


def interleaved(
    steps: dict[str, _WithStore], *, rounds: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Process time (s) of every step, the variants alternating in a new random order per round."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    rng = random.Random(0)
    names = list(steps)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            steps[name].activate()
            t0 = time.process_time()
            steps[name].step()
            times[name].append(time.process_time() - t0)
    return times


def cuda_times(
    steps: dict[str, _WithStore], *, rounds: int, warmup: int = 2
) -> dict[str, list[float]]:
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            fn.activate()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn.step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    return times


def peak_step_bytes(step: _WithStore, device: str) -> int:
    """The most bytes of tensors alive at once during one step beyond those alive before it."""
    step.activate()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    # Everything alive before the step (parameters, optimizer state, the param store, guide
    # buffers, data) is excluded, so in-place updates of it are not counted as new memory.
    with warnings.catch_warnings():  # isinstance on gc objects touches deprecated aliases
        warnings.simplefilter("ignore")
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    grads = []
    for t in alive:
        try:
            if t.is_leaf and t.grad is not None:
                grads.append(t.grad)
        except RuntimeError:  # a stale view (unbind output of a modified base): no grad to keep
            pass
    alive += grads
    with TensorMemoryTracker(exclude=alive) as mem:
        step.step()
    return mem.peak


#: Paper GPU for :func:`vogn_gpu_estimate`: an H100's fp32 rate at half its 67 TFLOP/s peak
#: (small convolutions rarely do better) and 80% of its 3.35 TB/s memory bandwidth.
GPU_FLOPS, GPU_BYTES = 33e12, 2.7e12


def vogn_gpu_estimate(batch: int, shape: tuple[int, ...] = (3, 32, 32)) -> dict:
    """VOGN step / Adam step on ResNet-18 on paper (FLOP and bytes from the layer shapes).

    Adam: forward (2·MACs of every conv and linear), backward (twice that: input and weight
    gradients), and its update (read w, g, m, v, write w, m, v, plus the sqrt and div
    temporaries: 11·D numbers). VOGN: the same forward, the backward to the inputs only (the
    sampled weights need no autograd gradient), for every layer the form the cost model picks
    (:func:`~pyro_bdl.curvature.per_example_forms.form_work`; it gives Σg too), and the draw and
    update (ε, w = μ + σε, g, h, m, s, μ, σ: 16·D numbers). Activations' memory traffic is the
    same in both and left out, as are kernel-launch overheads. fp32 numbers.
    """
    from pyro_bdl.curvature.per_example_forms import choose_form, form_work, layer_shape

    net = resnet18(shape).eval()  # one example through BatchNorm: the running statistics
    calls: list[tuple[nn.Module, tuple[int, ...], bool]] = []

    def hook(module, inputs, output):
        a = torch.zeros(batch, *inputs[0].shape[1:])
        d = torch.zeros(batch, *output.shape[1:])
        form = choose_form(module, a, d, single=True)
        calls.append((module, layer_shape(module, a, d), form))  # type: ignore[arg-type]

    handles = [
        m.register_forward_hook(hook)
        for m in net.modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    with torch.no_grad():
        net(torch.zeros(1, *shape))
    for h in handles:
        h.remove()
    num_weights = sum(p.numel() for p in net.parameters())
    forward = sum(2 * b * p * o * k for _, (b, o, k, p, _g), _f in calls)
    squares_flops = squares_numbers = 0
    forms: dict[str, int] = {}
    for module, (b, o, k, p, g), form in calls:
        flops, numbers = form_work(b, o, k, p, g, conv=isinstance(module, nn.Conv2d))[form]
        squares_flops += flops
        squares_numbers += numbers
        forms[form] = forms.get(form, 0) + 1
    adam = 3 * forward / GPU_FLOPS + 11 * num_weights * 4 / GPU_BYTES
    vogn = (2 * forward + squares_flops) / GPU_FLOPS + (
        squares_numbers + 16 * num_weights
    ) * 4 / GPU_BYTES
    return {
        "ratio": vogn / adam,
        "adam_seconds": adam,
        "vogn_seconds": vogn,
        "forward_gflop": forward / 1e9,
        "squares_gflop": squares_flops / 1e9,
        "squares_mb": squares_numbers * 4 / 1e6,
        "forms": forms,
        "gpu": {"flops": GPU_FLOPS, "bytes_per_s": GPU_BYTES},
    }


def quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 4:
        return [min(xs), statistics.median(xs), max(xs)]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[1], q[2]]


def measure(
    net: str,
    batch: int,
    device: str,
    rounds: int,
    variants: list[str] | None = None,
    shape: tuple[int, ...] = (3, 32, 32),
    autocast: torch.dtype | None = None,
) -> dict:
    """Step times, peak memory and their ratios to the references for one network and batch
    (every step under ``torch.autocast`` to ``autocast`` where given)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, CLASSES, (batch,), generator=g).to(device)
    steps = build_steps(lambda: NETS[net](shape), x, y, device, variants, autocast)
    times = (cuda_times if device.startswith("cuda") else interleaved)(steps, rounds=rounds)
    peaks = {k: peak_step_bytes(fn, device) for k, fn in steps.items()}
    out: dict = {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "peak_bytes": peaks,
        "ratios": {},
    }
    for name in steps:
        ref = reference(name)
        if ref is None or ref not in steps:
            continue
        per_round = [a / b for a, b in zip(times[name], times[ref])]
        out["ratios"][f"{name}/{ref}"] = {
            "time": out["seconds"][name] / out["seconds"][ref],
            "time_quartiles_per_round": quartiles(per_round),
            "peak_memory": peaks[name] / peaks[ref] if peaks[ref] else None,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, B = 32 only")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (CUDA must be present)")
    parser.add_argument("--batch-sizes", default="32,128", help="comma-separated, e.g. 32,128")
    parser.add_argument("--nets", default="resnet18,mlp", help="comma-separated: resnet18,mlp")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument(
        "--autocast", default="none", choices=sorted(AUTOCAST), help="bf16: steps under autocast"
    )
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated subset of the steps (e.g. mf_plain,meanfield,radial); default all",
    )
    parser.add_argument(
        "--shape", default="3,32,32", help="input shape C,H,W (e.g. 3,224,224 for ImageNet size)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args, _ = parser.parse_known_args(argv)  # run_all passes its own argv through
    try:
        shape = tuple(int(d) for d in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        parser.error(f"--shape: expected three positive integers C,H,W; got {args.shape!r}.")
    variants = [v for v in args.variants.split(",") if v] or None
    known = (
        "sgd",
        "adam",
        "mf_plain",
        "meanfield",
        "radial",
        "swag",
        "laplace_map",
        "vogn",
        "ivon",
        *(g + PYRO_PARTS for g in SVI_VARIANTS),
    )
    if variants and set(variants) - set(known):
        parser.error(
            f"--variants: unknown {sorted(set(variants) - set(known))}; choose from {known}."
        )
    nets = [n for n in args.nets.split(",") if n]
    unknown = [n for n in nets if n not in NETS]
    if unknown:
        parser.error(f"--nets: unknown {unknown}; choose from {sorted(NETS)}.")
    batches = [32] if args.quick else [int(b) for b in args.batch_sizes.split(",") if b]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda: not measured: no CUDA device here")
        return {}
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    rounds = args.rounds or (3 if args.quick else 9)
    figures: dict = {}
    for net in nets:
        for batch in batches:
            r = measure(
                net, batch, args.device, rounds, variants, shape, autocast=AUTOCAST[args.autocast]
            )
            figures[f"{net}/B={batch}"] = r
            for key, v in r["ratios"].items():
                q = v["time_quartiles_per_round"]
                print(
                    f"{args.device} {net} B={batch} {key}: time {v['time']:.2f}x "
                    f"(per-round quartiles {q[0]:.2f}-{q[2]:.2f}), "
                    f"peak memory {v['peak_memory']:.2f}x",
                    flush=True,
                )
            peaks = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r["peak_bytes"].items())
            print(f"{args.device} {net} B={batch} peak MiB per step: {peaks}", flush=True)
    estimates = {f"B={b}": vogn_gpu_estimate(b) for b in batches}
    for key, est in estimates.items():
        print(f"paper GPU ResNet-18 {key} vogn/adam: {est['ratio']:.2f}x (estimate)", flush=True)
    config = {
        "N": N,
        "batch_sizes": batches,
        "nets": {
            "resnet18": "torchvision resnet18(num_classes=10)",
            "mlp": "3072-2048-2048-10 ReLU MLP, inputs flattened (3x32x32 only)",
        },
        "shape": shape,
        "device": args.device,
        "autocast": args.autocast,
        "threads": 1,
        "rounds": rounds,
        "inputs": "random normal, random labels",
        "timer": "CUDA events" if args.device.startswith("cuda") else "process time, interleaved",
        "references": REFERENCE,
        "vogn_gpu_estimate": estimates,
    }
    # glibc returns every freed block above 32 MB to the kernel and maps it afresh (page faults,
    # zeroing: system time) on the next step; MALLOC_MMAP_MAX_=0 with a large
    # MALLOC_TRIM_THRESHOLD_ keeps freed memory in the heap, as a caching allocator would.
    config["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if not args.no_write:
        suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
        if args.autocast != "none":
            suffix += f"_{args.autocast}"
        if shape != (3, 32, 32):
            suffix += "_" + "x".join(map(str, shape))
        if args.quick:
            suffix += "_quick"
        if os.environ.get("MALLOC_MMAP_MAX_") == "0":
            suffix += "_malloc_keep"
        write(f"resnet{suffix}", config, figures)
    return figures


if __name__ == "__main__":
    main()
