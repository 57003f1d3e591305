"""The tutorials in tutorials/ are stored executed, and each still runs top to bottom.

(a) Every committed notebook has the outputs of every code cell, no error output, and a PNG
    figure in every cell whose plotting calls promise one, so a reader on a code host sees the
    numbers and the plots.
(b) Every notebook runs end to end in smoke mode (``PYRO_BDL_SMOKE=1``: tiny sizes), in a fresh
    kernel that imports this checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The docs extra brings it; a machine without it (the GPU image) skips these tests at collection.
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("*.ipynb"))
#: The calls that put a figure into a cell's outputs.
FIGURE_CALLS = ("plt.show()", "display(D.plot_", "display(Image(")


def _code_cells(path: Path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_there_are_tutorials():
    assert len(TUTORIALS) >= 9, f"tutorials/ holds {len(TUTORIALS)} notebooks, expected 9"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_is_stored_executed(path):
    cells = _code_cells(path)
    missing = [i for i, c in enumerate(cells) if not c.get("outputs")]
    assert not missing, (
        f"{path.name}: code cells {missing} have no outputs; execute the notebook and save it "
        "with its outputs (see the README's Documentation section)."
    )
    errors = [i for i, c in enumerate(cells) for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: code cells {errors} are stored with an error output"
    for i, cell in enumerate(cells):
        promised = sum(cell.source.count(call) for call in FIGURE_CALLS)
        images = sum("image/png" in o.get("data", {}) for o in cell.outputs)
        assert images >= min(promised, 1), (
            f"{path.name}: code cell {i} draws a figure but stores no PNG output"
        )


def test_the_stored_check_sees_a_missing_output(tmp_path):
    # Guard for the check above: a notebook stripped of its outputs must fail it.
    nb = nbformat.read(TUTORIALS[0], as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    stripped = tmp_path / "stripped.ipynb"
    nbformat.write(nb, stripped)
    with pytest.raises(AssertionError, match="have no outputs"):
        test_tutorial_is_stored_executed(stripped)


@pytest.mark.tutorial
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_in_smoke_mode(path, monkeypatch, tmp_path):
    from nbclient import NotebookClient

    monkeypatch.setenv("PYRO_BDL_SMOKE", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend embeds PNGs
    # The kernel is a new process: it must import this checkout, wherever pytest runs from.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    promised = sum(c.source.count(call) for c in nb.cells for call in FIGURE_CALLS)
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images >= min(promised, 1), f"{path.name} drew no figure in smoke mode"
