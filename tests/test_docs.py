"""The repository's references to design documents point inside the repository.

(a) Every ``docs/design/<name>.md`` mentioned in the code, tests, benchmarks or examples exists.
(b) Nothing there cites the internal reference documents that are not part of the repository
    (their names are built from pieces below, so this file does not cite them either).
(c) The relative links of the design notes, the other documentation pages and README.md resolve.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN_DIR = ROOT / "docs" / "design"
#: The folders whose files must cite only what the repository holds (docs/ through :func:`_pages`).
SCANNED = ("pyro_bdl", "tests", "benchmarks", "examples")
#: Folders under docs/ that are generated, not written: the build and the copied notebooks.
GENERATED = {"_build", "tutorials"}
SUFFIXES = {".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ipynb"}

#: The internal documents: "<STEM>.md", assembled here so that no literal name appears.
FORBIDDEN_STEMS = ("DES" + "IGN", "RELI" + "ABILITY", "BENCH" + "MARKS", "ST" + "YLE")
_NAMES = "|".join(FORBIDDEN_STEMS)
#: "<STEM>.md" anywhere, and a bare section reference to the first one ("<STEM> 4.5"), which cites
#: it just the same.
FORBIDDEN = re.compile(rf"\b(?:{_NAMES})\.md\b|\b{FORBIDDEN_STEMS[0]}\s+\d")
DESIGN_REF = re.compile(r"docs/design/([A-Za-z0-9_\-]+\.md)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages() -> list[Path]:
    """README.md and every hand-written Markdown page under docs/."""
    docs = ROOT / "docs"
    pages = [
        p for p in sorted(docs.rglob("*.md")) if not GENERATED & set(p.relative_to(docs).parts)
    ]
    return [ROOT / "README.md", *pages]


def _files() -> list[Path]:
    found = _pages()
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                found.append(path)
    return found


def _lines():
    for path in _files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            yield path.relative_to(ROOT), number, line


def test_the_scan_sees_the_code():
    # Guard against a scan that silently finds nothing (a moved root, a renamed folder).
    names = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "pyro_bdl/layout.py" in names and "tests/test_docs.py" in names


def test_cited_design_notes_exist():
    missing = [
        f"{path}:{number}: docs/design/{name}"
        for path, number, line in _lines()
        for name in DESIGN_REF.findall(line)
        if not (DESIGN_DIR / name).is_file()
    ]
    assert not missing, "design notes cited but not in docs/design/:\n" + "\n".join(missing)


def test_no_citation_of_documents_outside_the_repository():
    offending = [
        f"{path}:{number}: {line.strip()}"
        for path, number, line in _lines()
        if FORBIDDEN.search(line)
    ]
    assert not offending, (
        "these lines cite documents that are not in the repository; cite the paper and/or "
        "docs/design/<note>.md instead:\n" + "\n".join(offending)
    )


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in _pages()])
def test_page_links_resolve(page):
    path = ROOT / page
    broken = [
        target
        for target in LINK.findall(path.read_text(encoding="utf-8"))
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not broken, f"{page} links to missing files: {broken}"


def test_the_pages_include_the_design_notes():
    # Guard against a page scan that silently misses a folder.
    pages = {p.relative_to(ROOT).as_posix() for p in _pages()}
    assert {"README.md", "docs/design/vogn.md", "docs/methods/laplace.md"} <= pages


def test_the_forbidden_pattern_matches_what_it_should():
    stem = FORBIDDEN_STEMS[0]
    assert FORBIDDEN.search(f"the update of {stem}.md 4.5")
    assert FORBIDDEN.search(f"weights the new curvature ({stem} 4.5)")
    assert FORBIDDEN.search(f"targets ({FORBIDDEN_STEMS[2]}.md)")
    assert not FORBIDDEN.search("the update of docs/design/vogn.md")
    assert not FORBIDDEN.search(f"{stem.lower()} choices")
