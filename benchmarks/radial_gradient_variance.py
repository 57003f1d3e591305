"""The Radial paper's central claim, measured: ELBO-gradient variance as the posterior scale grows.

A Bayesian MLP (64-100-100-10) on scikit-learn's ``load_digits``: the locations are a MAP network
(short full-batch Adam run); every site's scale is set to ``c`` times the RMS of that site's MAP
weights, for ``c`` from 1e-3 to 1e-1. For each ``c`` and for ``AutoMeanField`` and ``AutoRadial``
we draw ``--draws`` single-sample gradients of the full-batch ``TraceMeanField_ELBO`` loss (the KL
is exact, so all the noise comes from the weight draw) and report the total variance
``Σ_p Var(∂loss/∂μ_p)`` (and the same for ρ), plus the mean-field / Radial ratio. As in the paper
both families share σ; since a Radial's per-weight variance is σ²/D, a third curve scales the
Radial's σ by √D (equal per-weight variance) for a like-for-like spread. A PNG plot goes to
``benchmarks/results/radial_gradient_variance.png``.

Usage::

    python -m benchmarks.radial_gradient_variance [--quick] [--draws 200]
"""

from __future__ import annotations

import argparse

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from torch import nn

from benchmarks.common import RESULTS, write
from pyro_bdl import bayesianize, models, priors, sites
from pyro_bdl.app.data import load_digits
from pyro_bdl.guides import AutoMeanField, AutoRadial


def build_net(d_in: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d_in, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)
    )


def map_network(x: torch.Tensor, y: torch.Tensor, steps: int) -> nn.Module:
    torch.manual_seed(0)
    net = build_net(x.shape[1]).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net


def gradient_variance(
    guide_cls, state: dict, x, y, c: float, draws: int, *, matched: bool = False
) -> dict:
    """Total variance of the single-draw loss gradient w.r.t. the locations and the ρs.

    ``matched``: multiply each site's σ by √D, so that a Radial's per-weight variance σ²/D equals
    the mean-field one (the comparison at equal marginal spread rather than equal σ).
    """
    pyro.clear_param_store()
    net = build_net(x.shape[1]).double()
    net.load_state_dict(state)
    bnn = bayesianize(net, priors.Normal(scale=1.0))
    model = models.classifier(bnn, len(y))
    guide = guide_cls(model)
    guide(x, y)
    for name, spec in sites(bnn).items():
        scale = c * spec.init_value.pow(2).mean().sqrt()
        if matched:
            scale = scale * spec.init_value.numel() ** 0.5
        guide.set_loc_scale(name, scale=scale)
    elbo = TraceMeanField_ELBO()
    params = [guide.loc, guide.rho]
    samples: list[list[torch.Tensor]] = [[], []]
    for _ in range(draws):
        loss = elbo.differentiable_loss(model, guide, x, y)
        for store, g in zip(samples, torch.autograd.grad(loss, params)):
            store.append(g)
    out = {}
    for key, store in zip(("loc", "rho"), samples):
        # Two-pass variance in float64: the deterministic KL part of the ρ-gradient is far
        # larger than its noise, so E[g²] − E[g]² would cancel catastrophically.
        g = torch.stack(store)
        out[f"var_{key}"] = float(g.var(0).sum())
        out[f"mean_sq_{key}"] = float(g.mean(0).pow(2).sum())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer draws and scales")
    parser.add_argument("--draws", type=int, default=200)
    args, _ = parser.parse_known_args(argv)  # run_all passes its own argv through
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    draws = 40 if args.quick else args.draws
    scales = [1e-3, 1e-2, 1e-1] if args.quick else [1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1]
    data = load_digits()
    # float64 throughout: the Radial's gradient noise is small enough that float32 round-off
    # of the gradients would be a visible part of the measured variance.
    x = data.x_train.reshape(len(data.y_train), -1).double()
    y = data.y_train
    net = map_network(x, y, steps=300)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rows = []
    for c in scales:
        mf = gradient_variance(AutoMeanField, state, x, y, c, draws)
        rad = gradient_variance(AutoRadial, state, x, y, c, draws)
        matched = gradient_variance(AutoRadial, state, x, y, c, draws, matched=True)
        row = {
            "relative_scale": c,
            "meanfield": mf,
            "radial": rad,
            "radial_variance_matched": matched,
            "ratio_loc": mf["var_loc"] / rad["var_loc"],
            "ratio_rho": mf["var_rho"] / rad["var_rho"],
            "ratio_loc_variance_matched": mf["var_loc"] / matched["var_loc"],
        }
        rows.append(row)
        print(
            f"sigma/weight-scale={c:.0e}  Var[grad mu]: meanfield {mf['var_loc']:.3e}  "
            f"radial {rad['var_loc']:.3e}  ratio {row['ratio_loc']:.1f}x   "
            f"Var[grad rho]: meanfield {mf['var_rho']:.3e}  radial {rad['var_rho']:.3e}  "
            f"ratio {row['ratio_rho']:.1f}x   "
            f"variance-matched Radial Var[grad mu] {matched['var_loc']:.3e} "
            f"(meanfield/it {row['ratio_loc_variance_matched']:.2f}x)",
            flush=True,
        )
    plot(rows)
    config = {
        "dataset": "load_digits (train split)",
        "network": "MLP 64-100-100-10, MAP locations (300 full-batch Adam steps)",
        "n": len(y),
        "draws": draws,
        "dtype": "float64",
        "elbo": "TraceMeanField_ELBO, full batch, one draw per gradient",
        "scale": "sigma = c * RMS(site's MAP weights); variance-matched Radial: sigma * sqrt(D)",
    }
    write("radial_gradient_variance", config, {"rows": rows})


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["relative_scale"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in zip(axes, ("var_loc", "var_rho"), ("∂/∂μ", "∂/∂ρ")):
        ax.loglog(c, [r["meanfield"][key] for r in rows], "o-", label="AutoMeanField")
        ax.loglog(c, [r["radial"][key] for r in rows], "s-", label="AutoRadial (same σ)")
        ax.loglog(
            c,
            [r["radial_variance_matched"][key] for r in rows],
            "^--",
            label="AutoRadial (σ√D: same per-weight variance)",
        )
        ax.set_xlabel("σ / weight scale")
        ax.set_ylabel("total gradient variance")
        ax.set_title(f"ELBO gradient variance, {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Bayesian MLP on load_digits (full batch, one weight draw per gradient)")
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "radial_gradient_variance.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
