"""One mean-field SVI step: pyro_bdl vs the same step hand-written in plain PyTorch.

For MLPs with 4–100 weight sites and a small CNN (CPU, one thread) it times, side by side:

- ``plain``: the mean-field step written by hand in PyTorch (w = μ + softplus(ρ) ε through
  ``torch.func.functional_call``, N/B-scaled NLL plus the closed-form KL, ``torch.optim.Adam``);
- ``bdl``: ``SVI(model, AutoMeanField, TraceSuffStat_ELBO(), FusedOptim(torch.optim.Adam))`` —
  pyro_bdl's ELBO, which uses the exact KL and skips the unused log-densities of the latent
  sites, and its one-optimizer Adam (the plain step holds one optimizer too);
- ``bdl_tmf``: the same guide with Pyro's ``TraceMeanField_ELBO`` (exact KL, but it also
  evaluates every latent site's log-density in the model and the guide);
- ``bdl_radial``: ``AutoRadial`` with ``TraceSuffStat_ELBO``;
- ``pyro_autonormal``: plain Pyro ``AutoNormal`` + ``Trace_ELBO`` + ``pyro.optim.Adam``;
- ``adam``: the deterministic network with ``torch.optim.Adam``.

Figures: bdl/plain, radial/meanfield, meanfield/adam, autonormal/plain per network, and the
overhead bdl − plain split into a fixed cost per step and a per-site cost: the intercept and the
slope of a least-squares line through (number of weight sites, bdl − plain) over the MLPs with
4–100 sites (likewise for AutoNormal). CPU times are medians of process time over steps
alternated between the variants. ``--gpu`` repeats on CUDA when present.

Usage::

    python -m benchmarks.svi_step [--quick] [--gpu]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn
from torch.func import functional_call
from torch.nn.functional import softplus

from benchmarks.common import gpu_times, write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import AutoMeanField, AutoRadial
from pyro_bdl.infer import FusedOptim, TraceSuffStat_ELBO
from pyro_bdl.nn import init_to_network

N, B = 10_000, 128


def mlp(num_sites: int, width: int, d_in: int = 64, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, width), nn.ReLU()]
    for _ in range(num_sites // 2 - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cnn(width: int = 16, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, classes),
    )


def plain_step(net: nn.Module, prior_scale: float, lr: float):
    """The hand-written mean-field step (the reference the target is measured against)."""
    names = [n for n, _ in net.named_parameters()]
    locs = [p.detach().clone().requires_grad_() for _, p in net.named_parameters()]
    rhos = [torch.full_like(p, math.log(math.expm1(1e-2))).requires_grad_() for p in locs]
    opt = torch.optim.Adam(locs + rhos, lr=lr)
    s2 = prior_scale**2

    def step(x, y):
        opt.zero_grad()
        sigmas = [softplus(r) for r in rhos]
        ws = {n: m + s * torch.randn_like(m) for n, m, s in zip(names, locs, sigmas)}
        logits = functional_call(net, ws, (x,))
        nll = nn.functional.cross_entropy(logits, y, reduction="sum") * (N / x.shape[0])
        kl = sum(
            (math.log(prior_scale) - s.log() + (s * s + m * m) / (2 * s2) - 0.5).sum()
            for m, s in zip(locs, sigmas)
        )
        loss = nll + kl
        loss.backward()
        opt.step()
        return loss.item()

    return step


def adam_step(net: nn.Module, lr: float):
    opt = torch.optim.Adam(net.parameters(), lr=lr)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def svi_step(net: nn.Module, guide_cls, elbo, lr: float, *, fused: bool = True, **guide_kwargs):
    # Each guide class names its parameters after itself, so the variants share the param store
    # without clashing (the benchmark nets have no hidden parameters).
    bnn = bayesianize(net, priors.Normal(scale=1.0))
    model = models.classifier(bnn, N)
    guide = guide_cls(model, **guide_kwargs)
    optim = FusedOptim(torch.optim.Adam, {"lr": lr}) if fused else pyro.optim.Adam({"lr": lr})
    svi = SVI(model, guide, optim, elbo)
    return svi.step


def measure(build, x, y, *, repeats: int, device: str = "cpu") -> dict:
    """Time every variant on fresh copies of the same network, interleaving the repetitions."""

    def net():
        return build().to(device)

    variants = {
        "plain": lambda: plain_step(net(), 1.0, 1e-3),
        "adam": lambda: adam_step(net(), 1e-3),
        "bdl": lambda: svi_step(net(), AutoMeanField, TraceSuffStat_ELBO(), 1e-3),
        "bdl_tmf": lambda: svi_step(net(), AutoMeanField, TraceMeanField_ELBO(), 1e-3),
        "bdl_radial": lambda: svi_step(net(), AutoRadial, TraceSuffStat_ELBO(), 1e-3),
        "pyro_autonormal": lambda: svi_step(
            net(),
            AutoNormal,
            Trace_ELBO(),
            1e-3,
            fused=False,
            init_loc_fn=init_to_network,
            init_scale=1e-2,
        ),
    }
    x, y = x.to(device), y.to(device)
    pyro.clear_param_store()
    steps = {}
    for name, make in variants.items():
        torch.manual_seed(0)
        steps[name] = make()
    if device.startswith("cuda"):
        return {
            k: {"proc": gpu_times(lambda fn=fn: fn(x, y), repeats=repeats)["median"]}
            for k, fn in steps.items()
        }
    # Alternate the variants step by step (after warm-up) and take each one's median step time:
    # a burst from a noisy neighbour then hits all variants alike instead of one block.
    for fn in steps.values():
        for _ in range(4):
            fn(x, y)
    proc: dict[str, list[float]] = {k: [] for k in steps}
    wall: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(3 * repeats):
        for name, fn in steps.items():
            p0, w0 = time.process_time(), time.perf_counter()
            fn(x, y)
            proc[name].append(time.process_time() - p0)
            wall[name].append(time.perf_counter() - w0)
    return {
        k: {"proc": statistics.median(proc[k]), "wall": statistics.median(wall[k])} for k in steps
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and configs")
    parser.add_argument("--gpu", action="store_true", help="also run on CUDA when available")
    args, _ = parser.parse_known_args(argv)  # run_all passes its own argv through
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    repeats = 7 if args.quick else 25
    configs = [
        ("mlp-4", 4, 100),
        ("mlp-10", 10, 100),
        ("mlp-20", 20, 100),
        ("mlp-50", 50, 100),
        ("mlp-100", 100, 32),
    ]
    if args.quick:
        configs = configs[:2]
    devices = ["cpu"]
    if args.gpu and torch.cuda.is_available():
        devices.append("cuda")
    elif args.gpu:
        print("gpu: not measured: no GPU lent")
    figures: dict = {}
    for device in devices:
        out = figures.setdefault(device, {})
        for label, num_sites, width in configs:
            torch.manual_seed(0)
            x = torch.randn(B, 64)
            y = torch.randint(0, 10, (B,))
            build = lambda n=num_sites, w=width: mlp(n, w)  # noqa: E731
            t = measure(build, x, y, repeats=repeats, device=device)
            out[label] = summarise(f"{device}:{label}", t, num_sites)
        x = torch.randn(B, 1, 16, 16)
        y = torch.randint(0, 10, (B,))
        t = measure(cnn, x, y, repeats=repeats, device=device)
        out["cnn"] = summarise(f"{device}:cnn", t, 8)
        mlps = [label for label, _, _ in configs]
        if len(mlps) >= 2:
            # "Per site" is the slope of the overhead against the number of sites; the intercept
            # is the fixed cost of a step (trace machinery, optimizer calls, input checks).
            sites = [out[k]["num_sites"] for k in mlps]
            for variant, key in (("bdl", ""), ("pyro_autonormal", "autonormal_")):
                gaps = [1e6 * out[k]["seconds_gap"][variant] for k in mlps]
                slope, intercept = _line(sites, gaps)
                out[f"{key}overhead_per_site_us"] = slope
                out[f"{key}fixed_overhead_ms"] = 1e-3 * intercept
            out["overhead_fit_sites"] = sites
            print(
                f"{device}: pyro_bdl overhead = {out['fixed_overhead_ms']:.2f} ms/step "
                f"fixed + {out['overhead_per_site_us']:.0f} us/site (least squares over "
                f"{sites[0]}-{sites[-1]} sites); AutoNormal "
                f"{out['autonormal_fixed_overhead_ms']:.2f} ms + "
                f"{out['autonormal_overhead_per_site_us']:.0f} us/site",
                flush=True,
            )
    config = {
        "N": N,
        "B": B,
        "repeats": repeats,
        "threads": 1,
        "devices": devices,
        "mlps": {label: {"sites": n, "width": w} for label, n, w in configs},
        "cnn": "3 conv (16, 32, 32 channels) + linear, 8 sites, 16x16 inputs",
    }
    write("svi_step", config, figures)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def summarise(label: str, times: dict, num_sites: int) -> dict:
    t = {k: v["proc"] for k, v in times.items()}
    out = {
        "seconds": times,
        "num_sites": num_sites,
        "bdl_over_plain": t["bdl"] / t["plain"],
        "bdl_tmf_over_plain": t["bdl_tmf"] / t["plain"],
        "radial_over_meanfield": t["bdl_radial"] / t["bdl"],
        "meanfield_over_adam": t["bdl"] / t["adam"],
        "autonormal_over_plain": t["pyro_autonormal"] / t["plain"],
        "seconds_gap": {k: t[k] - t["plain"] for k in ("bdl", "pyro_autonormal")},
    }
    if "wall" in times["bdl"]:
        out["bdl_over_plain_wall"] = times["bdl"]["wall"] / times["plain"]["wall"]
    print(
        f"{label:12s} sites={num_sites:3d}  bdl/plain={out['bdl_over_plain']:.2f}x  "
        f"(wall {out.get('bdl_over_plain_wall', float('nan')):.2f}x; "
        f"TraceMeanField_ELBO {out['bdl_tmf_over_plain']:.2f}x)  "
        f"radial/mf={out['radial_over_meanfield']:.3f}x  "
        f"mf/adam={out['meanfield_over_adam']:.2f}x  "
        f"autonormal/plain={out['autonormal_over_plain']:.2f}x  "
        f"bdl-plain={1e3 * out['seconds_gap']['bdl']:.2f}ms",
        flush=True,
    )
    return out


if __name__ == "__main__":
    main()
