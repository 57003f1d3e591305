"""The Laplace structures (full, kron, diag, last layer): fit time against laplace-torch, a KFAC fit
of ResNet-18 on CPU, and rotated-digits quality under two rules for the prior precision.

1. Fit time: the same MLP (``--hidden`` units, two hidden ReLU layers, float32) at the same
   weights and data (scikit-learn's digits, 1,438 rows), process time of ``fit`` on one thread,
   rounds interleaved (ours, then laplace-torch's, per structure). Target: ≤ 0.5× laplace-torch.
2. ResNet-18 (torchvision, 10 classes, BatchNorm in eval mode) lifted with N(0, 1): a Kronecker
   fit over all 21 Linear/Conv2d layers on ``--resnet-rows`` random 32 × 32 images, timed
   and with the process's peak resident memory.
3. Rotated digits: an MLP trained as a MAP estimate (Adam, 40 epochs) on 85% of the training
   split; each structure fitted on it; λ by the marginal likelihood (gradient, one value) or by
   the probit log-likelihood on the held-out 15% (grid); NLL and ECE of the probit predictive on
   the test digits rotated by 0°, 30°, …, 180°.
4. Rotated MNIST: the same protocol on the MNIST test-set split (8,000 / 2,000, from
   ``$PYRO_BDL_DATA`` or ``--data-dir``; 20 epochs) with every structure but ``full`` over all
   weights: for the 784-30-30-10 MLP (D = 24,790) its float64 matrix alone is 4.9 GB and its
   factorisation ~5·10¹² FLOPs, which is what the other structures exist to avoid.
5. λ by the marginal likelihood: ours (L-BFGS) against laplace-torch's
   ``optimize_prior_precision(method="marglik")`` on the same MAP MLP and fit: λ, the evidence
   at it and the tuning's process time (``marglik_times``).

Usage: ``python -m benchmarks.laplace_structures`` (``--smoke`` for a tiny run; results in
``benchmarks/results/laplace_structures_<part>.json``).
"""

from __future__ import annotations

import argparse
import copy
import resource
import time
import warnings

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from torchvision.transforms.functional import rotate

from benchmarks.common import write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.app.compare import problem as compare_networks
from pyro_bdl.app.data import Dataset, load_digits, load_mnist
from pyro_bdl.diagnostics.metrics import ece, nll
from pyro_bdl.guides import AutoSubnetLaplace

ANGLES = (0, 30, 60, 90, 120, 150, 180)
#: (name, hessian_structure, subnetwork): laplace-torch's subset_of_weights is the subnetwork.
STRUCTURES = (
    ("full", "full", "all"),
    ("kron", "kron", "all"),
    ("diag", "diag", "all"),
    ("last_layer", "full", "last_layer"),
)
GRID = torch.logspace(-4, 4, 17, dtype=torch.float64)


def _guide(model, x, y, structure: str, subnetwork: str, loc=None) -> AutoSubnetLaplace:
    guide = AutoSubnetLaplace(
        model, subnetwork=subnetwork, hessian_structure=structure, prior_precision=1.0
    )
    guide(x[:2], y[:2])
    if loc is not None:
        guide.loc.data = loc.clone()
    return guide


def _theirs(laplace, plain: nn.Module, structure: str, subnetwork: str):
    """laplace-torch's Laplace of the same network (a copy), structure and prior precision."""
    return laplace.Laplace(
        copy.deepcopy(plain),
        "classification",
        subset_of_weights=subnetwork,
        hessian_structure=structure,
        prior_precision=1.0,
    )


