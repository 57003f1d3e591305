"""Subnetwork linearized Laplace: cost of ``fit`` and quality under rotation.

Part 1, cost: ``fit`` time (process time, one thread) and peak tensor memory (bytes of storages
allocated during ``fit``, parameters and data excluded, counted by
:class:`~pyro_bdl.curvature.subnet.TensorMemoryTracker`) against S ∈ {100, 1000, 5000} on an MLP
and a small CNN (MNIST-shaped random inputs, so no data is needed), and the memory ratio when the
network grows 10× at fixed S. For scale, the B × C × D Jacobian that the reference library builds
per batch is reported beside it.

Part 1b: ``fit`` time against the reference library (laplace-torch's ``FullSubnetLaplace``, full
GGN) on the same network, data and subnetwork indices at S = 1000, with the two GGNs compared;
"not measured" when laplace-torch is not installed (``pip install .[bench]``).

Part 2, quality: an MLP MAP-trained on digits (scikit-learn's ``load_digits``, or the MNIST test
split with ``--data-dir``), then MAP, diagonal Laplace (all weights, linearized, probit) and
subnetwork Laplace (S weights chosen by largest SWAG-diag variance with Adam or with SGD
snapshots, largest diagonal-Laplace variance, at random with 5 seeds, or the last layer), with
the prior precision of training (λ = 1), tuned by the marginal likelihood, and tuned by
validation log-likelihood on 15% of the training split, evaluated on the test digits rotated by
0°–180°: NLL and ECE averaged over the angles. Each selection's λ is set the same way; the
selection headline compares each largest-variance rule with random selection's mean ± standard
error over the seeds.

Run: ``python -m benchmarks.laplace [--quick] [--data-dir DIR]``.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings
from importlib.metadata import version

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from torchvision.transforms.functional import rotate

from benchmarks.common import write
from pyro_bdl import bayesianize, models, priors, sites
from pyro_bdl.compare import problem as compare_networks
from pyro_bdl.curvature.subnet import (
    TensorMemoryTracker,
    diagonal_ggn,
    linearized_predictive,
    log_marginal,
    output_hessian_factor,
    subnet_jacobian,
    tune_grid,
)
from pyro_bdl.data import load_digits, load_mnist
from pyro_bdl.diagnostics.metrics import ece, nll
from pyro_bdl.guides import AutoSubnetLaplace, AutoSWAG


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
    for site in guide._sites:
        inside = (index >= site.offset) & (index < site.offset + site.numel)
        theirs_index[inside] += offsets[site.name] - site.offset
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


# ---- part 2: quality under rotation ------------------------------------------------------------


def rotated(x: torch.Tensor, angle: float) -> torch.Tensor:
    return rotate(x, angle) if angle else x


def map_values(guide) -> dict:
    return {site["name"]: v.detach() for site, v in guide._unpack_latent(guide.loc)}


def diagonal_laplace_probs(guide, x, diag_var: torch.Tensor) -> torch.Tensor:
    """Linearized probit predictive of diagonal Laplace over all weights (chunks of 64 rows)."""
    every = torch.arange(diag_var.numel())
    out = []
    with guide._eval_mode():
        for start in range(0, len(x), 64):
            values, slots = guide._slots(guide.loc)
            forward = guide._forward_fn(values, (x[start : start + 64],), {}, "y")
            jac, f = subnet_jacobian(forward, slots, every, return_outputs=True)
            jl = jac * diag_var.sqrt().to(jac)
            out.append(linearized_predictive(f, jl, "categorical"))
    return torch.cat(out)


def tune_diagonal(base, x_val, y_val, diag: torch.Tensor) -> float:
    """λ of diagonal Laplace by validation log-likelihood of the probit predictive (the same
    grid search as ``AutoSubnetLaplace.tune_prior_precision(method="val_ll")``)."""
    every = torch.arange(diag.numel())
    fs, qs = [], []
    with base._eval_mode():
        for start in range(0, len(x_val), 64):
            values, slots = base._slots(base.loc)
            forward = base._forward_fn(values, (x_val[start : start + 64],), {}, "y")
            jac, f = subnet_jacobian(forward, slots, every, return_outputs=True)
            fs.append(f.double())
            qs.append((jac - jac.mean(1, keepdim=True)).double().square().sum(1))
    f, q = torch.cat(fs), torch.cat(qs)
    c = f.shape[1]

    def score(lam):
        var = 2.0 / (c - 1) * (q @ (1.0 / (diag.double() + lam)))
        logits = f / (1 + math.pi / 8 * var).sqrt().unsqueeze(-1)
        return torch.distributions.Categorical(logits=logits).log_prob(y_val).sum()

    return tune_grid(score, torch.logspace(-4, 4, 17, dtype=torch.float64))


#: Random subnetworks are drawn with this many seeds; their mean ± standard error is the baseline
#: that a selection rule must beat.
RANDOM_SEEDS = 5


def selection_headline(summary: dict, setting: str) -> dict:
    """Largest-variance selection (SWAG-diag and diagonal Laplace) against random selection of
    the same size, each with its prior precision set the same way: the random baseline is the
    mean ± standard error over :data:`RANDOM_SEEDS` seeds."""
    out: dict = {}
    for metric in ("mean_nll", "mean_ece"):
        values = torch.tensor(
            [v[metric] for k, v in summary.items() if k.startswith("subnet_random_")],
            dtype=torch.float64,
        )
        mean, se = float(values.mean()), float(values.std() / len(values) ** 0.5)
        out[metric] = {"random_mean": mean, "random_se": se}
        for rule in ("subnet_swag", "subnet_swag_sgd", "subnet_diag_laplace"):
            value = summary[rule][metric]
            out[metric][rule] = value
            out[metric][f"{rule}_minus_random_in_se"] = (value - mean) / se if se else None
        print(
            f"selection ({setting}), {metric}: random {mean:.3f} ± {se:.3f} (SE, "
            f"{len(values)} seeds); largest variance by SWAG-diag (Adam) "
            f"{summary['subnet_swag'][metric]:.3f}, by SWAG-diag (SGD) "
            f"{summary['subnet_swag_sgd'][metric]:.3f}, by diagonal Laplace "
            f"{summary['subnet_diag_laplace'][metric]:.3f}"
        )
    return out


def quality(quick: bool, data_dir: str | None) -> dict:
    torch.manual_seed(0)
    data = load_mnist(data_dir) if data_dir else load_digits()
    # 15% of the training split is held out to tune the prior precision of every Laplace.
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))
    n_val = len(order) * 15 // 100
    x_val, y_val = data.x_train[order[:n_val]], data.y_train[order[:n_val]]
    x_train, y_train = data.x_train[order[n_val:]], data.y_train[order[n_val:]]
    x_test, y_test = data.x_test, data.y_test
    if quick:
        x_test, y_test = x_test[:150], y_test[:150]
    d_in = x_train[0].numel()
    n = len(y_train)
    epochs = 15 if quick else 40
    angles = [0, 30, 60, 90, 120, 150, 180]
    size = 1000

    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = bayesianize(mlp(d_in, 100), priors.Normal(scale=1.0))
    model = models.classifier(bnn, n)
    base = AutoSubnetLaplace(model, subnetwork="all")
    svi = SVI(model, base, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(n, generator=g).split(64):
            svi.step(x_train[idx], y_train[idx])
    theta = base.loc.detach().clone()

    # SWAG-diag variances: Adam at a constant rate from the MAP, one snapshot per epoch (as in
    # compare). Adam's steps have about the same size for every weight whatever its curvature,
    # so its snapshot variance is a weak posterior proxy; SWAG proper uses SGD with momentum at a
    # constant rate, whose stationary variance scales as lr × gradient noise / curvature: 20
    # snapshots over 10 epochs, lr 0.05 on the mean loss (the ELBO sums over the n examples).
    values = map_values(base)
    swag = AutoSWAG(model, diag_only=True, init_loc_fn=lambda site: values[site["name"]])
    svi = SVI(model, swag, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    for _ in range(5 if quick else 10):
        for idx in torch.randperm(n, generator=g).split(64):
            svi.step(x_train[idx], y_train[idx])
        swag.collect()
    store = pyro.get_param_store()
    for key in [k for k in store.keys() if k.startswith("AutoSWAG")]:
        del store[key]  # the second SWAG guide (same name) starts from the MAP too
    swag_sgd = AutoSWAG(model, diag_only=True, init_loc_fn=lambda site: values[site["name"]])
    svi = SVI(model, swag_sgd, pyro.optim.SGD({"lr": 0.05 / n, "momentum": 0.9}), Trace_ELBO())
    for _ in range(5 if quick else 10):
        for step, idx in enumerate(torch.randperm(n, generator=g).split(64)):
            svi.step(x_train[idx], y_train[idx])
            if step % max(1, math.ceil(n / 64) // 2) == 0:
                swag_sgd.collect()

    def laplace(subnetwork, **kwargs):
        guide = AutoSubnetLaplace(model, subnetwork=subnetwork, batch_size=128, **kwargs)
        guide(x_train[:2], y_train[:2])
        guide.loc.data = theta.clone()
        start = time.process_time()
        guide.fit((x_train, y_train))
        return guide, time.process_time() - start

    methods: dict = {}
    rules = {
        "subnet_swag": dict(subnetwork="largest_variance", size=size, variances=swag),
        "subnet_swag_sgd": dict(subnetwork="largest_variance", size=size, variances=swag_sgd),
        "subnet_diag_laplace": dict(subnetwork="largest_variance", size=size),
        **{
            f"subnet_random_{k}": dict(subnetwork="random", size=size, seed=k)
            for k in range(RANDOM_SEEDS)
        },
        "subnet_last_layer": dict(subnetwork="last_layer"),
    }
    guides = {}
    for name, kw in rules.items():
        guides[name], seconds = laplace(**kw)
        methods[name] = {
            "fit_cpu_s": seconds,
            "S": int(guides[name].subnet_index.numel()),
            "prior_precision": float(guides[name].prior_precision),
        }

    # Diagonal Laplace over all weights: precision = diag GGN + λ.
    diag = torch.zeros_like(theta)
    with base._eval_mode():
        for idx in torch.arange(n).split(128):
            vals, slots = base._slots(theta)
            forward = base._forward_fn(vals, (x_train[idx], y_train[idx]), {}, "y")
            diag += diagonal_ggn(forward, slots, lambda f: output_hessian_factor(f, "categorical"))

    def evaluate(setting: str, diag_var: torch.Tensor) -> dict:
        per_angle: dict = {m: {"nll": [], "ece": []} for m in ["map", "diag_laplace", *rules]}
        for angle in angles:
            xr = rotated(x_test, angle)
            with torch.no_grad():
                logits = pyro.poutine.condition(model, data=map_values(base))(xr)
            probs = {
                "map": logits.softmax(-1),
                "diag_laplace": diagonal_laplace_probs(base, xr, diag_var),
            }
            for name, guide in guides.items():
                probs[name] = guide.predict(xr, link="probit").float()
            for name, p in probs.items():
                p = p.double() / p.double().sum(-1, keepdim=True)
                per_angle[name]["nll"].append(nll(p, y_test))
                per_angle[name]["ece"].append(ece(p, y_test))
        summary = {}
        print(f"-- prior precision: {setting}")
        for name, d in per_angle.items():
            summary[name] = {
                "mean_nll": sum(d["nll"]) / len(d["nll"]),
                "mean_ece": sum(d["ece"]) / len(d["ece"]),
                "nll_0deg": d["nll"][0],
                "ece_0deg": d["ece"][0],
                **methods.get(name, {}),
            }
            if name in guides:
                summary[name]["prior_precision"] = float(guides[name].prior_precision)
            print(
                f"{name:>20}: NLL over rotations {summary[name]['mean_nll']:.3f}, ECE "
                f"{summary[name]['mean_ece']:.3f} (0°: NLL {d['nll'][0]:.3f}, "
                f"ECE {d['ece'][0]:.3f})"
            )
        m = summary["map"]
        for name in summary:
            if name != "map":
                print(
                    f"{name} / map: NLL ratio {summary[name]['mean_nll'] / m['mean_nll']:.3f}, "
                    f"ECE ratio {summary[name]['mean_ece'] / m['mean_ece']:.3f}"
                )
        return {
            "summary": summary,
            "per_angle": per_angle,
            "selection": selection_headline(summary, setting),
        }

    # λ = 1, the precision of the prior the MAP was trained under (λ_S = λ·S/D for subnetworks).
    results = {"prior": evaluate("the training prior, λ = 1", 1.0 / (diag + 1.0))}
    grid = torch.logspace(-4, 4, 17, dtype=torch.float64)
    lam_diag = tune_grid(lambda lam: log_marginal(diag.double(), theta.double(), lam), grid)
    methods["diag_laplace"] = {"prior_precision": lam_diag, "S": int(diag.numel())}
    for guide in guides.values():
        guide.tune_prior_precision(method="marglik")
    results["marglik"] = evaluate("tuned by marginal likelihood", 1.0 / (diag + lam_diag))
    lam_diag = tune_diagonal(base, x_val, y_val, diag)
    methods["diag_laplace"] = {"prior_precision": lam_diag, "S": int(diag.numel())}
    for guide in guides.values():
        guide.tune_prior_precision((x_val, y_val), method="val_ll")
    results["val_ll"] = evaluate("tuned by validation log-likelihood", 1.0 / (diag + lam_diag))
    return {"dataset": data.name, "angles": angles, **results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and test set")
    parser.add_argument("--data-dir", default=None, help="MNIST test split instead of digits")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    figures: dict = {}
    if not args.skip_cost:
        figures["cost"] = cost(args.quick, device)
    if not args.skip_reference:
        figures["reference"] = reference(args.quick, device)
    if not args.skip_quality:
        figures["quality"] = quality(args.quick, args.data_dir)
    if device == "cpu":
        figures["gpu"] = "not measured: no GPU lent"
    else:
        figures["gpu"] = resnet_gpu()
    config = {"quick": args.quick, "device": device, "data_dir": bool(args.data_dir)}
    write("laplace", config, figures)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
