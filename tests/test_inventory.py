"""Lists that must name every file they cover: the benchmark runner and the documentation
site's table of contents (a new benchmark, design note or documentation page is otherwise
silently left out)."""

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


def _toctree_entries() -> set[str]:
    index = (ROOT / "docs" / "index.md").read_text()
    blocks = re.findall(r"^```\{toctree\}\n(.*?)^```", index, flags=re.M | re.S)
    return {
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.startswith(":")
    }


def test_the_docs_site_includes_every_page():
    # Every hand-written page: the method pages, the benchmarks and the command page (the
    # design notes are checked above, the tutorials are copied in by docs/conf.py).
    docs = ROOT / "docs"
    pages = {p.relative_to(docs).with_suffix("").as_posix() for p in docs.glob("*.md")}
    pages |= {f"methods/{p.stem}" for p in (docs / "methods").glob("*.md")}
    pages -= {"index"}
    assert {"methods/laplace", "benchmarks"} <= pages  # the scan sees the pages
    missing = pages - _toctree_entries()
    assert not missing, f"docs/index.md lists no toctree entry for {sorted(missing)}"
