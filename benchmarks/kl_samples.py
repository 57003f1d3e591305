"""KL term with M Monte Carlo samples: our graph-free estimators against the direct M-sample graph.

Figures:

1. saved-for-backward bytes and time (forward + backward) of the KL term for
   M ∈ {1, 10, 100, 1000, 10⁴}, ours vs the direct estimator, on one 262,144-weight site
   (512 × 512) and on the small CNN of ``pyro-bdl compare`` (all its sites), for the mean-field
   (Gaussian noise, Normal prior: sufficient statistics drawn directly), Radial (Normal prior:
   sufficient statistics in chunks) and a Laplace prior (streaming estimator) — ratios M=1000 / M=1
   and ours / direct;
2. the paper's point: the variance of the KL gradient at M = 1000 vs M = 1 during training of a
   Bayesian MLP on ``load_digits``, its share of the whole ELBO gradient's variance, and whether
   training with M = 1000 changes accuracy, NLL or ECE (M = 1, M = 1000 and the exact KL);
3. on a GPU (when one is present): the largest M whose direct KL fits in memory for a ResNet-18
   against ours.

Run: ``python -m benchmarks.kl_samples`` (``--quick`` for a smoke run, ``--full`` adds the direct
estimator at M = 1000 on the large site and Radial / streaming at M = 10⁴).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from benchmarks.common import cpu_times, write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.app.compare.problem import cnn, mlp
from pyro_bdl.app.data import load_digits
from pyro_bdl.diagnostics import metrics
from pyro_bdl.guides import AutoMeanField, AutoRadial
from pyro_bdl.infer import TraceSuffStat_ELBO
from pyro_bdl.infer import kl as K

MS = (1, 10, 100, 1000, 10_000)
#: (label, noise family, prior) of the estimator families measured.
FAMILIES = [
    ("meanfield_normal", "normal", lambda: dist.Normal(0.0, 1.0)),
    ("radial_normal", "radial", lambda: dist.Normal(0.0, 1.0)),
    ("meanfield_laplace", "normal", lambda: dist.Laplace(0.0, 1.0)),
]


def saved_bytes(fn) -> int:
    """Bytes packed for backward while ``fn()`` builds its graph (then backward is run)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return total


def kl_term(sites, noise, prior, m, estimator):
    """The KL term (sum over sites) with M samples: ``estimator`` is ``"ours"`` or ``"direct"``."""

    def run():
        total = 0.0
        for loc, scale in sites:
            fn = K.find_kl_estimator(noise, type(prior)) if estimator == "ours" else K.kl_direct
            total = total + fn(loc, scale, prior, noise=noise, num_samples=m).kl
        return total

    return run


def direct_fits(sites, m, budget_bytes) -> bool:
    # The direct graph keeps ≈ 16 bytes per weight per sample (measured) plus transients of a few
    # M × D float32 tensors: allow 6 × M × D × 4 bytes.
    return 6 * 4 * m * sum(loc.numel() for loc, _ in sites) <= budget_bytes


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def time_it(fn, heavy: bool) -> dict:
    def step():
        fn().backward()

    if heavy:  # seconds per call: fewer repeats keep the run short (noted in the JSON)
        return {**cpu_times(step, warmup=1, repeats=3), "repeats": 3}
    return {**cpu_times(step, warmup=4, repeats=15), "repeats": 15}


