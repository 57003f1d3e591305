"""Accuracy, NLL, Brier score and ECE over a test set sharded across ranks.

Run on two processes (``gloo`` on CPUs, ``nccl`` with CUDA)::

    torchrun --standalone --nproc_per_node 2 examples/ddp_eval.py --epochs 5

The script trains the mean-field MLP of ``ddp_svi.py`` data-parallel, then every rank scores its
own contiguous slice of the test set (:func:`pyro_bdl.distributed.shard_range`, uneven when the
size does not divide) and :func:`pyro_bdl.distributed.sharded_metrics` adds the sums behind each
metric in one all-reduce: every rank prints nothing but gets the same figures, equal to scoring
the whole test set in one process. Every rank draws the same posterior samples (the same seed
right before the predictive), so the sharded predictive is the unsharded one, row by row.
"""

from __future__ import annotations

import os
import sys

import pyro

from pyro_bdl.distributed import is_main_process, shard_range, sharded_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared set-up
from ddp_svi import finish, parse_args, predictive_probs, train


def main(argv=None) -> None:
    args = parse_args(argv)
    data, device, model, guide, _ = train(args)
    part = shard_range(len(data.y_test))
    pyro.set_rng_seed(args.seed)  # the same posterior draws on every rank
    probs = predictive_probs(model, guide, data.x_test[part].to(device), args.num_samples)
    scores = sharded_metrics(probs, data.y_test[part].to(device))
    if is_main_process():
        print(
            f"test set of {scores['n']} examples, {part.stop - part.start} on rank 0: accuracy "
            f"{scores['accuracy']:.4f}, NLL {scores['nll']:.4f}, Brier {scores['brier']:.4f}, "
            f"ECE {scores['ece']:.4f}"
        )
    finish()


if __name__ == "__main__":
    main()
