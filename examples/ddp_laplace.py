"""Data-parallel Laplace fit of a lifted MLP on scikit-learn's digits.

Run on two CPU processes::

    torchrun --nproc_per_node 2 examples/ddp_laplace.py

or on one, as ``python examples/ddp_laplace.py``. Every rank trains the same MAP (same seed, same
full-batch steps), then fits the Laplace posterior on its own shard of the training set: the
Kronecker factors (or the GGN, or its diagonal) and the data statistics are summed over ranks by
``reduce_fn``, one all-reduce per block, so every rank holds the posterior of the whole training
set. The prior precision is then tuned on the marginal likelihood; rank 0 reports the test
accuracy and NLL of the MAP and of the probit predictive.
"""

from __future__ import annotations

import argparse
import os

import pyro
import torch
import torch.distributed as dist
from pyro.infer import SVI, Trace_ELBO
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.distributed import get_rank, get_world_size, is_main_process


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="full-batch MAP steps")
    parser.add_argument("--structure", default="kron", choices=("full", "kron", "diag"))
    parser.add_argument("--hidden", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    pyro.set_rng_seed(args.seed)
    data = bdl.app.data.load_digits(seed=args.seed)
    x, y = data.x_train.double(), data.y_train
    net = nn.Sequential(
        nn.Flatten(), nn.Linear(64, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10)
    ).double()
    model = bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(1.0)), len(y))
    guide = bdl.guides.AutoLaplace(model, hessian_structure=args.structure)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for _ in range(args.steps):  # identical on every rank: same seed, same full batch
        svi.step(x, y)
    rank, world = get_rank(), get_world_size()
    guide.fit((x[rank::world], y[rank::world]), reduce_fn=bdl.distributed.allreduce_sum())
    lam = guide.tune_prior_precision()
    if is_main_process():
        x_test, y_test = data.x_test.double(), data.y_test
        with torch.no_grad():
            logits = pyro.poutine.condition(model, data=guide.median())(x_test)
        probs = guide.predict(x_test)
        for name, p in (("MAP", logits.softmax(-1)), (f"Laplace ({args.structure})", probs)):
            nll = -p[torch.arange(len(y_test)), y_test].clamp_min(1e-12).log().mean()
            accuracy = (p.argmax(-1) == y_test).double().mean()
            print(f"{name:16s} test accuracy {accuracy:.4f}  NLL {nll:.4f}")
        evidence = guide.marginal_likelihood()
        print(f"{world} rank(s); prior precision {lam:.4g}; log evidence {evidence:.2f}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