def memory_and_time(name, sites, ms, *, full: bool, quick: bool) -> dict:
    # The direct graph is only built while it fits comfortably in this (shared) machine's memory.
    budget = min(available_bytes() // 2, 12 << 30) if full else min(available_bytes() // 3, 6 << 30)
    numel = sum(loc.numel() for loc, _ in sites)
    out: dict = {"weights": numel, "sites": len(sites)}
    for label, noise, make_prior in FAMILIES:
        prior = make_prior()
        rows = {}
        for m in ms:
            costly = noise == "radial" or label.endswith("laplace")
            if costly and m * numel > (3e9 if full else 3e8):
                rows[m] = {"skipped": "noise generation too slow for the default run (--full)"}
                continue
            row: dict = {}
            ours = kl_term(sites, noise, prior, m, "ours")
            row["ours_bytes"] = saved_bytes(ours)
            heavy = m * numel > 2e7
            row["ours_time"] = None if quick and heavy else time_it(ours, heavy)
            big_direct = m * numel > 3e7 and not full
            if direct_fits(sites, m, budget) and not big_direct:
                direct = kl_term(sites, noise, prior, m, "direct")
                row["direct_bytes"] = saved_bytes(direct)
                row["direct_time"] = None if quick and heavy else time_it(direct, heavy)
            else:
                row["direct_bytes_extrapolated"] = None  # filled below from the linear fit
            rows[m] = row
        # Direct bytes are exactly linear in M (a constant plus M × per-sample bytes): fit on the
        # measured M and extrapolate where the direct graph was not built.
        measured = [(m, r["direct_bytes"]) for m, r in rows.items() if "direct_bytes" in r]
        if len(measured) >= 2:
            (m0, b0), (m1, b1) = measured[0], measured[-1]
            per_sample = (b1 - b0) / (m1 - m0)
            for m, r in rows.items():
                if "direct_bytes_extrapolated" in r:
                    r["direct_bytes_extrapolated"] = b0 + per_sample * (m - m0)
            out[f"{label}_direct_bytes_per_weight_per_sample"] = per_sample / numel
        out[label] = rows
        b1_ours = rows[1]["ours_bytes"]
        for m, r in rows.items():
            if "ours_bytes" not in r:
                continue
            r["ours_bytes_ratio_vs_m1"] = r["ours_bytes"] / b1_ours
            if "direct_bytes" in r:
                r["direct_bytes_ratio_vs_m1"] = r["direct_bytes"] / rows[1]["direct_bytes"]
            if r.get("ours_time") and r.get("direct_time"):
                r["time_ratio"] = r["ours_time"]["median"] / r["direct_time"]["median"]
                r["wall_time_ratio"] = (
                    r["ours_time"]["wall_median"] / r["direct_time"]["wall_median"]
                )
            line = f"{name} {label} M={m}: bytes(M)/bytes(1) ours {r['ours_bytes_ratio_vs_m1']:.3f}"
            if "direct_bytes_ratio_vs_m1" in r:
                line += f", direct {r['direct_bytes_ratio_vs_m1']:.1f}"
            elif r.get("direct_bytes_extrapolated"):
                line += f", direct ≈ {r['direct_bytes_extrapolated'] / 2**30:.1f} GiB (not built)"
            if "time_ratio" in r:
                line += (
                    f"; time ours/direct {r['time_ratio']:.3f} (wall {r['wall_time_ratio']:.3f})"
                )
            print(line, flush=True)
    return out


def big_site():
    torch.manual_seed(0)
    loc = (0.05 * torch.randn(512, 512)).requires_grad_()
    scale = torch.full((512, 512), 0.01).requires_grad_()
    return [(loc, scale)]


def cnn_sites():
    """(loc, scale) per site of the compare CNN under AutoMeanField (the guide's own views)."""
    net = bayesianize(cnn((1, 8, 8), 10), priors.Normal())
    model = models.classifier(net, 1000)
    guide = AutoMeanField(model)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    guide(x, y)
    loc = guide.loc.detach().clone().requires_grad_()
    scale = guide.scale.detach().clone().requires_grad_()
    sites = []
    for site in guide._layout:
        sites.append(
            (
                loc[site.start : site.stop].view(site.shape),
                scale[site.start : site.stop].view(site.shape),
            )
        )
    return sites


# --- the paper's point: gradient variance and training on load_digits -------------------------


def _flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads])


