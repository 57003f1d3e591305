"""SWAG under data-parallel SGD on scikit-learn's digits.

Run on two processes (``gloo`` on CPUs, ``nccl`` with CUDA)::

    torchrun --standalone --nproc_per_node 2 examples/ddp_swag.py --epochs 10 --swag-start 5

:class:`~pyro_bdl.distributed.DataParallelSVI` trains AutoSWAG's point estimate with momentum SGD
on every rank's shard; the gradients are averaged, so every rank holds the same weights after
every step. ``guide.collect()`` then runs on every rank, locally, with no communication: the
snapshots, and so the SWAG mean, second moment and deviations, are identical on every rank (the
collection costs what it costs in one process). Rank 0 evaluates and writes the checkpoint.
"""

from __future__ import annotations

import os
import sys

import pyro
import torch
from pyro.infer import Trace_ELBO

import pyro_bdl as bdl
from pyro_bdl.distributed import DataParallelSVI, is_main_process

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared set-up
from ddp_svi import finish, predictive_probs, prepare, run_epochs
from ddp_svi import parse_args as shared_parse_args


def swag_options(parser) -> None:
    parser.add_argument("--swag-start", type=int, default=5, help="first epoch to collect")
    parser.add_argument("--swag-rank", type=int, default=5, help="deviations kept (K)")
    parser.set_defaults(lr=1e-4)  # SGD on the N/B-scaled sum over examples


def parse_args(argv=None):
    return shared_parse_args(argv, add=swag_options)


def main(argv=None) -> None:
    args = parse_args(argv)
    data, device, x_train, y_train, model = prepare(args)
    guide = bdl.guides.AutoSWAG(model, rank=args.swag_rank)
    guide(x_train[:2], y_train[:2])
    optim = pyro.optim.SGD({"lr": args.lr, "momentum": 0.9})
    svi = DataParallelSVI(model, guide, optim, Trace_ELBO(), seed=args.seed)

    def collect(epoch: int) -> None:
        if epoch + 1 >= args.swag_start:
            guide.collect()  # local: every rank holds the same weights

    seconds = run_epochs(svi.step, x_train, y_train, args, after_epoch=collect)
    if is_main_process():
        probs = predictive_probs(model, guide, data.x_test.to(device), args.num_samples)
        accuracy = (probs.argmax(-1).cpu() == data.y_test).double().mean().item()
        print(
            f"{guide.num_collected} SWAG snapshots; test accuracy {accuracy:.4f}; "
            f"{seconds:.3f} s per epoch"
        )
        if args.checkpoint:
            torch.save(guide.state_dict(), f"{args.checkpoint}.tmp")
            os.replace(f"{args.checkpoint}.tmp", args.checkpoint)
            print(f"rank 0 wrote {args.checkpoint}")
    finish()


if __name__ == "__main__":
    main()
