"""Before/after table of the UCI benchmark's σ rules: two result files of ``benchmarks/uci.py``
(``--sigma fixed`` and the default ``--sigma own``) on the same splits, side by side, with the
targets on the test log-likelihood checked under each rule.

Targets (mean over the splits both runs finished; "SE" is the standard error of the per-split
difference to MAP under the same rule, since every method runs on the same split):

- every Bayesian method at least MAP's LL minus 1 SE on every dataset;
- better than MAP by more than 1 SE on at least two datasets (per method);
- the best method at least the published deep-ensemble LL on at least two datasets;
- VOGN within 1 SE of MAP on every dataset.

Under the "after" rule MAP learns its own σ too, which makes it a weaker baseline; the targets are
also checked against MAP with the fixed validation σ (``after_against_fixed_sigma_map``).

Usage::

    python -m benchmarks.uci_before_after --before B.json [B2.json] --after A.json [A2.json]

(several files per rule: runs of successive splits, joined in the order given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import mean_se, write
from benchmarks.uci import PUBLISHED

RULES = ("before", "after")
LABELS = {"before": "σ fixed (validation RMSE of MAP)", "after": "each method's own σ"}


def _results(paths: list[Path]) -> dict:
    """The results of one rule: several files (runs of successive splits) joined in order."""
    out: dict = {}
    for path in paths:
        for name, figures in json.loads(Path(path).read_text())["figures"]["results"].items():
            into = out.setdefault(name, {})
            for m, f in figures.items():
                if isinstance(f, dict) and "per_split_ll" in f:
                    into.setdefault(m, {"per_split_ll": []})["per_split_ll"] += f["per_split_ll"]
    return out


def common(before: dict, after: dict) -> dict[str, int]:
    """{dataset: number of leading splits both runs finished}."""
    out = {}
    for name in before:
        if name in after:
            some = next(m for m in before[name] if not m.startswith("noise"))
            out[name] = min(
                len(before[name][some]["per_split_ll"]), len(after[name][some]["per_split_ll"])
            )
    return out


def table(before: dict, after: dict) -> dict:
    """{dataset: {method: {rule: {"ll": (mean, se), "diff_to_map": (mean, se)}}}}."""
    out: dict = {}
    for name, k in common(before, after).items():
        out[name] = {"splits": k}
        methods = [m for m in before[name] if not m.startswith("noise")]
        for m in methods:
            out[name][m] = {}
            for rule, res in zip(RULES, (before, after)):
                ll = res[name][m]["per_split_ll"][:k]
                base = res[name]["map"]["per_split_ll"][:k]
                fixed = before[name]["map"]["per_split_ll"][:k]
                out[name][m][rule] = {
                    "ll": mean_se(ll),
                    "diff_to_map": mean_se([a - b for a, b in zip(ll, base)]),
                    "diff_to_fixed_map": mean_se([a - b for a, b in zip(ll, fixed)]),
                }
    return out


def targets(rows: dict, rule: str, against: str = "diff_to_map") -> dict:
    """The four targets under ``rule`` (module docstring), against MAP under the same rule
    (``"diff_to_map"``) or MAP under the fixed rule (``"diff_to_fixed_map"``)."""
    names = list(rows)
    methods = [m for m in rows[names[0]] if m not in ("splits", "map")]
    not_worse = {
        f"{n}/{m}": rows[n][m][rule][against][0] >= -rows[n][m][rule][against][1]
        for n in names
        for m in methods
    }
    better = {
        m: [n for n in names if rows[n][m][rule][against][0] > rows[n][m][rule][against][1]]
        for m in methods
    }
    beats_ensemble = [
        n
        for n in names
        if "deep_ensemble" in PUBLISHED.get(n, {})
        and max(rows[n][m][rule]["ll"][0] for m in [*methods, "map"])
        >= PUBLISHED[n]["deep_ensemble"]["ll"]
    ]
    vogn = {n: not_worse[f"{n}/vogn"] for n in names if f"{n}/vogn" in not_worse}
    return {
        "every_method_within_1se_of_map_everywhere": all(not_worse.values()),
        "within_1se_of_map": not_worse,
        "better_than_map_by_1se": better,
        "methods_better_on_2_or_more": [m for m, v in better.items() if len(v) >= 2],
        "best_method_at_least_deep_ensemble": beats_ensemble,
        "deep_ensemble_target_met": len(beats_ensemble) >= 2,
        "vogn_within_1se_of_map": vogn,
        "vogn_target_met": bool(vogn) and all(vogn.values()),
    }


def markdown(rows: dict) -> str:
    """One row per method, one column per dataset: LL before → after (mean ± SE)."""
    names = list(rows)
    lines = [
        "| test LL (before → after) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    methods = [m for m in rows[names[0]] if m != "splits"]
    for m in methods:
        cells = []
        for n in names:
            (b, bse), (a, ase) = rows[n][m]["before"]["ll"], rows[n][m]["after"]["ll"]
            cells.append(f"{b:.2f} ± {bse:.2f} → {a:.2f} ± {ase:.2f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, nargs="+", required=True, help="--sigma fixed")
    parser.add_argument("--after", type=Path, nargs="+", required=True, help="--sigma own")
    parser.add_argument("--name", default="uci_sigma_before_after", help="results file stem")
    args = parser.parse_args([] if argv is None else argv)
    before, after = _results(args.before), _results(args.after)
    rows = table(before, after)
    verdict = {rule: targets(rows, rule) for rule in RULES}
    # MAP under its own σ is a weaker baseline than under the validation σ: check against both.
    verdict["after_against_fixed_sigma_map"] = targets(rows, "after", "diff_to_fixed_map")
    print(markdown(rows))
    for rule, v in verdict.items():
        print(f"{LABELS.get(rule, rule)}: {json.dumps(v)}")
    config = {
        "rules": LABELS,
        "splits": {n: r["splits"] for n, r in rows.items()},
        "sources": {"before": list(map(str, args.before)), "after": list(map(str, args.after))},
        "se": "standard error over splits; for targets, of the per-split difference to MAP",
    }
    write(args.name, config, {"table": rows, "targets": verdict, "markdown": markdown(rows)})


if __name__ == "__main__":
    main(sys.argv[1:])