def kl_gradient_variance(guide, model, x, y, m, reps) -> dict:
    """Total variance (sum over parameters) of the KL-term gradient and of the whole ELBO
    gradient, over ``reps`` independent draws at the current parameters."""
    params = list(guide.parameters())
    blocked = poutine.block(model, hide=["y"])  # the KL term alone: no likelihood site
    kl_grads, full_grads = [], []
    elbo = TraceSuffStat_ELBO(kl="mc", num_kl_samples=m)
    for _ in range(reps):
        kl_grads.append(_flat_grad(elbo.differentiable_loss(blocked, guide, x, y), params))
        full_grads.append(_flat_grad(elbo.differentiable_loss(model, guide, x, y), params))
    kl_var = float(torch.stack(kl_grads).var(0).sum())
    full_var = float(torch.stack(full_grads).var(0).sum())
    return {"kl_grad_var": kl_var, "elbo_grad_var": full_var}


def train_digits(guide_cls, kl, m, *, epochs, seed, batch_size=64, lr=1e-3, probe=None):
    """Train a Bayesian MLP on load_digits; returns test metrics (and variance probes)."""
    data = load_digits(seed=0)
    n = len(data.y_train)
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    net = bayesianize(mlp(data.input_shape, 10), priors.Normal(scale=1.0))
    model = models.classifier(net, n)
    guide = guide_cls(model)
    guide(data.x_train[:batch_size], data.y_train[:batch_size])
    # A plain torch optimizer over the guide's parameters (the same update SVI would make; it
    # also sidesteps whatever Pyro's param-site collection does or does not see).
    optim = torch.optim.Adam(guide.parameters(), lr=lr)
    elbo = TraceSuffStat_ELBO(kl=kl, num_kl_samples=m)
    probes = []
    g = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=g)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            optim.zero_grad()
            elbo.differentiable_loss(model, guide, data.x_train[idx], data.y_train[idx]).backward()
            optim.step()
        if probe and (epoch + 1) in probe["epochs"]:
            xb, yb = data.x_train[:batch_size], data.y_train[:batch_size]
            row = {"epoch": epoch + 1}
            for pm in (1, 1000):
                v = kl_gradient_variance(guide, model, xb, yb, pm, probe["reps"])
                row[f"M{pm}"] = v
            row["kl_var_ratio_M1_over_M1000"] = (
                row["M1"]["kl_grad_var"] / row["M1000"]["kl_grad_var"]
            )
            row["kl_share_of_elbo_var_M1"] = row["M1"]["kl_grad_var"] / row["M1"]["elbo_grad_var"]
            probes.append(row)
            print(
                f"digits epoch {epoch + 1}: KL-gradient variance M=1 / M=1000 = "
                f"{row['kl_var_ratio_M1_over_M1000']:.0f}; KL share of the ELBO-gradient variance "
                f"at M=1 = {row['kl_share_of_elbo_var_M1']:.2e}, at M=1000 = "
                f"{row['M1000']['kl_grad_var'] / row['M1000']['elbo_grad_var']:.2e}",
                flush=True,
            )
    with torch.no_grad():
        pred = pyro.infer.Predictive(model, guide=guide, num_samples=32, return_sites=["_RETURN"])
        probs = pred(data.x_test)["_RETURN"].softmax(-1).mean(0)
    result = {
        "accuracy": metrics.accuracy(probs, data.y_test),
        "nll": metrics.nll(probs, data.y_test),
        "ece": metrics.ece(probs, data.y_test),
        "mean_posterior_scale": float(guide.scale.mean().detach()),
    }
    if probes:
        result["variance_probes"] = probes
    return result


