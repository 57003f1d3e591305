"""``make bench``: run every benchmark in turn; each prints its figures and writes JSON."""

from __future__ import annotations

import importlib
import sys

#: Module names under benchmarks/, in the order they run. Each has a ``main()``.
BENCHMARKS: list[str] = [
    "kl_samples",
    "swag",
    "svi_step",
    "radial_gradient_variance",
    "laplace",
    "laplace_quality",
    "vogn_step",
    "uci",  # needs $PYRO_BDL_DATA (or ../shared/data); skips with a message without it
]


def main() -> int:
    names = sys.argv[1:] or BENCHMARKS
    for name in names:
        print(f"== benchmarks.{name}", flush=True)
        importlib.import_module(f"benchmarks.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
