"""VOGN's cost (BENCHMARKS.md): squared per-example gradients and one VOGN step, as ratios.

Figures, each measured side by side in one process on the same network and batch:

- ``sqgrad/fwd_bwd``: :class:`~pyro_bdl.curvature.PerExampleGradients` (forward with hooks,
  backward, Σg and Σg²) over a plain forward + ``loss.backward()``; ``vmap/fwd_bwd`` the same for
  the ``torch.func.vmap(grad)`` oracle, for reference.
- ``vogn/adam``: one :meth:`VOGN.step` (one MC sample, through the Pyro model of a lifted
  network) over one deterministic Adam step on the plain network; ``svi_autonormal/adam``: plain
  Pyro ``SVI`` + ``AutoNormal`` + ``Trace_ELBO`` on the same lifted network, for comparison.

CPU: MLP and small CNN on MNIST-size inputs, B ∈ {32, 128}, one thread, process time. GPU (when
CUDA is present): ResNet-18 on CIFAR-size inputs, B = 128, CUDA events.

Usage::

    python -m benchmarks.vogn_step            # CPU figures (about two minutes)
    python -m benchmarks.vogn_step --quick    # fewer repeats
"""

from __future__ import annotations

import argparse

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from benchmarks.common import cpu_times, gpu_times, write
from pyro_bdl import bayesianize, models, priors
from pyro_bdl.compare.problem import cnn, mlp
from pyro_bdl.curvature import PerExampleGradients, substitute, vmap_squared_gradients
from pyro_bdl.infer import VOGN
from pyro_bdl.nn import init_to_network

N = 60_000  # dataset size for the plate's N/B scaling (MNIST-like)


def networks(device: str):
    if device == "cpu":
        shape = (1, 28, 28)
        return {"mlp": (lambda: mlp(shape, 10), shape), "cnn": (lambda: cnn(shape, 10), shape)}
    import torchvision

    return {"resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (3, 32, 32))}


def measure(build, shape, batch: int, device: str, repeats: int, with_vmap: bool) -> dict:
    timer = cpu_times if device == "cpu" else gpu_times
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    torch.manual_seed(0)
    net = build().to(device)

    def plain():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y, reduction="sum").backward()

    def hooks():
        with PerExampleGradients(net) as tape:
            losses = F.cross_entropy(net(x), y, reduction="none")
        tape.squared_gradients(losses)

    adam = torch.optim.Adam(net.parameters(), lr=1e-3)

    def adam_step():
        adam.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        adam.step()

    out: dict = {}
    t_plain = timer(plain, repeats=repeats)
    t_hooks = timer(hooks, repeats=repeats)
    out["sqgrad/fwd_bwd"] = t_hooks["median"] / t_plain["median"]
    if t_plain["wall_median"]:
        out["sqgrad/fwd_bwd (wall)"] = t_hooks["wall_median"] / t_plain["wall_median"]
    if with_vmap:
        net.eval()  # vmap over single examples needs per-example BatchNorm (running statistics)
        params = {k: v.detach() for k, v in net.named_parameters()}

        def loss_fn(p, xi, yi):
            with substitute(net, p):
                return F.cross_entropy(net(xi[None]), yi[None])

        t_vmap = timer(lambda: vmap_squared_gradients(loss_fn, params, x, y), repeats=repeats)
        out["vmap/fwd_bwd"] = t_vmap["median"] / t_plain["median"]
        net.train()
    t_adam = timer(adam_step, repeats=repeats)

    # The same network lifted, in a Pyro model, for VOGN and plain Pyro SVI + AutoNormal.
    pyro.clear_param_store()
    torch.manual_seed(0)
    bnn = bayesianize(build().to(device), priors.Normal(scale=1.0))
    model = models.classifier(bnn, N)
    vogn = VOGN(model, dataset_size=N, lr=1e-3, num_particles=1)
    t_vogn = timer(lambda: vogn.step(x, y), repeats=repeats)
    guide = AutoNormal(model, init_loc_fn=init_to_network, init_scale=1e-2)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    t_svi = timer(lambda: svi.step(x, y), repeats=repeats)
    out["vogn/adam"] = t_vogn["median"] / t_adam["median"]
    out["svi_autonormal/adam"] = t_svi["median"] / t_adam["median"]
    out["vogn/svi_autonormal"] = t_vogn["median"] / t_svi["median"]
    if t_adam["wall_median"]:
        out["vogn/adam (wall)"] = t_vogn["wall_median"] / t_adam["wall_median"]
    out["seconds"] = {
        "fwd_bwd": t_plain["median"],
        "sqgrad": t_hooks["median"],
        "adam": t_adam["median"],
        "vogn": t_vogn["median"],
        "svi_autonormal": t_svi["median"],
    }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv if argv is not None else [])
    repeats = 5 if args.quick else 15
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    figures: dict = {}
    for device in devices:
        batches = [32, 128] if device == "cpu" else [128]
        for name, (build, shape) in networks(device).items():
            for batch in batches:
                key = f"{device}/{name}/B={batch}"
                result = measure(build, shape, batch, device, repeats, with_vmap=device == "cpu")
                figures[key] = result
                for figure, value in result.items():
                    if figure != "seconds":
                        print(f"{key} {figure}: {value:.2f}x", flush=True)
    if "cuda" not in devices:
        figures["cuda"] = "not measured: no GPU lent"
        print("cuda: not measured: no GPU lent")
    config = {"dataset_size": N, "repeats": repeats, "threads": 1, "mc_samples": 1}
    write("vogn_step", config, figures)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