def digits_study(*, epochs, seeds, reps, guide_cls=AutoMeanField, lr=1e-3) -> dict:
    out: dict = {"guide": guide_cls.__name__, "epochs": epochs, "seeds": list(seeds), "lr": lr}
    settings = [("M1", "mc", 1), ("M1000", "mc", 1000), ("exact", "exact", 1)]
    for label, kl, m in settings:
        runs = []
        for seed in seeds:
            probe = (
                {"epochs": {1, epochs}, "reps": reps}
                if label == "M1" and seed == seeds[0]
                else None
            )
            t0 = time.perf_counter()
            r = train_digits(guide_cls, kl, m, epochs=epochs, seed=seed, probe=probe, lr=lr)
            r["fit_seconds"] = time.perf_counter() - t0
            runs.append(r)
        summary = {}
        for key in ("accuracy", "nll", "ece", "mean_posterior_scale", "fit_seconds"):
            vals = [r[key] for r in runs]
            summary[key] = {
                "mean": statistics.mean(vals),
                "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            }
        out[label] = {"runs": runs, "summary": summary}
        s = summary
        print(
            f"digits {guide_cls.__name__} {label}: accuracy {s['accuracy']['mean']:.4f} ± "
            f"{s['accuracy']['sd']:.4f}, NLL {s['nll']['mean']:.4f} ± {s['nll']['sd']:.4f}, "
            f"ECE {s['ece']['mean']:.4f} ± {s['ece']['sd']:.4f} (over {len(seeds)} seeds)",
            flush=True,
        )
    return out


# --- GPU: the largest M the direct estimator fits for a ResNet-18 -----------------------------


def resnet18_max_m() -> dict:
    import torchvision

    dev = torch.device("cuda")
    net = torchvision.models.resnet18(num_classes=10)
    sites = []
    for name, p in net.named_parameters():
        if "bn" in name or "downsample.1" in name:
            continue
        loc = p.detach().to(dev).requires_grad_()
        sites.append((loc, torch.full_like(loc, 0.01).requires_grad_()))
    prior = dist.Normal(torch.tensor(0.0, device=dev), torch.tensor(1.0, device=dev))
    result: dict = {"weights": sum(loc.numel() for loc, _ in sites)}
    for label, noise in (("meanfield", "normal"), ("radial", "radial")):
        for estimator in ("direct", "ours"):
            largest = 0
            m = 1
            while m <= 100_000:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                try:
                    kl_term(sites, noise, prior, m, estimator)().backward()
                    torch.cuda.synchronize()
                    largest = m
                    result[f"{label}_{estimator}_peak_bytes_M{m}"] = (
                        torch.cuda.max_memory_allocated()
                    )
                except torch.cuda.OutOfMemoryError:
                    break
                m *= 10 if estimator == "ours" else 2
            result[f"{label}_{estimator}_largest_M_tried"] = largest
            print(f"resnet18 {label} {estimator}: largest M that fits ≥ {largest}", flush=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: small M, short training")
    parser.add_argument("--full", action="store_true", help="also the slow, memory-hungry cells")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--guide", choices=("meanfield", "radial"), default="meanfield", help="for the training"
    )
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per setting")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (training)")
    parser.add_argument("--output", default=None, help="results name (default kl_samples)")
    args = parser.parse_args([] if argv is None else argv)  # run_all calls main() bare
    torch.set_num_threads(1)
    ms = (1, 10, 100) if args.quick else MS
    figures: dict = {}
    if not args.skip_memory:
        figures["site_262144"] = memory_and_time(
            "site 262144", big_site(), ms, full=args.full, quick=args.quick
        )
        figures["small_cnn"] = memory_and_time(
            "small cnn", cnn_sites(), ms, full=args.full, quick=args.quick
        )
    if not args.skip_training:
        guide_cls = AutoRadial if args.guide == "radial" else AutoMeanField
        if args.quick:
            figures["digits"] = digits_study(
                epochs=2, seeds=[0], reps=5, guide_cls=guide_cls, lr=args.lr
            )
        else:
            seeds = list(range(args.seeds))
            figures["digits"] = digits_study(
                epochs=20, seeds=seeds, reps=20, guide_cls=guide_cls, lr=args.lr
            )
    if torch.cuda.is_available():
        figures["gpu_resnet18"] = resnet18_max_m()
    else:
        figures["gpu_resnet18"] = "not measured: no GPU lent"
        print("gpu resnet18: not measured: no GPU lent")
    config = {
        "Ms": list(ms),
        "quick": args.quick,
        "full": args.full,
        "threads": 1,
        "guide": args.guide,
        "seeds": args.seeds,
    }
    name = args.output or ("kl_samples" if args.guide == "meanfield" else "kl_samples_radial")
    write(name, config, figures)


if __name__ == "__main__":
    main(sys.argv[1:])
