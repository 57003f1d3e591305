"""``make bench``: run every benchmark in turn; each prints its figures and writes JSON."""

from __future__ import annotations

import importlib
import sys

#: Module names under benchmarks/, in the order they run. Each has a ``main()``.
BENCHMARKS: list[str] = [
    "kl_samples",
    "swag",
    "svi_step",
    "vectorized",
    "radial_gradient_variance",
    "laplace",
    "laplace_probit",
    "laplace_quality",
    "laplace_structures",  # the laplace-torch rows need the optional `bench` extra
    "vogn_step",
    "ivon_step",
    "resnet",
    "host_overhead",
    "ddp",  # spawns two gloo processes
    "tuned_vogn_adam",
    "rotated_mnist",  # needs $PYRO_BDL_DATA (or ../shared/data) for MNIST
    "mnist_table",  # likewise; every method, 3 seeds (`--jobs N` for a process pool)
    "uci",  # needs $PYRO_BDL_DATA (or ../shared/data); skips with a message without it
    "uci_paper_ensemble",  # likewise: the deep-ensembles recipe in plain PyTorch, 2 rates
    "lora",  # needs the hf extra and $PYRO_BDL_DATA/sst2; skips with a message without them
]
#: Modules under benchmarks/ that are not benchmarks to run: shared code, this runner, two
#: reports that join the JSON files of earlier runs (`uci`, `lora` on several seeds; they take
#: their paths), and the two runs made for a GPU machine (`make gpu-check`, `make gpu-quality`;
#: docs/gpu.md).
NOT_RUN: frozenset[str] = frozenset(
    {"common", "run_all", "uci_before_after", "lora_seeds", "gpu_check", "gpu_quality"}
)


def main() -> int:
    names = sys.argv[1:] or BENCHMARKS
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}", file=sys.stderr)
        return 2
    for name in names:
        print(f"== benchmarks.{name}", flush=True)
        # Each benchmark parses sys.argv: give it its defaults, not this runner's arguments.
        sys.argv = [f"benchmarks.{name}"]
        try:
            importlib.import_module(f"benchmarks.{name}").main()
        except FileNotFoundError as err:  # a real-data benchmark without $PYRO_BDL_DATA
            print(f"skipped benchmarks.{name}: {err}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
