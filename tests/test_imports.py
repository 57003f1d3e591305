"""``import pyro_bdl`` loads the library only: the application (``pyro_bdl.app.compare``), ArviZ,
xarray, matplotlib and scipy load when used. Each check runs a fresh interpreter, since this
test process has usually imported them already."""

import json
import subprocess
import sys

import pytest

#: Never loaded by ``import pyro_bdl`` itself.
HEAVY = ("matplotlib", "arviz", "xarray", "scipy", "sklearn", "pandas", "pyro_bdl.app.compare")


def _loaded_after(statement: str, names=(*HEAVY, "tqdm")) -> dict[str, bool]:
    """For each module in ``names``: loaded by ``import pyro`` alone, and loaded after
    ``statement`` too (a fresh interpreter)."""
    code = (
        "import sys, json, pyro\n"
        f"names = {list(names)!r}\n"
        "before = {n: n in sys.modules for n in names}\n"
        f"{statement}\n"
        "print(json.dumps({'before': before, 'after': {n: n in sys.modules for n in names}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_pyro_bdl_loads_no_application_or_plotting():
    state = _loaded_after("import pyro_bdl")
    loaded = [n for n in HEAVY if state["after"][n]]
    assert not loaded, f"import pyro_bdl loaded {loaded}"
    # Pyro itself imports tqdm (its MCMC progress bars); pyro_bdl must add nothing beyond that.
    assert state["after"]["tqdm"] == state["before"]["tqdm"]


def test_public_names_still_resolve():
    state = _loaded_after(
        "import pyro_bdl as bdl\n"
        "assert callable(bdl.diagnostics.ece)\n"
        "assert 'matplotlib' not in sys.modules and 'arviz' not in sys.modules\n"
        "assert callable(bdl.diagnostics.to_inference_data)\n"
        "assert callable(bdl.diagnostics.plot_reliability)\n"
        "assert callable(bdl.diagnostics.psis_khat)\n"
        "assert bdl.diagnostics.plots.plot_entropy is bdl.diagnostics.plot_entropy\n"
        "assert 'map' in bdl.app.compare.METHODS"
    )
    assert state["after"]["matplotlib"] and state["after"]["pyro_bdl.app.compare"]


def test_unknown_attribute_raises():
    import pyro_bdl

    with pytest.raises(AttributeError, match="no_such_name"):
        pyro_bdl.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_name"):
        pyro_bdl.diagnostics.no_such_name  # noqa: B018


def test_cli_help_does_not_load_plotting():
    state = _loaded_after(
        "import contextlib, io\n"
        "from pyro_bdl.app.cli import build_parser\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        build_parser().parse_args(['--help'])\n"
        "    except SystemExit:\n"
        "        pass"
    )
    assert not state["after"]["matplotlib"] and not state["after"]["arviz"]
