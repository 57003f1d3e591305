"""Subnetwork linearized Laplace: the cost of ``fit``.

Part 1, cost: ``fit`` time (process time, one thread) and peak tensor memory (bytes of storages
allocated during ``fit``, parameters and data excluded, counted by
:class:`~pyro_bdl.curvature.memory.TensorMemoryTracker`) against S ∈ {100, 1000, 5000} on an MLP
and a small CNN (MNIST-shaped random inputs, so no data is needed), and the memory ratio when the
network grows 10× at fixed S. For scale, the B × C × D Jacobian that the reference library builds
per batch is reported beside it.

Part 1b: ``fit`` time against the reference library (laplace-torch's ``FullSubnetLaplace``, full
GGN) on the same network, data and subnetwork indices at S = 1000, with the two GGNs compared;
"not measured" when laplace-torch is not installed (``pip install .[bench]``).

Quality under rotation (the issue's last check) is :mod:`benchmarks.laplace_quality`.

Run: ``python -m benchmarks.laplace [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from importlib.metadata import version

import pyro
import torch
from torch import nn

from benchmarks.common import write
from pyro_bdl import bayesianize, models, priors, sites
from pyro_bdl.app.compare import problem as compare_networks
from pyro_bdl.curvature.memory import TensorMemoryTracker
from pyro_bdl.guides import AutoSubnetLaplace


def mlp(d_in: int, hidden: int, classes: int = 10) -> nn.Module:
    """The compare MLP (two hidden ReLU layers) on ``d_in`` inputs."""
    return compare_networks.mlp((d_in,), classes, hidden)


def cnn(width: int, classes: int = 10) -> nn.Module:
    """The compare CNN on one-channel images."""
    return compare_networks.cnn((1,), classes, width)


# ---- part 1: cost ------------------------------------------------------------------------------


def fit_cost(net: nn.Module, size: int, *, n: int, device: str, shape: tuple = (1, 28, 28)) -> dict:
    """Process time and peak tensor bytes of one ``fit`` with a random subnetwork of ``size``."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.rand(n, *shape, device=device)
    y = torch.randint(0, 10, (n,), device=device)
    bnn = bayesianize(net.to(device), priors.Normal(scale=1.0))
    model = models.classifier(bnn, n)
    guide = AutoSubnetLaplace(model, subnetwork="random", size=size, batch_size=32).to(device)
    guide(x[:2], y[:2])
    d = guide.loc.numel()
    exclude = [guide.loc, x, y, *[s.init_value for s in sites(bnn).values()]]
    exclude += list(bnn.parameters()) + list(bnn.buffers())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start, wall = time.process_time(), time.perf_counter()
    with TensorMemoryTracker(exclude=exclude) as mem:
        guide.fit((x, y))
    if device == "cuda":
        torch.cuda.synchronize()
    out = {
        "D": d,
        "S": size,
        "fit_cpu_s": time.process_time() - start,
        "fit_wall_s": time.perf_counter() - wall,
        "peak_bytes": mem.peak,
        "reference_jacobian_bytes_per_batch": 32 * 10 * d * 4,
    }
    if device == "cuda":
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return out


def cost(quick: bool, device: str) -> dict:
    sizes = [100, 1000] if quick else [100, 1000, 5000]
    n = 128 if quick else 256
    figures: dict = {"mlp": [], "cnn": []}
    for s in sizes:
        figures["mlp"].append(fit_cost(mlp(784, 100), s, n=n, device=device))
        figures["cnn"].append(fit_cost(cnn(16), s, n=n, device=device))
        for kind in ("mlp", "cnn"):
            r = figures[kind][-1]
            print(
                f"{kind} D={r['D']} S={s}: fit {r['fit_cpu_s']:.2f} s CPU, peak "
                f"{r['peak_bytes'] / 2**20:.1f} MiB (a B×C×D Jacobian: "
                f"{r['reference_jacobian_bytes_per_batch'] / 2**20:.1f} MiB per batch)"
            )
    for kind, small_net, big_net in (
        ("mlp", lambda: mlp(784, 100), lambda: mlp(784, 628)),
        ("cnn", lambda: cnn(16), lambda: cnn(51)),
    ):
        for s in sizes[1:]:
            small = fit_cost(small_net(), s, n=n, device=device)
            big = fit_cost(big_net(), s, n=n, device=device)
            ratio = big["peak_bytes"] / small["peak_bytes"]
            figures[f"{kind}_growth_S{s}"] = {
                "D_small": small["D"],
                "D_large": big["D"],
                "D_ratio": big["D"] / small["D"],
                "peak_small": small["peak_bytes"],
                "peak_large": big["peak_bytes"],
                "peak_ratio": ratio,
                "time_ratio": big["fit_cpu_s"] / small["fit_cpu_s"],
            }
            print(
                f"{kind} grown {big['D'] / small['D']:.1f}x at S={s}: peak memory ratio "
                f"{ratio:.3f} (target <= 1.2), fit time ratio "
                f"{big['fit_cpu_s'] / small['fit_cpu_s']:.2f}"
            )
    return figures


