"""The deep-ensembles UCI recipe in plain PyTorch: the cross-check of ``benchmarks/uci.py``'s
``ensemble_paper`` row, and of which Adam rate reproduces the paper's Table 1.

Lakshminarayanan, Pritzel & Blundell (2017) state their UCI recipe (Sec. 2.2.1, 3.1, 3.3): M = 5
networks of one hidden layer (``n_hidden.txt``: 50 ReLU units, 100 for protein and year), each a
mean and a variance σ² = softplus(s) + 1e-6 trained by the Gaussian negative log-likelihood on
minibatches of 100 for 40 epochs with Adam at a constant rate, from Torch's default initialisation
(PyTorch's ``nn.Linear`` default is the same), inputs and targets standardised with the training
split's statistics. The text gives 0.1 as the rate of every experiment. Nothing here goes through
Pyro or this library's inference code (the splits are read by :func:`pyro_bdl.app.data.load_uci`),
so the figures tell a bug in the registry's ensemble apart from a recipe that does not reproduce.

Each split prints the test log-likelihood of the members' equal-weight mixture (what
``benchmarks/uci.py`` scores), of the Gaussian with the mixture's mean and variance (the paper's
Sec. 2.4 approximation) and the RMSE of the mixture mean, all in original units; the summary is
the mean and standard error over the splits.

Usage::

    python -m benchmarks.uci_paper_ensemble --lrs 0.1 0.01     # all four datasets, 20 splits
    python -m benchmarks.uci_paper_ensemble --dataset energy --splits 0-4 --lrs 0.1
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import mean_se, write
from benchmarks.uci import DATASETS, PUBLISHED, parse_splits
from pyro_bdl.app.data import load_uci

MEMBERS = 5
EPOCHS = 40
BATCH = 100
MIN_VARIANCE = 1e-6


def train_member(x: torch.Tensor, y: torch.Tensor, hidden: int, lr: float, seed: int) -> nn.Module:
    """One mean-and-variance network trained by the recipe on standardised ``(x, y)``."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, 2))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(EPOCHS):
        for rows in torch.randperm(len(x)).split(BATCH):
            mean, s = net(x[rows]).unbind(-1)
            variance = F.softplus(s) + MIN_VARIANCE
            loss = F.gaussian_nll_loss(mean, y[rows], variance, eps=0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


def evaluate(name: str, data_dir, split: int, lr: float) -> dict[str, float]:
    """Test LL (mixture, moment-matched Gaussian) and RMSE of the recipe's ensemble on one split,
    in original units."""
    d = load_uci(name, data_dir, split=split)
    y_mean, y_std = d.info["y_mean"], d.info["y_std"]
    means, variances = [], []
    for k in range(MEMBERS):
        net = train_member(d.x_train, d.y_train, d.info["n_hidden"], lr, seed=1000 * split + k)
        with torch.no_grad():
            mean, s = net(d.x_test).unbind(-1)
        means.append(mean * y_std + y_mean)
        variances.append((F.softplus(s) + MIN_VARIANCE) * y_std**2)
    mu, var = torch.stack(means), torch.stack(variances)  # (M, n_test)
    y = d.y_test * y_std + y_mean
    member_lp = torch.distributions.Normal(mu, var.sqrt()).log_prob(y)
    mixture = (member_lp.logsumexp(0) - math.log(MEMBERS)).mean()
    m = mu.mean(0)
    v = (var + mu**2).mean(0) - m**2
    gaussian = torch.distributions.Normal(m, v.sqrt()).log_prob(y).mean()
    rmse = (m - y).pow(2).mean().sqrt()
    return {"ll": float(mixture), "ll_gaussian": float(gaussian), "rmse": float(rmse)}


def summary(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    """Mean and standard error over splits of each figure."""
    return {key: list(mean_se([r[key] for r in rows])) for key in rows[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="data folder (default $PYRO_BDL_DATA)")
    parser.add_argument("--dataset", nargs="+", default=list(DATASETS))
    parser.add_argument("--splits", default="0-19", help="a list/range: 0,3,5 or 0-19")
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.1, 0.01])
    parser.add_argument(
        "--out", default=None, help="default benchmarks/results/uci_paper_ensemble.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parsed = parse_splits(args.splits)
    splits = list(range(parsed)) if isinstance(parsed, int) else parsed
    figures: dict[str, dict] = {}
    for name in args.dataset:
        anchor = PUBLISHED.get(name, {}).get("deep_ensemble")
        for lr in args.lrs:
            t0 = time.perf_counter()
            rows = [evaluate(name, args.data_dir, k, lr) for k in splits]
            s = summary(rows)
            figures.setdefault(name, {})[str(lr)] = {"per_split": rows, **s}
            published = (
                ""
                if anchor is None
                else (
                    f"  (published LL {anchor['ll']:.2f} ± {anchor['ll_se']:.2f}, "
                    f"RMSE {anchor['rmse']:.2f} ± {anchor['rmse_se']:.2f})"
                )
            )
            print(
                f"{name:18s} lr {lr:<6g} LL {s['ll'][0]:.3f} ± {s['ll'][1]:.3f}  Gaussian "
                f"{s['ll_gaussian'][0]:.3f} ± {s['ll_gaussian'][1]:.3f}  RMSE "
                f"{s['rmse'][0]:.3f} ± {s['rmse'][1]:.3f}{published}  "
                f"[{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
    config = {"members": MEMBERS, "epochs": EPOCHS, "batch": BATCH, "splits": splits}
    write("uci_paper_ensemble", config, figures, args.out)


if __name__ == "__main__":
    main()
