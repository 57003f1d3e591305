"""IVON across ranks on scikit-learn's digits: ĝ and ĥ averaged by ``reduce_fn``.

Run on two processes (``gloo`` on CPUs, ``nccl`` with CUDA)::

    torchrun --standalone --nproc_per_node 2 examples/ddp_ivon.py --epochs 5

Each rank draws its own weights θ ~ q (independent noise: R weight samples per step), forms the
minibatch gradient ĝ at θ and IVON's reparameterization Hessian estimate ĥ = ĝ·(θ − m)/σ² on its
own shard; ``reduce_fn=allreduce_mean()`` averages both in one all-reduce per step, so every rank
applies the same update (docs/design/ivon.md, docs/design/distributed.md). Unlike VOGN no
per-example gradients are formed, so a step costs about one Adam step plus the all-reduce.
:class:`~pyro_bdl.distributed.StepAgreement` makes a batch refused on one rank raise on every
rank.
"""

from __future__ import annotations

import os
import sys

import pyro

import pyro_bdl as bdl
from pyro_bdl.distributed import StepAgreement, allreduce_mean, get_rank, is_main_process

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared set-up
from ddp_svi import finish, predictive_probs, prepare, run_epochs
from ddp_svi import parse_args as shared_parse_args


def ivon_options(parser) -> None:
    parser.set_defaults(lr=0.2)  # IVON's rates are far larger than Adam's (docs/design/ivon.md)


def parse_args(argv=None):
    return shared_parse_args(argv, add=ivon_options)


def main(argv=None) -> None:
    args = parse_args(argv)
    data, device, x_train, y_train, model = prepare(args)
    agreement = StepAgreement(modules=[model.net])
    ivon = bdl.infer.IVON(
        model,
        dataset_size=len(y_train),
        lr=args.lr,
        reduce_fn=agreement.wrap(allreduce_mean()),
    )
    pyro.set_rng_seed(args.seed + get_rank())  # independent weight noise per rank

    def step(x, y) -> float:
        with agreement.step():
            return ivon.step(x, y)

    seconds = run_epochs(step, x_train, y_train, args)
    if is_main_process():
        probs = predictive_probs(model, ivon.guide, data.x_test.to(device), args.num_samples)
        accuracy = (probs.argmax(-1).cpu() == data.y_test).double().mean().item()
        print(f"test accuracy {accuracy:.4f}; {seconds:.3f} s per epoch")
    finish()


if __name__ == "__main__":
    main()
