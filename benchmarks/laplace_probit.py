"""Multi-class links of the linearized Laplace predictive against Monte Carlo on the same fit.

Protocol:

1. Data: scikit-learn's ``load_digits`` (1,437 train / 360 test) and, when ``--data-dir`` or
   ``$PYRO_BDL_DATA`` holds ``mnist-test``, the MNIST test set split 8,000 / 2,000
   (``pyro_bdl.app.data.load_mnist``).
2. Network: an MLP with two hidden ReLU layers of ``--hidden`` units (default 50: digits
   64-50-50-10, D = 6,310; with 100 units, D = 17,610 makes the full GGN, its inversion and
   laplace-torch's a half hour each on a 2-core machine), trained as a MAP point estimate by
   Adam (lr 1e-3, batches of 64; 40 epochs on digits, 20 on MNIST) under the prior N(0, 1).
3. Posterior: :class:`~pyro_bdl.guides.AutoSubnetLaplace` at the declared prior precision 1
   of each included weight (``prior_scaling="per_weight"``, so Σ_S = (GGN_S + I)⁻¹, the same
   posterior laplace-torch fits with ``prior_precision=1``), over ``"all"`` weights on digits,
   a ``"random"`` S = 2,000 subnetwork on MNIST (D = 42,310 is too large for a D × D matrix on
   the benchmark machine; the ``"largest_variance"`` one by diagonal-Laplace variances picks
   weights of zero GGN there, whose predictive variance is ~0, so every link equals MAP), and
   ``"last_layer"`` on both.
4. Links, all from the same MAP logits f and J_S L on the test set: ``pairwise_mean`` (the
   former formula, computed here only for the comparison: every logit divided by
   √(1 + π v̄/8), v̄ the mean variance of the pairwise logit differences), ``probit`` (per
   class: f_k / √(1 + π Var[f_k]/8), :meth:`predict`'s default), ``bridge`` (the Laplace
   bridge), and laplace-torch 0.3's ``probit`` / ``bridge`` on a laplace-torch ``Laplace`` fitted
   to the same network and data with the same prior (when laplace-torch is installed and the
   subnetwork is ``all`` or ``last_layer``).
5. Reference: Monte Carlo over the linearized model with 10,000 draws (10 × 1,000). Its own error
   on p is about √(p(1−p)/10⁴) ≤ 0.005 per entry, and far less in the mean over entries.
6. Metrics: mean |p − p_MC| over all test points and classes, and test NLL next to MC's NLL.

Run: ``python -m benchmarks.laplace_probit [--data-dir DIR] [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from benchmarks.common import write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.app.compare import problem as compare_networks
from pyro_bdl.app.data import Dataset, load_digits, load_mnist
from pyro_bdl.curvature import subnet_jacobian
from pyro_bdl.guides import AutoSubnetLaplace
from pyro_bdl.guides.laplace.model import eval_mode, forward_fn, leaf_slots
from pyro_bdl.guides.laplace.predictive import linearized_predictive

MC_DRAWS = 10_000
MC_CHUNK = 1_000


def pairwise_mean_probit(f: torch.Tensor, jl: torch.Tensor) -> torch.Tensor:
    """The former multi-class probit: one factor from the mean variance of the pairwise logit
    differences, 2 tr(P Σ_f P)/(C − 1) with P the centring matrix."""
    centred = jl - jl.mean(1, keepdim=True)
    var = 2.0 / (f.shape[1] - 1) * centred.square().sum((1, 2))
    return (f / (1 + math.pi / 8 * var).sqrt().unsqueeze(-1)).softmax(-1)


def train_map(data: Dataset, hidden: int, epochs: int, seed: int = 0):
    pyro.clear_param_store()
    torch.manual_seed(seed)
    x, y = data.x_train, data.y_train
    net = compare_networks.mlp(tuple(x.shape[1:]), data.num_classes, hidden)
    plain = copy.deepcopy(net)
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), len(y))
    guide = AutoSubnetLaplace(model, subnetwork="all")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(64):
            svi.step(x[idx], y[idx])
    theta = guide.loc.detach().clone()
    # The same MAP weights in the plain network, for laplace-torch.
    params = dict(plain.named_parameters())
    for name, value in guide.layout.unpack(theta).items():
        key = next(k for k in params if name == k or name.endswith("." + k))
        params[key].data.copy_(value.reshape(params[key].shape))
    return model, guide.layout, theta, plain


def test_parts(model, layout, theta, index, x, scale_tril, rows=128):
    """MAP logits f (n, C) and J_S L (n, C, S) on ``x``, in the covariance's dtype."""
    fs, jls = [], []
    with eval_mode(model):
        for start in range(0, len(x), rows):
            values, slots = leaf_slots(layout, theta)
            forward = forward_fn(model, values, (x[start : start + rows],), "y")
            jac, f = subnet_jacobian(forward, slots, index, return_outputs=True)
            fs.append(f.detach().to(scale_tril.dtype))
            jls.append(jac.detach().to(scale_tril.dtype) @ scale_tril)
    return torch.cat(fs), torch.cat(jls)


