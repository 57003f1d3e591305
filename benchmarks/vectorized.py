"""S = 32 posterior draws of the digits MLP and the small CNN: one vectorized pass vs the loop.

For each network (``compare``'s ``mlp`` and ``cnn`` on 8×8 digits, BatchNorm in eval mode) with
a mean-field guide it times, on the digits test set (360 images), under ``torch.no_grad``:

- ``predict_loop``: ``sample_outputs(..., parallel=False)`` (one guide call and one forward
  per draw);
- ``predict_vec``: ``sample_outputs(..., parallel=True)`` (one guide call under a plate, one
  vmapped forward);
- ``predict_vec8``: the same with ``max_parallel=8`` (four vmapped passes of 8 draws);

and, with gradients, the loss and backward of ``Trace_ELBO(num_particles=32)`` on a batch of 64
with ``vectorize_particles`` False and True (``elbo_loop``, ``elbo_vec``). Figures are the
ratios vec/loop of median process times (and of wall times), at 1 and 2 threads. It also
records, per network, the FLOPs and bytes of one pass of S draws, from which the GPU behaviour
is argued on paper.

Usage::

    python -m benchmarks.vectorized [--quick]
"""

from __future__ import annotations

import argparse

import pyro
import torch
from pyro.infer import Trace_ELBO

from benchmarks.common import cpu_times, write
from pyro_bdl import bayesianize, models
from pyro_bdl.app import data
from pyro_bdl.app.compare.problem import cnn, mlp
from pyro_bdl.guides import AutoMeanField
from pyro_bdl.predictive import sample_outputs

S = 32


def _setup(kind: str, x_train, y_train):
    torch.manual_seed(0)
    pyro.clear_param_store()
    build = {"mlp": mlp, "cnn": cnn}[kind]
    net = bayesianize(build((1, 8, 8), 10))
    model = models.classifier(net, dataset_size=len(y_train))
    guide = AutoMeanField(model)
    guide(x_train[:64], y_train[:64])
    net.eval()
    return net, model, guide


def _paper(kind: str, net, batch: int) -> dict:
    """FLOPs (multiply-adds × 2) and bytes of weights for S draws of one pass over ``batch``."""
    flops = 0
    hooks = []

    def count(module, inputs, output):
        nonlocal flops
        if isinstance(module, torch.nn.Linear):
            flops += 2 * output.numel() * module.in_features
        elif isinstance(module, torch.nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels
            flops += 2 * output.numel() * k

    for m in net.modules():
        hooks.append(m.register_forward_hook(count))
    with torch.no_grad():
        net(torch.zeros(batch, 1, 8, 8))
    for h in hooks:
        h.remove()
    weights = sum(spec.shape.numel() for spec in net._bdl_sites.values())
    kernels = sum(1 for m in net.modules() if not list(m.children()))
    return {
        "flops_S_draws": S * flops,
        "weight_bytes_S_draws": 4 * S * weights,
        "leaf_modules": kernels,
        "note": (
            "At these sizes one draw is ~1e6-1e8 FLOPs, microseconds on an H100 (~1e15 FLOP/s "
            "dense fp32-TF32): the loop costs S x (guide sampling + one kernel per layer) launches "
            "plus S Pyro traces of Python overhead (milliseconds on the CPU host), the vectorized "
            "pass one set of launches, so on a GPU the ratio is bounded by launch and Python "
            "overhead, not by arithmetic. Not measured."
        ),
    }


def run(quick: bool) -> dict:
    digits = data.load_digits()
    x_test = digits.x_test
    xb, yb = digits.x_train[:64], digits.y_train[:64]
    repeats = 3 if quick else 9
    figures: dict = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for kind in ("mlp", "cnn"):
            net, model, guide = _setup(kind, digits.x_train, digits.y_train)

            def predict(parallel: bool, chunk=None, model=model, guide=guide):
                return sample_outputs(
                    model, guide, x_test, num_samples=S, parallel=parallel, max_parallel=chunk
                )

            def elbo(vectorize: bool, model=model, guide=guide):
                loss = Trace_ELBO(
                    num_particles=S, vectorize_particles=vectorize, max_plate_nesting=1
                ).differentiable_loss(model, guide, xb, yb)
                loss.backward()

            t = {
                "predict_loop": cpu_times(lambda: predict(False), warmup=1, repeats=repeats),
                "predict_vec": cpu_times(lambda: predict(True), warmup=1, repeats=repeats),
                "predict_vec8": cpu_times(lambda: predict(True, 8), warmup=1, repeats=repeats),
                "elbo_loop": cpu_times(lambda: elbo(False), warmup=1, repeats=repeats),
                "elbo_vec": cpu_times(lambda: elbo(True), warmup=1, repeats=repeats),
            }
            entry = {k: v["median"] for k, v in t.items()}
            # Process time counts the OpenMP workers' spin-waits with 2 threads; wall time is
            # recorded beside it (on a shared machine it counts other processes instead).
            entry.update({f"{k}_wall": v["wall_median"] for k, v in t.items()})
            entry["predict_ratio"] = entry["predict_vec"] / entry["predict_loop"]
            entry["predict8_ratio"] = entry["predict_vec8"] / entry["predict_loop"]
            entry["elbo_ratio"] = entry["elbo_vec"] / entry["elbo_loop"]
            figures[f"{kind}_threads{threads}"] = entry
            entry["predict_ratio_wall"] = entry["predict_vec_wall"] / entry["predict_loop_wall"]
            entry["elbo_ratio_wall"] = entry["elbo_vec_wall"] / entry["elbo_loop_wall"]
            print(kind, threads, {k: round(v, 4) for k, v in entry.items()})
            if threads == 1:
                figures[f"{kind}_paper"] = _paper(kind, net, len(x_test))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    figures = run(args.quick)
    write("vectorized", {"S": S, "test_batch": 360, "elbo_batch": 64}, figures)


if __name__ == "__main__":
    main()
