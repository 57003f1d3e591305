"""Lists that must name every file they cover: the benchmark runner and the documentation
site's table of contents (a new benchmark or design note is otherwise silently left out)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_bench_runs_every_benchmark():
    from benchmarks import run_all

    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    assert modules - run_all.NOT_RUN == set(run_all.BENCHMARKS)
    assert len(run_all.BENCHMARKS) == len(set(run_all.BENCHMARKS))
    for name in run_all.BENCHMARKS:
        assert callable(importlib.import_module(f"benchmarks.{name}").main), name


def test_the_docs_site_includes_every_design_note():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(re.findall(r"^design/(\w+)$", index, flags=re.M))
    notes = {p.stem for p in (ROOT / "docs" / "design").glob("*.md")}
    assert listed == notes
