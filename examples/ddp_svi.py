"""Data-parallel mean-field VI of a lifted MLP on scikit-learn's digits.

Run on two processes (backend ``nccl`` when CUDA is present, ``gloo`` on CPUs)::

    torchrun --nproc_per_node=2 examples/ddp_svi.py --epochs 20

or on one process, without a process group, as ``python examples/ddp_svi.py``. Every rank trains
on its own shard of each epoch (:func:`pyro_bdl.distributed.shard_indices`) with its own weight
noise; gradients are averaged over ranks, so every rank holds the same posterior. Rank 0 prints
the progress, evaluates on the test split and writes the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time

import pyro
import torch
import torch.distributed as dist
from pyro.infer import TraceMeanField_ELBO
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.app.compare.problem import predictive_probs
from pyro_bdl.distributed import DataParallelSVI, get_world_size, is_main_process, shard_indices


def parse_args(argv=None, add=None) -> argparse.Namespace:
    """The options every example shares; ``add(parser)`` adds a method's own."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per rank and step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--init-scale", type=float, default=1e-2)
    parser.add_argument("--num-samples", type=int, default=32, help="posterior draws for testing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="", help="file for rank 0's checkpoint")
    if add is not None:
        add(parser)
    return parser.parse_args(argv)


def setup_distributed() -> torch.device:
    """Join the process group that ``torchrun`` describes in the environment, if any."""
    if "RANK" not in os.environ:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def save_on_main(path: str) -> None:
    """Rank 0 writes the parameters atomically (a temporary file, then a rename)."""
    if not path or not is_main_process():
        return
    state = {name: p.detach().cpu() for name, p in pyro.get_param_store().named_parameters()}
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    print(f"rank 0 wrote {path}")


def build(args, device: torch.device, n: int):
    """The lifted digits MLP and its classifier model (the same on every rank: same seed)."""
    pyro.set_rng_seed(args.seed)
    net = nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    bnn = bdl.bayesianize(net, prior=bdl.priors.Normal(scale=1.0))
    return bdl.models.classifier(bnn, dataset_size=n)


def run_epochs(step, x_train, y_train, args, *, after_epoch=None) -> float:
    """Every rank steps through its shard of each epoch; rank 0 prints; seconds per epoch."""
    n = len(y_train)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        idx = shard_indices(n, epoch=epoch, seed=args.seed).to(x_train.device)
        total = 0.0
        for batch in idx.split(args.batch_size):
            total += step(x_train[batch], y_train[batch])
        if after_epoch is not None:
            after_epoch(epoch)
        if is_main_process():
            steps = -(-len(idx) // args.batch_size)
            print(f"epoch {epoch + 1:3d}  mean loss per step {total / steps:10.2f}")
    return (time.perf_counter() - start) / max(args.epochs, 1)


def finish() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def prepare(args):
    """Join the process group; the digits data, the device and the model (the same on every
    rank: the same seed builds the same network)."""
    device = setup_distributed()
    data = bdl.app.data.load_digits(seed=args.seed)
    x_train, y_train = data.x_train.to(device), data.y_train.to(device)
    return data, device, x_train, y_train, build(args, device, len(y_train))


def train(args):
    """Data-parallel mean-field VI; returns what evaluation needs."""
    # DataParallelSVI broadcasts rank 0's parameters anyway and re-seeds each rank's weight
    # noise with seed + rank.
    data, device, x_train, y_train, model = prepare(args)
    guide = bdl.guides.AutoMeanField(model, init_scale=args.init_scale)
    guide(x_train[:2], y_train[:2])  # the guide creates its parameters before the wrapper
    svi = DataParallelSVI(
        model, guide, pyro.optim.Adam({"lr": args.lr}), TraceMeanField_ELBO(), seed=args.seed
    )
    if is_main_process():
        print(
            f"{get_world_size()} rank(s) on {device}; {len(y_train)} training examples; "
            f"{args.batch_size} per rank"
        )
    seconds = run_epochs(svi.step, x_train, y_train, args)
    return data, device, model, guide, seconds


def main(argv=None) -> None:
    args = parse_args(argv)
    data, device, model, guide, seconds = train(args)
    if is_main_process():
        probs = predictive_probs(model, guide, data.x_test.to(device), args.num_samples)
        accuracy = (probs.argmax(-1).cpu() == data.y_test).double().mean().item()
        print(f"test accuracy {accuracy:.4f}; {seconds:.3f} s per epoch")
    save_on_main(args.checkpoint)
    finish()


if __name__ == "__main__":
    main()