def fit_times(hidden: int, rounds: int, rows: int | None = None) -> dict:
    """Process seconds of ``fit`` per structure, ours and laplace-torch's, and their ratio."""
    import laplace  # the optional bench extra

    data = load_digits()
    x, y = data.x_train[:rows], data.y_train[:rows]
    pyro.clear_param_store()  # the guides of one network share their MAP through the store
    torch.manual_seed(0)
    net = compare_networks.mlp((1, 8, 8), 10, hidden)
    plain = copy.deepcopy(net)
    model = models.classifier(bayesianize(net, priors.Normal(1.0)), len(y))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=128)
    times: dict = {
        name: {"ours": [], "laplace_torch": [], "laplace_torch_factorised": []}
        for name, _, _ in STRUCTURES
    }
    for _ in range(rounds):
        for name, structure, subnetwork in STRUCTURES:
            guide = _guide(model, x, y, structure, subnetwork)
            guide.batch_size = 128
            start = time.process_time()
            guide.fit((x, y))
            times[name]["ours"].append(time.process_time() - start)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                la = _theirs(laplace, plain, structure, subnetwork)
                start = time.process_time()
                la.fit(loader)
                times[name]["laplace_torch"].append(time.process_time() - start)
                # laplace-torch factorises on first use, ours in fit: time that too.
                factorised = {"kron": "posterior_precision", "diag": "posterior_variance"}
                getattr(la, factorised.get(structure, "posterior_covariance"))
                times[name]["laplace_torch_factorised"].append(time.process_time() - start)
    out = {"D": sum(p.numel() for p in plain.parameters()), "rows": len(y)}
    for name, t in times.items():
        ours, theirs, whole = (
            min(t["ours"]),
            min(t["laplace_torch"]),
            min(t["laplace_torch_factorised"]),
        )
        out[name] = {
            "ours_s": ours,
            "laplace_torch_s": theirs,
            "ratio": ours / theirs,
            "laplace_torch_factorised_s": whole,
            "ratio_factorised": ours / whole,
        }
    return out


def marglik_times(hidden: int, rows: int | None = None, epochs: int = 10) -> dict:
    """Scalar λ by the Laplace evidence, ours (L-BFGS, ``tune_prior_precision()``) against
    laplace-torch's ``optimize_prior_precision(method="marglik")`` (Adam on log λ, its defaults),
    on the same MAP MLP (trained ``epochs`` epochs) and fit per structure: the λ each finds, the
    evidence at it (each library's own), and the process time of the tuning alone. ``kron``
    differs by construction: laplace-torch keeps each bias as its own Kronecker block, ours folds
    it into the layer's input factor, so its λ and evidence need not agree."""
    import laplace  # the optional bench extra

    data = load_digits()
    x, y = data.x_train[:rows], data.y_train[:rows]
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = compare_networks.mlp((1, 8, 8), 10, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(epochs):  # a MAP estimate under the N(0, 1) prior both libraries are given
        for idx in torch.randperm(len(y)).split(64):
            opt.zero_grad()
            penalty = sum(p.square().sum() for p in net.parameters()) / (2 * len(y))
            (nn.functional.cross_entropy(net(x[idx]), y[idx]) + penalty).backward()
            opt.step()
    plain = copy.deepcopy(net)
    model = models.classifier(bayesianize(net, priors.Normal(1.0)), len(y))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=128)
    out: dict = {"D": sum(p.numel() for p in plain.parameters()), "rows": len(y)}
    map_loc = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    for name, structure, subnetwork in STRUCTURES:
        guide = _guide(model, x, y, structure, subnetwork, loc=map_loc)
        guide.fit((x, y))
        start = time.process_time()
        lam = guide.tune_prior_precision()
        ours_s = time.process_time() - start
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la = _theirs(laplace, plain, structure, subnetwork)
            la.fit(loader)
            start = time.process_time()
            la.optimize_prior_precision(method="marglik")
            theirs_s = time.process_time() - start
            their_lam = float(la.prior_precision.reshape(-1)[0])
            their_ev = float(la.log_marginal_likelihood())
        out[name] = {
            "ours_lambda": float(lam),
            "laplace_torch_lambda": their_lam,
            "ours_evidence": guide.marginal_likelihood(),
            "laplace_torch_evidence": their_ev,
            "ours_s": ours_s,
            "laplace_torch_s": theirs_s,
            "ratio": ours_s / theirs_s,
        }
    return out