def monte_carlo(f: torch.Tensor, jl: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    total = torch.zeros_like(f)
    for _ in range(MC_DRAWS // MC_CHUNK):
        for start in range(0, len(f), 256):
            rows = slice(start, start + 256)
            total[rows] += linearized_predictive(
                f[rows], jl[rows], "categorical", link="mc", num_samples=MC_CHUNK
            )
    return total / (MC_DRAWS // MC_CHUNK)


def nll(p: torch.Tensor, y: torch.Tensor) -> float:
    return float(-p.gather(1, y[:, None]).clamp_min(1e-300).log().mean())


def laplace_torch(plain, data: Dataset, subset: str, x_test) -> dict[str, torch.Tensor] | None:
    """laplace-torch's probit, bridge and Monte Carlo on the same network, data and prior (None
    when it is not installed)."""
    try:
        from laplace import Laplace
    except ImportError:
        return None
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data.x_train, data.y_train), batch_size=128
    )
    la = Laplace(
        copy.deepcopy(plain),
        "classification",
        subset_of_weights=subset,
        hessian_structure="full",
        prior_precision=1.0,
    )
    la.fit(loader)
    with torch.no_grad():
        out = {
            link: la(x_test, pred_type="glm", link_approx=link).double()
            for link in ("probit", "bridge")
        }
        # Its own Monte Carlo: equal to ours to MC error when the two posteriors agree.
        out["mc"] = la(x_test, pred_type="glm", link_approx="mc", n_samples=MC_DRAWS).double()
        return out


def run_case(model, layout, theta, plain, data, subnetwork, size, use_lt):
    x, y = data.x_train, data.y_train
    kw = {"size": size} if size else {}
    guide = AutoSubnetLaplace(
        model, subnetwork=subnetwork, prior_scaling="per_weight", batch_size=128, **kw
    )
    guide(x[:2], y[:2])
    guide.loc.data = theta.clone()
    start = time.perf_counter()
    guide.fit((x, y))
    fit_s = time.perf_counter() - start
    f, jl = test_parts(model, layout, theta, guide.subnet_index, data.x_test, guide.scale_tril)
    y_test = data.y_test
    p_mc = monte_carlo(f, jl)
    probs = {
        "pairwise_mean": pairwise_mean_probit(f, jl),
        "probit": linearized_predictive(f, jl, "categorical", link="probit"),
        "bridge": linearized_predictive(f, jl, "categorical", link="bridge"),
    }
    # The links computed here are the ones predict() returns.
    assert torch.allclose(probs["probit"], guide.predict(data.x_test).double(), atol=1e-6)
    if use_lt and subnetwork in ("all", "last_layer"):
        lt = laplace_torch(plain, data, subnetwork, data.x_test)
        if lt is not None:
            probs.update({f"laplace_torch_{k}": v for k, v in lt.items()})
    row = {
        "S": int(guide.subnet_index.numel()),
        "fit_seconds": fit_s,
        "mc_nll": nll(p_mc, y_test),
        "map_nll": nll(f.softmax(-1), y_test),
        "links": {
            name: {"mean_abs_diff_to_mc": float((p - p_mc).abs().mean()), "nll": nll(p, y_test)}
            for name, p in probs.items()
        },
    }
    print(
        subnetwork,
        {
            k: (round(v["mean_abs_diff_to_mc"], 4), round(v["nll"], 4))
            for k, v in row["links"].items()
        },
        "MC",
        round(row["mc_nll"], 4),
    )
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--hidden", type=int, default=50)
    parser.add_argument("--no-laplace-torch", action="store_true")
    parser.add_argument("--quick", action="store_true", help="digits last layer only")
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float32)
    figures: dict = {}
    datasets = [("digits", load_digits(), 40, [("all", None), ("last_layer", None)])]
    if args.quick:
        datasets = [("digits", load_digits(), 40, [("last_layer", None)])]
    else:
        try:
            mnist = load_mnist(args.data_dir)
            datasets.append(("mnist", mnist, 20, [("random", 2000), ("last_layer", None)]))
        except (FileNotFoundError, ValueError) as err:
            print(f"MNIST skipped: {err}")
    for name, data, epochs, cases in datasets:
        model, layout, theta, plain = train_map(data, args.hidden, epochs)
        figures[name] = {"D": int(theta.numel())}
        for subnetwork, size in cases:
            figures[name][subnetwork] = run_case(
                model, layout, theta, plain, data, subnetwork, size, not args.no_laplace_torch
            )
    config = {
        "hidden": args.hidden,
        "mc_draws": MC_DRAWS,
        "prior_precision": 1.0,
        "prior_scaling": "per_weight",
        "quick": args.quick,
    }
    write("laplace_probit" + ("_quick" if args.quick else ""), config, figures)


if __name__ == "__main__":
    main()
