"""What ``import pyro_bdl`` loads. The library loads nothing beyond what ``import pyro`` loads
(the standard library aside) and never the application (``pyro_bdl.app``); ``import pyro_bdl``
alone loads neither torch nor Pyro, which keeps ``pyro-bdl --help`` fast. The old paths of the
application warn and resolve to the new modules. Each check runs a fresh interpreter, since this
test process has usually imported everything already."""

import json
import subprocess
import sys

import pytest

#: The library's subpackages and modules, loaded on first access from the root.
LIBRARY = (
    "checkpoint",
    "curvature",
    "diagnostics",
    "distributed",
    "distributions",
    "guides",
    "infer",
    "layout",
    "models",
    "nn",
    "predictive",
    "priors",
)
#: The application and the shims of its old paths: never loaded by the library.
APPLICATION = ("pyro_bdl.app", "pyro_bdl.compare", "pyro_bdl.data", "pyro_bdl.cli")


def _python(code: str, *flags: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned decoded."""
    out = subprocess.run(
        [sys.executable, *flags, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_library_loads_nothing_beyond_pyro_and_never_the_application():
    state = _python(
        "import sys, json, pyro\n"
        "before = set(sys.modules)\n"
        "import pyro_bdl\n"
        f"for name in {LIBRARY!r}:\n"
        "    getattr(pyro_bdl, name)\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(json.dumps({'new': new, 'stdlib': sorted(sys.stdlib_module_names)}))"
    )
    stdlib = set(state["stdlib"])
    foreign = [m for m in state["new"] if m.split(".")[0] not in stdlib | {"pyro_bdl"}]
    assert not foreign, f"the library loaded {foreign} beyond what import pyro loads"
    app = [m for m in state["new"] if m.startswith(APPLICATION)]
    assert not app, f"the library loaded the application: {app}"


def test_import_pyro_bdl_alone_loads_neither_torch_nor_pyro():
    state = _python(
        "import sys, json\nimport pyro_bdl\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'pyro', 'numpy'))))"
    )
    assert state == []


def test_public_names_still_resolve():
    state = _python(
        "import sys, json\n"
        "import pyro_bdl as bdl\n"
        "from pyro_bdl import bayesianize\n"
        "assert bayesianize is bdl.nn.bayesianize is bdl.bayesianize\n"
        "assert callable(bdl.diagnostics.ece)\n"
        "assert 'matplotlib' not in sys.modules and 'arviz' not in sys.modules\n"
        "assert callable(bdl.diagnostics.to_inference_data)\n"
        "assert callable(bdl.diagnostics.metrics_binary.binary_ece)\n"
        "assert bdl.diagnostics.plots.plot_entropy is bdl.diagnostics.plot_entropy\n"
        "assert 'pyro_bdl.app' not in sys.modules\n"
        "assert 'ivon' in bdl.app.compare.METHODS\n"
        "assert callable(bdl.app.data.load_digits)\n"
        "assert callable(bdl.app.compare.vogn.damping)\n"
        "print(json.dumps(bdl.__version__))",
        "-W",
        "error::DeprecationWarning",
    )
    from pyro_bdl._version import __version__

    assert state == __version__


def test_unknown_attribute_raises():
    import pyro_bdl
    import pyro_bdl.app

    for module in (pyro_bdl, pyro_bdl.diagnostics, pyro_bdl.app):
        with pytest.raises(AttributeError, match="no_such_name"):
            module.no_such_name  # noqa: B018


def test_cli_help_loads_no_torch_or_plotting():
    state = _python(
        "import contextlib, io, json, sys\n"
        "from pyro_bdl.app.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['compare', '--help'])\n"
        "print(json.dumps([code, sorted(m for m in ('torch', 'pyro', 'matplotlib', 'arviz') "
        "if m in sys.modules)]))"
    )
    assert state == [0, []]


#: (old statement, the check that it reached the new module)
SHIMS = [
    ("import pyro_bdl.data as m", "m is sys.modules['pyro_bdl.app.data']"),
    ("from pyro_bdl.cli import main as m", "m is sys.modules['pyro_bdl.app.cli'].main"),
    ("from pyro_bdl.compare import METHODS as m", "'map' in m"),
    (
        "from pyro_bdl.compare.laplace import fit_subnet_laplace as m",
        "m.__module__ == 'pyro_bdl.app.compare.subnet_laplace'",
    ),
    (
        "from pyro_bdl.compare.problem import Problem as m",
        "m is sys.modules['pyro_bdl.app.compare.problem'].Problem",
    ),
    (
        "from pyro_bdl.metrics_binary import binary_ece as m",
        "m.__module__ == 'pyro_bdl.diagnostics.metrics_binary'",
    ),
    ("import pyro_bdl as bdl; m = bdl.data", "m is sys.modules['pyro_bdl.app.data']"),
    ("import pyro_bdl as bdl; m = bdl.compare", "m is sys.modules['pyro_bdl.app.compare']"),
    (
        "import pyro_bdl as bdl; m = bdl.metrics_binary",
        "m is sys.modules['pyro_bdl.diagnostics.metrics_binary']",
    ),
]


@pytest.mark.parametrize("statement, check", SHIMS)
def test_old_paths_warn_and_reach_the_new_modules(statement, check):
    state = _python(
        "import json, sys, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    {statement}\n"
        f"ok = {check}\n"
        "moved = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "print(json.dumps({'ok': ok, 'moved': moved}))"
    )
    assert state["ok"]
    assert len(state["moved"]) == 1 and "moved to pyro_bdl." in state["moved"][0], state
    assert "next release" in state["moved"][0]