def resnet_kron(rows: int, small: bool = False) -> dict:
    """A KFAC fit of torchvision's ResNet-18 (10 classes) on ``rows`` random 32 × 32 images."""
    from torchvision.models import resnet18

    pyro.clear_param_store()
    torch.manual_seed(0)
    if small:  # the smoke run: a two-layer CNN with the same layer types
        net: nn.Module = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)
        )
    else:
        net = resnet18(num_classes=10)
    x = torch.randn(rows, 3, 32, 32)
    y = torch.randint(0, 10, (rows,))
    model = models.classifier(bayesianize(net, priors.Normal(1.0)), rows)
    guide = AutoSubnetLaplace(model, subnetwork="all", hessian_structure="kron", batch_size=32)
    guide(x[:2], y[:2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    guide.fit((x, y))
    seconds = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    blocks = guide.posterior.blocks
    return {
        "D": guide.loc.numel(),
        "rows": rows,
        "layers": len(blocks),
        "largest_input_factor": max(b.positions.shape[1] for b in blocks),
        "fit_s": seconds,
        "peak_rss_mib": peak / 1024,
        "peak_rss_growth_mib": (peak - before) / 1024,
        "probs_finite": bool(torch.isfinite(guide.predict(x[:4])).all()),
    }


def rotated(
    hidden: int,
    epochs: int,
    test_rows: int | None = None,
    rows: int | None = None,
    data: Dataset | None = None,
    structures=STRUCTURES,
):
    """NLL and ECE per angle, per structure and λ rule (module docstring, parts 3 and 4)."""
    data = load_digits() if data is None else data
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))
    n_val = len(order) * 15 // 100
    x_val, y_val = data.x_train[order[:n_val]].double(), data.y_train[order[:n_val]]
    x, y = data.x_train[order[n_val:]][:rows].double(), data.y_train[order[n_val:]][:rows]
    x_test, y_test = data.x_test[:test_rows].double(), data.y_test[:test_rows]
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = compare_networks.mlp(tuple(data.x_train.shape[1:]), 10, hidden).double()
    model = models.classifier(bayesianize(net, priors.Normal(1.0)), len(y))
    base = _guide(model, x, y, "full", "all")
    svi = SVI(model, base, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(64):
            svi.step(x[idx], y[idx])
    theta = base.loc.detach()
    out: dict = {"angles": list(ANGLES), "D": theta.numel(), "map": {"nll": [], "ece": []}}
    for angle in ANGLES:
        xr = rotate(x_test, angle) if angle else x_test
        with torch.no_grad():
            logits = pyro.poutine.condition(model, data=base.layout.unpack(theta))(xr)
        out["map"]["nll"].append(nll(logits.softmax(-1), y_test))
        out["map"]["ece"].append(ece(logits.softmax(-1), y_test))
    for name, structure, subnetwork in structures:
        for rule in ("marglik", "val_ll"):
            guide = _guide(model, x, y, structure, subnetwork, loc=theta)
            start = time.process_time()
            guide.fit((x, y))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a best λ at the grid's edge is reported below
                if rule == "marglik":
                    lam = guide.tune_prior_precision()
                else:
                    lam = guide.tune_prior_precision((x_val, y_val), method="val_ll", grid=GRID)
            entry = {"lambda": lam, "fit_tune_s": time.process_time() - start}
            entry["nll"], entry["ece"] = [], []
            for angle in ANGLES:
                p = guide.predict(rotate(x_test, angle) if angle else x_test)
                entry["nll"].append(nll(p, y_test))
                entry["ece"].append(ece(p, y_test))
            entry["mean_nll"] = sum(entry["nll"]) / len(ANGLES)
            entry["mean_ece"] = sum(entry["ece"]) / len(ANGLES)
            out[f"{name}/{rule}"] = entry
    out["map"]["mean_nll"] = sum(out["map"]["nll"]) / len(ANGLES)
    out["map"]["mean_ece"] = sum(out["map"]["ece"]) / len(ANGLES)
    for rule in ("marglik", "val_ll"):
        keys = [f"{n}/{rule}" for n, _, _ in structures]
        out[f"best_mean_nll/{rule}"] = min(keys, key=lambda k: out[k]["mean_nll"])
        out[f"best_mean_ece/{rule}"] = min(keys, key=lambda k: out[k]["mean_ece"])
    return out


PARTS = ("fit_time", "rotated_digits", "resnet18_kron", "rotated_mnist", "marglik")
#: Parts that need the MNIST files; not run by default.
DATA_PARTS = ("rotated_mnist",)


def run(
    smoke: bool = False,
    hidden: int = 30,
    resnet_rows: int = 64,
    rounds: int = 3,
    parts=tuple(p for p in PARTS if p not in DATA_PARTS),
    done=None,
    data_dir=None,
) -> dict:
    """The ``parts`` of the benchmark (smoke: tiny sizes); ``done(name, figures)`` is called
    after each part, so that a long run keeps what it measured."""
    jobs = {
        "fit_time": lambda: fit_times(8, 1, rows=64) if smoke else fit_times(hidden, rounds),
        "rotated_digits": lambda: (
            rotated(8, 1, test_rows=40, rows=100) if smoke else rotated(hidden, 40)
        ),
        "resnet18_kron": lambda: resnet_kron(4, small=True) if smoke else resnet_kron(resnet_rows),
        "marglik": lambda: marglik_times(8, rows=64, epochs=1) if smoke else marglik_times(hidden),
        "rotated_mnist": lambda: rotated(
            *((8, 1) if smoke else (hidden, 20)),
            **({"test_rows": 40, "rows": 100} if smoke else {}),
            data=load_mnist(data_dir),
            structures=STRUCTURES[1:],
        ),
    }
    results = {}
    for name in parts:
        results[name] = jobs[name]()
        if done is not None:
            done(name, results[name])
    return results


def report(name: str, figures: dict) -> None:
    """Print one part's figures."""
    if name == "fit_time":
        print(
            f"fit time, D = {figures['D']}, {figures['rows']} rows (target ≤ 0.5× laplace-torch):"
        )
        for structure, _, _ in STRUCTURES:
            f = figures[structure]
            print(
                f"  {structure:10s} {f['ours_s']:8.3f} s vs {f['laplace_torch_s']:8.3f} s: "
                f"{f['ratio']:.2f}× (factorised too: {f['laplace_torch_factorised_s']:.3f} s, "
                f"{f['ratio_factorised']:.2f}×)"
            )
    elif name == "marglik":
        print(f"λ by marglik, D = {figures['D']}: ours (L-BFGS) vs laplace-torch (Adam):")
        for structure, _, _ in STRUCTURES:
            f = figures[structure]
            print(
                f"  {structure:10s} λ {f['ours_lambda']:.4g} vs {f['laplace_torch_lambda']:.4g}; "
                f"evidence {f['ours_evidence']:.2f} vs {f['laplace_torch_evidence']:.2f}; "
                f"{f['ours_s']:.3f} s vs {f['laplace_torch_s']:.3f} s ({f['ratio']:.2f}×)"
            )
    elif name == "resnet18_kron":
        print(
            f"ResNet-18 kron fit: D = {figures['D']}, {figures['rows']} rows, "
            f"{figures['fit_s']:.1f} s, peak RSS {figures['peak_rss_mib']:.0f} MiB"
        )
    else:
        print(f"{name.replace('_', ' ')}, mean over angles (NLL / ECE):")
        m = figures["map"]
        print(f"  {'map':22s} {m['mean_nll']:.3f} / {m['mean_ece']:.3f}")
        for structure, _, _ in STRUCTURES:
            for rule in ("marglik", "val_ll"):
                key = f"{structure}/{rule}"
                if key not in figures:
                    continue
                e = figures[key]
                lam = e["lambda"] if isinstance(e["lambda"], float) else float("nan")
                print(f"  {key:22s} {e['mean_nll']:.3f} / {e['mean_ece']:.3f}  λ {lam:.3g}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--hidden", type=int, default=30)
    parser.add_argument("--resnet-rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    default_parts = [p for p in PARTS if p not in DATA_PARTS]
    parser.add_argument("--parts", nargs="+", default=default_parts, choices=PARTS)
    parser.add_argument("--data-dir", default=None, help="MNIST folder (default $PYRO_BDL_DATA)")
    args = parser.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)

    def done(name: str, figures: dict) -> None:
        report(name, figures)
        if not args.smoke:  # one file per part: a long run keeps what it measured
            write(f"laplace_structures_{name}", vars(args), figures)

    run(args.smoke, args.hidden, args.resnet_rows, args.rounds, args.parts, done, args.data_dir)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
