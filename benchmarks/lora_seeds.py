"""Several runs of :mod:`benchmarks.lora` on other seeds, summarised: each metric's mean ± SE
over the seeds, and each method's difference from MAP paired by seed.

One seed of the benchmark compares methods whose test figures differ by a few thousandths (NLL)
or hundredths (ECE), which is the size of the seed-to-seed spread of a single method: the
adapters' initialisation, the data order and the weight draws change with the seed, while the
splits do not (``load_sst2`` takes its own fixed seed). A method meets a "better than MAP"
target here when its mean paired difference is below zero.

Files of one seed may come from several invocations (``--methods`` subsets over the same
splits); their MAP rows must agree, since MAP is deterministic given the seed, and a method
found in two files of one seed is refused.

Usage::

    python -m benchmarks.lora_seeds run-seed0-*.json run-seed1.json run-seed2.json run-seed3.json \\
        --out lora-cpu-val1000-4-seeds
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import mean_se, write

METRICS = ("accuracy", "nll", "ece", "brier", "auroc_shift_shuffled", "auroc_shift_docs")
#: The order of the rows (the benchmark's own); any other method follows.
ORDER = (
    "map", "map_temperature", "laplace_last_layer", "laplace_diag", "laplace_kron", "ivon",
    "meanfield", "swag", "ensemble", "multiswag",
)  # fmt: skip


def by_seed(docs: Sequence[dict]) -> dict[int, dict[str, dict]]:
    """``{seed: {method: its figures}}`` from benchmark documents, merging one seed's files."""
    seeds: dict[int, dict[str, dict]] = {}
    for doc in docs:
        seed = int(doc["config"]["seed"])
        methods = seeds.setdefault(seed, {})
        for name, row in doc["figures"]["methods"].items():
            if name == "map" and "map" in methods:
                if any(methods["map"][k] != row[k] for k in METRICS):
                    raise ValueError(
                        f"seed {seed}: two files disagree on MAP's test figures; they are not "
                        "runs over the same splits and seed."
                    )
                continue
            if name in methods:
                raise ValueError(f"seed {seed}: method {name!r} appears in two files.")
            methods[name] = row
    return seeds


def summarise(docs: Sequence[dict]) -> dict:
    """Per method and metric: the seeds' values, their mean ± SE, and the mean ± SE of the
    difference from MAP over the seeds where both ran."""
    seeds = by_seed(docs)
    found = {m for methods in seeds.values() for m in methods}
    names = [m for m in ORDER if m in found] + sorted(found - set(ORDER))
    out: dict[str, dict] = {}
    for name in names:
        rows = {s: ms[name] for s, ms in sorted(seeds.items()) if name in ms}
        entry: dict = {"seeds": list(rows)}
        for metric in METRICS:
            values = [float(r[metric]) for r in rows.values()]
            mean, se = mean_se(values)
            diffs = [
                float(r[metric]) - float(seeds[s]["map"][metric])
                for s, r in rows.items()
                if "map" in seeds[s]
            ]
            entry[metric] = {"values": values, "mean": mean, "se": se}
            if name != "map" and diffs:
                d_mean, d_se = mean_se(diffs)
                entry[metric]["minus_map"] = {"values": diffs, "mean": d_mean, "se": d_se}
        out[name] = entry
    return out


def _cell(value: dict | None, digits: int = 4) -> str:
    """``mean ± SE`` (the mean alone for one seed), or nothing."""
    if value is None:
        return ""
    if math.isnan(value["se"]):
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ± {value['se']:.{digits}f}"


def table(summary: dict) -> str:
    """A Markdown table: mean ± SE of each metric, and NLL and ECE minus MAP's."""
    head = "| method | seeds | accuracy | NLL | ECE | Brier | NLL − MAP | ECE − MAP |"
    lines = [head, "|" + "---|" * 8]
    for name, e in summary.items():
        cells = [_cell(e["accuracy"], 3), _cell(e["nll"]), _cell(e["ece"]), _cell(e["brier"])]
        cells += [_cell(e["nll"].get("minus_map")), _cell(e["ece"].get("minus_map"))]
        lines.append(f"| {name} | {len(e['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="benchmarks.lora JSON files")
    parser.add_argument("--out", default=None, help="NAME for benchmarks/results/NAME.json")
    args = parser.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in args.files]
    summary = summarise(docs)
    print(table(summary))
    if args.out:
        config = {
            "files": [Path(f).name for f in args.files],
            "runs": [doc["config"] for doc in docs],
            "machines": [doc["machine"] for doc in docs],
        }
        write(args.out, config, summary)
    return summary


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
