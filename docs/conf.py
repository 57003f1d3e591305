"""Sphinx configuration: the API reference (autodoc + napoleon), the design notes (MyST) and the
tutorials (stored executed; myst-nb renders their outputs and never runs them)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout, not an installed copy
os.environ.setdefault("MPLBACKEND", "Agg")

project = "pyro_bdl"
author = "pyro_bdl developers"
copyright = "2026, pyro_bdl developers"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# The notebooks are committed with their outputs (tests/test_tutorials.py checks it); building the
# docs never executes them, so `make docs` takes seconds and needs no data.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "pyro_bdl"
html_static_path: list[str] = []

# The tutorials live in tutorials/ at the repository root, where a reader opens them; Sphinx reads
# only its source folder, so a fresh copy goes to docs/tutorials (ignored by git) on every build.
_TUTORIALS = Path(__file__).parent / "tutorials"
shutil.rmtree(_TUTORIALS, ignore_errors=True)
_TUTORIALS.mkdir()
for _notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
    shutil.copy2(_notebook, _TUTORIALS / _notebook.name)
