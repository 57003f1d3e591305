"""Subnetwork linearized Laplace under rotation: the quality check of the Laplace issue.

Protocol, fixed before any figure and the same for every method:

1. Data: scikit-learn's ``load_digits`` (default: 1,437 train / 360 test) or, with
   ``--data-dir``, the MNIST test set split 8,000 / 2,000 (``pyro_bdl.app.data.load_mnist``). 15% of
   the training split (fixed seed) is held out as in-distribution validation data; everything
   else trains on the other 85%. The test digits are rotated by 0°, 30°, …, 180°.
2. Network: an MLP with two hidden ReLU layers of 100, trained as a MAP point estimate
   (``AutoSubnetLaplace`` under SVI) by Adam (lr 1e-3, batches of 64; 40 epochs on digits, 20 on
   MNIST) under the prior N(0, 1).
3. Marginal variances for selection: SWAG-diag from SGD with momentum 0.9 at the constant rate
   0.05 (on the mean loss), started at the MAP, 10 epochs, 4 snapshots per epoch (40), the
   estimator the paper uses (docs/design/laplace.md: diagonal Laplace would pick the weights
   with zero GGN, whose variance is the prior's). Also reported: SWAG-diag from Adam snapshots
   (one per epoch), diagonal-Laplace variances, and the last layer.
4. S = 1,000 weights for every selected subnetwork; random selection with :data:`RANDOM_SEEDS`
   seeds (the baseline is their mean ± standard error).
5. Prior precision: **one λ for every method**, the value that maximises the validation
   log-likelihood of diagonal Laplace over all weights (the tractable full-network
   approximation; grid 10⁻⁴…10⁴, 17 values, then refinement); a subnetwork uses
   λ_S = λ·S/D (the paper's appendix C: λ is set for the full network and rescaled to keep the
   implied kernel's magnitude). MAP is the λ → ∞ limit. Predictive: linearized, probit.
6. Metrics: NLL and ECE (15 bins) of each angle, averaged over the 7 angles.

Claims checked (``claims`` in the JSON): subnetwork Laplace with the largest SWAG-diag (SGD)
variances has a lower mean NLL and mean ECE than MAP, than diagonal Laplace, and than random
selection's mean minus two standard errors.

For comparison, not the headline, the same fitted posteriors under three other λ rules: λ = 1
for all (the training prior), the marginal likelihood of each method, and the validation
log-likelihood of each method (the paper's ResNet protocol).

Run: ``python -m benchmarks.laplace_quality [--quick] [--data-dir DIR]``.
"""

from __future__ import annotations

import argparse
import math
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torchvision.transforms.functional import rotate

from benchmarks.common import write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.app.compare import problem as compare_networks
from pyro_bdl.app.data import Dataset, load_digits, load_mnist
from pyro_bdl.curvature import diagonal_ggn, output_hessian_factor, subnet_jacobian
from pyro_bdl.diagnostics.metrics import ece, nll
from pyro_bdl.guides import AutoSubnetLaplace, AutoSWAG
from pyro_bdl.guides.laplace.evidence import evidence, tune_grid
from pyro_bdl.guides.laplace.model import eval_mode, forward_fn, leaf_slots
from pyro_bdl.guides.laplace.posterior import DiagPosterior

#: Random subnetworks are drawn with this many seeds; their mean ± standard error is the
#: baseline that a selection rule must beat.
RANDOM_SEEDS = 5
ANGLES = (0, 30, 60, 90, 120, 150, 180)
SIZE = 1000
SETTINGS = {
    "shared_val_ll": "one λ for all, by diagonal Laplace's validation log-likelihood (headline)",
    "prior": "λ = 1 for all, the training prior",
    "marglik": "each method's marginal likelihood",
    "val_ll": "each method's validation log-likelihood",
}
GRID = torch.logspace(-4, 4, 17, dtype=torch.float64)