def reference_fit(net: nn.Module, size: int, *, n: int, device: str) -> dict:
    """``fit`` process time of ours against laplace-torch's ``FullSubnetLaplace`` (full GGN,
    its default Curvlinops backend) on the same network, data (batches of 32) and subnetwork
    indices; the two GGNs are compared entry by entry as a check that the work is the same."""
    try:
        import laplace  # benchmark-only: the optional ``bench`` extra
    except ImportError:
        return {"status": "not measured: laplace-torch not installed (pip install .[bench])"}
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.rand(n, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (n,), device=device)
    plain = copy.deepcopy(net).to(device).eval()
    offsets, offset = {}, 0
    for name, p in plain.named_parameters():
        offsets[name], offset = offset, offset + p.numel()
    bnn = bayesianize(net.to(device), priors.Normal(scale=1.0))
    model = models.classifier(bnn, n)
    guide = AutoSubnetLaplace(model, subnetwork="random", size=size, batch_size=32).to(device)
    guide(x[:2], y[:2])
    # That call ran the network in training mode: give the reference the same BatchNorm stats.
    buffers = dict(bnn.named_buffers())
    for name, buffer in plain.named_buffers():
        buffer.copy_(buffers[name])
    start = time.process_time()
    guide.fit((x, y))
    ours = time.process_time() - start
    # Our packed vector holds the lifted weights only (not BatchNorm's): map to theirs by name.
    index = guide.subnet_index.cpu()
    theirs_index = index.clone()
    for site in guide.layout:
        inside = (index >= site.start) & (index < site.stop)
        theirs_index[inside] += offsets[site.name] - site.start
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la = laplace.Laplace(
            plain,
            "classification",
            subset_of_weights="subnetwork",
            hessian_structure="full",
            subnetwork_indices=theirs_index.to(device),
        )
        start = time.process_time()
        la.fit(loader)
        theirs = time.process_time() - start
    h = la.H.to(guide.ggn)
    return {
        "D": guide.loc.numel(),
        "S": size,
        "n": n,
        "ours_fit_cpu_s": ours,
        "reference_fit_cpu_s": theirs,
        "time_ratio": ours / theirs,
        "reference": f"laplace-torch {version('laplace-torch')}, FullSubnetLaplace, "
        f"{type(la.backend).__name__}",
        "ggn_relative_difference": float((h - guide.ggn).norm() / h.norm()),
    }


def reference(quick: bool, device: str) -> dict:
    n = 128 if quick else 256
    figures = {}
    for kind, build in (("mlp", lambda: mlp(784, 100)), ("cnn", lambda: cnn(16))):
        r = figures[kind] = reference_fit(build(), 1000, n=n, device=device)
        if "status" in r:
            print(f"{kind}: reference library {r['status']}")
            return {"status": r["status"]}
        print(
            f"{kind} D={r['D']} S=1000: fit {r['ours_fit_cpu_s']:.2f} s vs laplace-torch "
            f"{r['reference_fit_cpu_s']:.2f} s CPU: ratio {r['time_ratio']:.3f} (target <= 0.5); "
            f"GGN relative difference {r['ggn_relative_difference']:.1e}"
        )
    return figures


def resnet_gpu(size: int = 40_000, n: int = 256) -> dict:
    """The paper's setting on a GPU: torchvision's ResNet-18 (11M weights, BatchNorm in eval
    mode during ``fit``) on CIFAR-size random inputs, a random subnetwork of ``size`` weights;
    ``cuda_peak_bytes`` is the CUDA allocator's peak during ``fit``, ``fit_wall_s`` the time."""
    from torchvision.models import resnet18

    r = fit_cost(resnet18(num_classes=10), size, n=n, device="cuda", shape=(3, 32, 32))
    print(
        f"ResNet-18 D={r['D']} S={size} on {torch.cuda.get_device_name()}: fit "
        f"{r['fit_wall_s']:.1f} s, CUDA peak {r['cuda_peak_bytes'] / 2**30:.2f} GiB"
    )
    return r


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and test set")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    figures: dict = {}
    if not args.skip_cost:
        figures["cost"] = cost(args.quick, device)
    if not args.skip_reference:
        figures["reference"] = reference(args.quick, device)
    if device == "cpu":
        figures["gpu"] = "not measured: no GPU lent"
    else:
        figures["gpu"] = resnet_gpu()
    config = {"quick": args.quick, "device": device}
    write("laplace", config, figures)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