def holdout(data: Dataset):
    """The protocol's split of the training data: ``((x, y), (x_val, y_val))``, 15% of the
    rows (drawn with seed 0) held out as in-distribution validation data."""
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))
    n_val = len(order) * 15 // 100
    val, train = order[:n_val], order[n_val:]
    return (data.x_train[train], data.y_train[train]), (data.x_train[val], data.y_train[val])


def rotated(x: torch.Tensor, angle: float) -> torch.Tensor:
    """The test inputs rotated by ``angle`` degrees (counter-clockwise; 0 returns ``x``)."""
    return rotate(x, angle) if angle else x


def _probit(f: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Probit predictive from MAP logits (n, C) and pairwise-difference variances (n, L):
    (L, n, C) probabilities, as in
    :func:`~pyro_bdl.guides.laplace.predictive.linearized_predictive`."""
    kappa = (1 + math.pi / 8 * var.T).rsqrt().unsqueeze(-1)
    return (f.double().unsqueeze(0) * kappa).softmax(-1)


class RotationStudy:
    """MAP, SWAG-diag variances and every fitted posterior of the protocol (module docstring);
    :meth:`evaluate` scores them under a choice of λ per method."""

    def __init__(self, data: Dataset, *, epochs: int, test_size: int | None = None, seed=0):
        (x, y), (self.x_val, self.y_val) = holdout(data)
        self.x_test, self.y_test = data.x_test[:test_size], data.y_test[:test_size]
        n = len(y)
        pyro.clear_param_store()
        torch.manual_seed(seed)
        net = compare_networks.mlp(tuple(x.shape[1:]), 10, 100)
        self.model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), n)
        self.base = AutoSubnetLaplace(self.model, subnetwork="all")
        svi = SVI(self.model, self.base, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
        g = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for idx in torch.randperm(n, generator=g).split(64):
                svi.step(x[idx], y[idx])
        self.theta = self.base.loc.detach().clone()
        values = self.base.layout.unpack(self.base.loc.detach())

        def swag(optim, per_epoch: int) -> AutoSWAG:
            store = pyro.get_param_store()
            for key in [k for k in store.keys() if k.startswith("AutoSWAG")]:
                del store[key]  # each SWAG run starts from the MAP
            guide = AutoSWAG(self.model, diag_only=True, init_loc_fn=lambda s: values[s["name"]])
            svi = SVI(self.model, guide, optim, Trace_ELBO())
            every = max(1, math.ceil(n / 64) // per_epoch)
            for _ in range(10):
                for step, idx in enumerate(torch.randperm(n, generator=g).split(64)):
                    svi.step(x[idx], y[idx])
                    if step % every == 0:
                        guide.collect()
            return guide

        # The ELBO sums over the n examples: lr 0.05 / n is 0.05 on the mean loss.
        swag_sgd = swag(pyro.optim.SGD({"lr": 0.05 / n, "momentum": 0.9}), 4)
        swag_adam = swag(pyro.optim.Adam({"lr": 1e-3}), 1)
        rules = {
            "subnet_swag_sgd": dict(subnetwork="largest_variance", size=SIZE, variances=swag_sgd),
            "subnet_swag_adam": dict(subnetwork="largest_variance", size=SIZE, variances=swag_adam),
            "subnet_diag_laplace": dict(subnetwork="largest_variance", size=SIZE),
            "subnet_last_layer": dict(subnetwork="last_layer"),
            **{
                f"subnet_random_{k}": dict(subnetwork="random", size=SIZE, seed=k)
                for k in range(RANDOM_SEEDS)
            },
        }
        self.guides: dict[str, AutoSubnetLaplace] = {}
        self.fit_seconds: dict[str, float] = {}
        for name, kw in rules.items():
            # The protocol's λ_S = λ·S/D (module docstring), in the guides' tuning too.
            guide = AutoSubnetLaplace(
                self.model, batch_size=128, prior_scaling="subnetwork_fraction", **kw
            )  # type: ignore[arg-type]
            guide(x[:2], y[:2])
            guide.loc.data = self.theta.clone()
            start = time.process_time()
            self.guides[name] = guide.fit((x, y))
            self.fit_seconds[name] = time.process_time() - start
        # Diagonal Laplace over all weights: precision = diag GGN + λ.
        self.diag = torch.zeros_like(self.theta, dtype=torch.float64)
        with eval_mode(self.model):
            for idx in torch.arange(n).split(128):
                vals, slots = leaf_slots(self.base.layout, self.theta)
                forward = forward_fn(self.model, vals, (x[idx], y[idx]), "y")
                hess = lambda f: output_hessian_factor(f, "categorical")  # noqa: E731
                self.diag += diagonal_ggn(forward, slots, hess).double()
        self.eigen = {k: torch.linalg.eigh(v.ggn.double()) for k, v in self.guides.items()}
        self.D = self.theta.numel()
        self.zero_ggn = int((self.diag == 0).sum())

    # ---- predictive variances for many λ at once ----------------------------------------------

    def _map_jacobians(self, x: torch.Tensor, index: torch.Tensor, rows: int):
        """Centred J_S (over the classes) and logits at the MAP, ``rows`` examples at a time."""
        with eval_mode(self.model):
            for start in range(0, len(x), rows):
                values, slots = leaf_slots(self.base.layout, self.theta)
                forward = forward_fn(self.model, values, (x[start : start + rows],), "y")
                jac, f = subnet_jacobian(forward, slots, index, return_outputs=True)
                yield (jac - jac.mean(1, keepdim=True)).double(), f.detach().double()

    def _parts(self, method: str, x: torch.Tensor):
        """Chunks (MAP logits (b, C), q (b, K)) with the probit variance for a precision vector
        w being ``2/(C-1) · q @ w``: for diagonal Laplace K = D and q the squared centred
        Jacobian; for a subnetwork K = S and q the squared centred Jacobian in the GGN's
        eigenbasis, so that any λ costs one product."""
        if method == "diag_laplace":
            index, rows, vecs = torch.arange(self.D), max(1, 64 * 17_610 // self.D), None
        else:
            index, rows, vecs = self.guides[method].subnet_index, 128, self.eigen[method][1]
        for jac, f in self._map_jacobians(x, index, rows):
            q = (jac if vecs is None else jac @ vecs).square().sum(1)
            yield f, 2.0 / (f.shape[1] - 1) * q

    def _weights(self, method: str, lams: list[float]) -> torch.Tensor:
        """(K, len(lams)) posterior variances per component: 1/(GGN diagonal + λ) for diagonal
        Laplace, 1/(GGN eigenvalue + λ·S/D) for a subnetwork."""
        lam = torch.tensor(lams, dtype=torch.float64)
        if method == "diag_laplace":
            return 1.0 / (self.diag.unsqueeze(1) + lam)
        evals = self.eigen[method][0].clamp_min(0).unsqueeze(1)
        return 1.0 / (evals + lam * self.guides[method].subnet_index.numel() / self.D)

    def variances(self, method: str, x: torch.Tensor, lams: list[float]):
        """MAP logits (n, C) and the probit variances (n, len(lams)) of ``method``."""
        weights = self._weights(method, lams)
        parts = [(f, q @ weights) for f, q in self._parts(method, x)]
        return torch.cat([f for f, _ in parts]), torch.cat([v for _, v in parts])

    # ---- λ rules -------------------------------------------------------------------------------

    def tune_diagonal(self) -> float:
        """λ of diagonal Laplace by validation log-likelihood (grid, then refinement)."""
        parts = [(f, q.float()) for f, q in self._parts("diag_laplace", self.x_val)]
        f, q = torch.cat([f for f, _ in parts]), torch.cat([q for _, q in parts])

        def score(lam: torch.Tensor) -> torch.Tensor:
            var = (q @ (1.0 / (self.diag + lam)).float()).double().unsqueeze(1)
            p = _probit(f, var)[0]
            return p[torch.arange(len(p)), self.y_val].log().sum()

        return tune_grid(score, GRID)

    def lambdas(self, setting: str, shared: float) -> dict[str, float]:
        """λ of every method (diagonal Laplace and each subnetwork) under ``setting``."""
        if setting == "shared_val_ll":
            return {"diag_laplace": shared, **dict.fromkeys(self.guides, shared)}
        if setting == "prior":
            return {"diag_laplace": 1.0, **dict.fromkeys(self.guides, 1.0)}
        out = {}
        if setting == "marglik":
            diag, theta = DiagPosterior(self.diag, self.diag.new_zeros(())), self.theta.double()
            score = lambda lam: evidence(diag, theta, lam)  # noqa: E731
            out["diag_laplace"] = tune_grid(score, GRID)
            for name, guide in self.guides.items():
                out[name] = guide.tune_prior_precision(method="marglik")
            return out
        out["diag_laplace"] = shared  # the same validation rule as the headline's
        for name, guide in self.guides.items():
            out[name] = guide.tune_prior_precision((self.x_val, self.y_val), method="val_ll")
        return out

    # ---- scoring -------------------------------------------------------------------------------

    def evaluate(self, lams: dict[str, dict[str, float]]) -> dict:
        """Per setting and method: NLL and ECE at every angle; ``lams[setting][method]``."""
        methods = ["map", "diag_laplace", *self.guides]
        out: dict = {s: {m: {"nll": [], "ece": []} for m in methods} for s in lams}
        y = self.y_test
        for angle in ANGLES:
            x = rotated(self.x_test, angle)
            for method in methods[1:]:
                values = [lams[s][method] for s in lams]
                f, var = self.variances(method, x, values)
                for setting, p in zip(lams, _probit(f, var)):
                    out[setting][method]["nll"].append(nll(p, y))
                    out[setting][method]["ece"].append(ece(p, y))
            p_map = f.softmax(-1)
            for setting in lams:
                out[setting]["map"]["nll"].append(nll(p_map, y))
                out[setting]["map"]["ece"].append(ece(p_map, y))
        return out

    def check_predict(self, method: str, lam: float) -> float:
        """Largest difference between :meth:`AutoSubnetLaplace.predict` and :meth:`variances`
        at λ on the unrotated test digits (both are the probit predictive)."""
        guide = self.guides[method]
        guide.tune_prior_precision(
            method="marglik", grid=torch.tensor([lam]), refine=False
        )  # sets λ
        ours = guide.predict(self.x_test).double()
        f, var = self.variances(method, self.x_test, [lam])
        return float((ours - _probit(f, var)[0]).abs().max())


def summarize(per_angle: dict, lams: dict[str, float], study: RotationStudy) -> dict:
    summary = {}
    for name, d in per_angle.items():
        summary[name] = {
            "mean_nll": sum(d["nll"]) / len(d["nll"]),
            "mean_ece": sum(d["ece"]) / len(d["ece"]),
            "nll_0deg": d["nll"][0],
            "ece_0deg": d["ece"][0],
        }
        if name in lams:
            summary[name]["prior_precision"] = lams[name]
        if name in study.guides:
            summary[name]["S"] = int(study.guides[name].subnet_index.numel())
            summary[name]["fit_cpu_s"] = study.fit_seconds[name]
    return summary


def selection(summary: dict) -> dict:
    """Each largest-variance rule against random selection's mean ± standard error."""
    out: dict = {}
    for metric in ("mean_nll", "mean_ece"):
        values = torch.tensor(
            [v[metric] for k, v in summary.items() if k.startswith("subnet_random_")],
            dtype=torch.float64,
        )
        mean, se = float(values.mean()), float(values.std() / len(values) ** 0.5)
        out[metric] = {"random_mean": mean, "random_se": se, "seeds": len(values)}
        for rule in ("subnet_swag_sgd", "subnet_swag_adam", "subnet_diag_laplace"):
            value = summary[rule][metric]
            out[metric][rule] = value
            out[metric][f"{rule}_minus_random_in_se"] = (value - mean) / se if se else None
    return out


def claims(summary: dict, sel: dict) -> dict:
    """The issue's two claims for the SWAG-diag (SGD) subnetwork; random must be beaten by more
    than two of its standard errors."""
    ours, out = summary["subnet_swag_sgd"], {}
    for metric in ("mean_nll", "mean_ece"):
        out[f"{metric}_below_map"] = ours[metric] < summary["map"][metric]
        out[f"{metric}_below_diag_laplace"] = ours[metric] < summary["diag_laplace"][metric]
        random = sel[metric]
        out[f"{metric}_below_random_minus_2se"] = (
            ours[metric] < random["random_mean"] - 2 * random["random_se"]
        )
    return out


def run(data: Dataset, *, quick: bool = False, settings=tuple(SETTINGS)) -> dict:
    """The protocol on ``data``; figures per λ setting (the headline first)."""
    epochs = (15 if quick else 40) if data.name != "mnist" else (5 if quick else 20)
    study = RotationStudy(data, epochs=epochs, test_size=150 if quick else None)
    shared = study.tune_diagonal()
    lams = {s: study.lambdas(s, shared) for s in settings}
    per_angle = study.evaluate(lams)
    results: dict = {
        "dataset": data.name,
        "angles": list(ANGLES),
        "D": study.D,
        "zero_ggn_weights": study.zero_ggn,
        "n_train": len(data.y_train) - len(study.y_val),
        "n_val": len(study.y_val),
        "n_test": len(study.y_test),
    }
    for setting in settings:
        summary = summarize(per_angle[setting], lams[setting], study)
        sel = selection(summary)
        results[setting] = {
            "rule": SETTINGS[setting],
            "summary": summary,
            "per_angle": per_angle[setting],
            "selection": sel,
            "claims": claims(summary, sel),
        }
    results["predict_check_max_abs_diff"] = study.check_predict("subnet_swag_sgd", shared)
    return results


def report(results: dict) -> None:
    print(
        f"{results['dataset']}: D = {results['D']} ({results['zero_ggn_weights']} with zero "
        f"GGN), S = {SIZE}, train/val/test {results['n_train']}/{results['n_val']}/"
        f"{results['n_test']}, angles {results['angles']}"
    )
    for setting, rule in SETTINGS.items():
        if setting not in results:
            continue
        r = results[setting]
        summary, m = r["summary"], r["summary"]["map"]
        print(f"-- prior precision: {rule}")
        for name, s in summary.items():
            if name.startswith("subnet_random_"):
                continue
            lam = s.get("prior_precision")
            print(
                f"{name:>20}: NLL {s['mean_nll']:.3f} ({s['mean_nll'] / m['mean_nll']:.3f}x MAP), "
                f"ECE {s['mean_ece']:.3f} ({s['mean_ece'] / m['mean_ece']:.3f}x MAP)"
                + (f", λ {lam:.3g}" if lam is not None else "")
            )
        for metric in ("mean_nll", "mean_ece"):
            sel = r["selection"][metric]
            print(
                f"{'random':>20}: {metric} {sel['random_mean']:.3f} ± {sel['random_se']:.3f} (SE, "
                f"{sel['seeds']} seeds); SWAG-diag (SGD) is "
                f"{sel['subnet_swag_sgd_minus_random_in_se']:+.1f} SE from it"
            )
        print(f"claims: {r['claims']}")
    print(f"predict() vs the cached probit: max |Δp| {results['predict_check_max_abs_diff']:.1e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs, 150 test digits")
    parser.add_argument("--data-dir", default=None, help="MNIST test split instead of digits")
    args = parser.parse_args(argv if argv is not None else [])
    torch.set_num_threads(1)
    data = load_mnist(args.data_dir) if args.data_dir else load_digits()
    start = time.process_time()
    results = run(data, quick=args.quick)
    results["total_cpu_s"] = time.process_time() - start
    report(results)
    name = "laplace_quality" if not args.data_dir else "laplace_quality_mnist"
    write(name, {"quick": args.quick, "data_dir": bool(args.data_dir)}, results)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
