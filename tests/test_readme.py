"""Every code block of README.md and of the documentation pages (docs/**/*.md) runs, so neither
can drift from the API.

Python blocks (```python) run in order, each in a fresh namespace and a temporary working folder
(blocks save files). A block sees what a reader has after the README's first example:

* that example's imports (:data:`FIRST_EXAMPLE_IMPORTS`), and
* the names a reader supplies from their own run (:data:`READER`), built only when the block uses
  them without defining them, from a tiny slice of scikit-learn's ``load_digits``:

  ``x_train, y_train`` 64 training rows (inputs scaled to [0, 1]), ``N`` = 64, ``x_test, y_test``
  32 test rows, ``loader`` two minibatches of 32 training rows, ``x, y`` the first of them;
  ``net`` a plain (not lifted) MLP 64-32-10; ``bnn`` another one lifted with the prior N(0, 1);
  ``model`` = ``bdl.models.classifier(bnn, N)`` (the first example's model, ready-made);
  ``guide`` a mean-field guide of ``model`` with its parameters created; ``optim`` the Adam
  optimizer that took one SVI step of ``guide``; ``swag_guide`` an ``AutoSWAG`` of ``model``
  after 3 epochs of SGD with a snapshot each; ``probs`` / ``probs_ood`` predictive probabilities
  of ``x`` and of 16 uniform-noise inputs; ``resnet`` a torchvision ResNet-18 for 10 classes;
  ``epochs`` = 3, ``swag_start`` = 1, ``batch_size`` = 16, ``step`` = ``epoch`` = 0,
  ``data_gen`` a seeded ``torch.Generator``.

Anything else a block uses it must import or define itself, as a reader's copy would.

Shell blocks (```bash) are not executed; every command in them is checked to exist: ``make``
targets in the Makefile, ``pip install`` extras in pyproject.toml, ``pyro-bdl`` /
``python -m pyro_bdl`` command lines parsed by :func:`pyro_bdl.app.cli.build_parser`, ``python -m
benchmarks.<name>`` modules imported with each option found in their source, and scripts run by
``python`` / ``torchrun`` present with their options parsed. Values that depend on the reader's
machine are replaced by :data:`MACHINE_DEPENDENT` (each with its reason).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import linecache
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_bdl as bdl

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Folders under docs/ that hold no hand-written Markdown pages: the build, the copied notebooks.
NOT_PAGES = {"_build", "tutorials"}


def _documents() -> list[Path]:
    """README.md, then every Markdown page under docs/ (design notes, method pages, benchmarks)."""
    pages = [
        p
        for p in sorted((ROOT / "docs").rglob("*.md"))
        if not NOT_PAGES & set(p.relative_to(ROOT / "docs").parts)
    ]
    return [README, *pages]


DOCUMENTS = _documents()

#: A fenced block: its indentation, its language tag and its body (fences close at the same
#: indentation they opened with).
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    """``(document, line number of the opening fence, body)`` of every ``lang`` block, in order."""
    found = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        found += [
            (name, text.count("\n", 0, m.start()) + 1, m.group("body"))
            for m in FENCE.finditer(text)
            if m.group("lang") == lang
        ]
    return found


PYTHON_BLOCKS = _blocks("python")
BASH_BLOCKS = _blocks("bash")

#: Python blocks that cannot run on a CPU-only machine, keyed by a substring found in exactly one
#: block, each with its reason. Empty today: every Python block runs here.
CANNOT_RUN_HERE: dict[str, str] = {}

#: Shell-command fragments whose value depends on the reader's machine: what each is parsed as
#: here, and why. ``{tmp}`` is an existing temporary folder.
MACHINE_DEPENDENT: dict[str, tuple[str, str]] = {
    "--device cuda": (
        "--device cpu",
        "the parser refuses cuda on a machine without CUDA; cpu checks the option exists",
    ),
    "--data-dir ../shared/data": (
        "--data-dir {tmp}",
        "the folder of the reader's MNIST files; the parser requires an existing folder",
    ),
}

FIRST_EXAMPLE_IMPORTS = (
    "import pyro, pyro.distributions as dist, torch\n"
    "from pyro.infer import SVI, Predictive, Trace_ELBO\n"
    "from pyro.infer.autoguide import AutoDelta\n"
    "import pyro_bdl as bdl\n"
)


# --- the reader's names --------------------------------------------------------------------------

NUM_TRAIN, NUM_TEST, BATCH = 64, 32, 32


@functools.cache
def _digits_rows() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.as_tensor(data.data[: NUM_TRAIN + NUM_TEST], dtype=torch.float32) / 16.0
    y = torch.as_tensor(data.target[: NUM_TRAIN + NUM_TEST], dtype=torch.long)
    return x, y


def _digits() -> dict[str, torch.Tensor]:
    x, y = (t.clone() for t in _digits_rows())  # a block that writes into them harms no other
    return {
        "x_train": x[:NUM_TRAIN],
        "y_train": y[:NUM_TRAIN],
        "x_test": x[NUM_TRAIN:],
        "y_test": y[NUM_TRAIN:],
    }


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _lifted(r: _Reader) -> torch.nn.Module:
    return bdl.bayesianize(_mlp(), prior=bdl.priors.Normal(scale=1.0))


def _guide(r: _Reader):
    guide = bdl.guides.AutoMeanField(r["model"])
    guide(r["x"], r["y"])  # creates the parameters, as the reader's training did
    return guide


def _optim(r: _Reader):
    optim = pyro.optim.Adam({"lr": 1e-3})
    SVI(r["model"], r["guide"], optim, Trace_ELBO()).step(r["x"], r["y"])
    return optim


def _swag_guide(r: _Reader):
    guide = bdl.guides.AutoSWAG(r["model"], rank=2)
    svi = SVI(
        r["model"], guide, pyro.optim.SGD({"lr": 0.05 / r["N"], "momentum": 0.9}), Trace_ELBO()
    )
    for _ in range(3):
        for x, y in r["loader"]:
            svi.step(x, y)
        guide.collect()
    return guide


def _probs(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net(x).softmax(-1)


def _resnet(r: _Reader) -> torch.nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


#: name -> how it is built from the other names (``r[name]``).
READER: dict[str, Callable[[_Reader], Any]] = {
    **{
        name: (lambda r, name=name: r.digits[name])
        for name in ("x_train", "y_train", "x_test", "y_test")
    },
    "N": lambda r: NUM_TRAIN,
    "loader": lambda r: list(
        zip(r["x_train"].split(BATCH), r["y_train"].split(BATCH), strict=True)
    ),
    "x": lambda r: r["loader"][0][0],
    "y": lambda r: r["loader"][0][1],
    "net": lambda r: _mlp(),
    "bnn": _lifted,
    "model": lambda r: bdl.models.classifier(r["bnn"], r["N"]),
    "guide": _guide,
    "optim": _optim,
    "swag_guide": _swag_guide,
    "probs": lambda r: _probs(r["bnn"], r["x"]),
    "probs_ood": lambda r: _probs(r["bnn"], torch.rand(16, 64)),
    "resnet": _resnet,
    "epochs": lambda r: 3,
    "swag_start": lambda r: 1,
    "batch_size": lambda r: 16,
    "step": lambda r: 0,
    "epoch": lambda r: 0,
    "data_gen": lambda r: torch.Generator().manual_seed(0),
}


class _Reader:
    """The reader's names, each built on first use (once per block)."""

    def __init__(self):
        self.values: dict[str, Any] = {}
        self._digits: dict[str, torch.Tensor] | None = None

    @property
    def digits(self) -> dict[str, torch.Tensor]:
        if self._digits is None:
            self._digits = _digits()
        return self._digits

    def __getitem__(self, name: str) -> Any:
        if name not in self.values:
            self.values[name] = READER[name](self)
        return self.values[name]


def _free_names(source: str) -> set[str]:
    """Names the block reads but never binds at any level (its inputs)."""
    tree = ast.parse(source)
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return loaded - bound - set(dir(builtins))


#: Keyword arguments given as a literal whole number above the cap run with the cap: the README
#: shows a reader's sizes, the test checks that the calls work. Under ``pyro.enable_validation``
#: (on in every test) ``psis_khat(..., num_samples=2000)`` alone takes about 20 s of CPU.
SIZE_CAPS = {"num_samples": 50}


class _SmallSizes(ast.NodeTransformer):
    def visit_keyword(self, node: ast.keyword) -> ast.keyword:
        cap = SIZE_CAPS.get(node.arg or "")
        value = node.value
        if (
            cap is not None
            and isinstance(value, ast.Constant)
            and type(value.value) is int
            and value.value > cap
        ):
            node.value = ast.copy_location(ast.Constant(cap), value)
        return node


def _block_id(block: tuple[str, int, str]) -> str:
    return f"{block[0]}:{block[1]}"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[_block_id(b) for b in PYTHON_BLOCKS])
def test_python_block_runs(block, tmp_path, monkeypatch):
    document, line, body = block
    for key, reason in CANNOT_RUN_HERE.items():
        if key in body:
            pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    exec(FIRST_EXAMPLE_IMPORTS, namespace)
    reader = _Reader()
    for name in sorted(_free_names(body) - namespace.keys()):
        if name in READER:
            namespace[name] = reader[name]
    # The block is its own source file for tracebacks (pytest then shows the block, not the
    # whole document); its name gives the document's line of the opening fence, and a
    # traceback's line numbers count from there.
    filename = f"<{document}, block at line {line}>"
    linecache.cache[filename] = (len(body), None, body.splitlines(True), filename)
    code = compile(_SmallSizes().visit(ast.parse(body)), filename, "exec")
    try:
        exec(code, namespace)
        for key, check in EXPECTED.items():
            if key in body:
                check(namespace)
    finally:  # the linecache entry stays: pytest reads it when it reports a failure
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")


def _is_distribution(probs: torch.Tensor, rows: int) -> None:
    assert probs.shape == (rows, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(rows, dtype=probs.dtype))


def _first_example(ns: dict[str, Any]) -> None:
    rows = len(ns["y_test"])
    _is_distribution(ns["probs"], rows)
    # It promises a trained network ("about 0.9"). On 360 test rows chance is 0.1; a MAP after
    # five epochs scores about 0.95, and 0.8 is far above anything an untrained one reaches.
    accuracy = float((ns["probs"].argmax(-1) == ns["y_test"]).double().mean())
    assert accuracy > 0.8, f"the first example reached test accuracy {accuracy:.3f}"


#: What some blocks promise, checked after they run; keyed like :data:`CANNOT_RUN_HERE`.
EXPECTED: dict[str, Callable[[dict[str, Any]], None]] = {
    "AutoDelta(model, init_loc_fn": lambda ns: _first_example(ns),
    "PerExampleGradients(net)": lambda ns: [
        (g.shape == q.shape and bool((q >= 0).all())) or pytest.fail(name)
        for name, g in ns["grads"].items()
        for q in [ns["squared"][name]]
    ],
    'torch.save(vogn.state_dict(), "vogn.pt")': lambda ns: (
        Path("vogn.pt").is_file() or pytest.fail("vogn.pt not saved")
    ),
    "AutoSWAG(model": lambda ns: _is_distribution(ns["probs"], NUM_TEST),
    'AutoSubnetLaplace(model, subnetwork="largest_variance"': lambda ns: _is_distribution(
        ns["probs"], NUM_TEST
    ),
    # σ(x) regression on 160 rows (noise sd 0.05–0.45): the block's fit scores about 0.0 per
    # test row, a constant N(0, 1) forecast of y about −1.3; below −2 (or not finite) the mixture
    # is not a density over y or the MAP phase did not train.
    "hguide.predictive_distribution(": lambda ns: (
        (bool(torch.isfinite(ns["test_ll"])) and float(ns["test_ll"]) > -2)
        or pytest.fail(f"test LL {float(ns['test_ll']):.3f}")
    ),
    # The block trains its MAP before fitting. On these 32 rows an untrained one scores about
    # 0.1 (sd sqrt(0.1 * 0.9 / 32) = 0.05) and a trained one 0.78 to 0.88 (four runs; sd about
    # sqrt(0.8 * 0.2 / 32) = 0.07): 0.5 is four sds below the worst run and eight above chance,
    # so only a skipped MAP phase falls below it.
    "guides.AutoLaplace(model)": lambda ns: (
        _is_distribution(ns["probs"], NUM_TEST),
        bdl.diagnostics.accuracy(ns["probs"], ns["y_test"]) > 0.5 or pytest.fail("chance level"),
    ),
    "save_checkpoint(": lambda ns: ns["state"]["step"] == 0 or pytest.fail(str(ns["state"])),
}


def test_every_python_block_is_seen():
    # Guard against an extraction that silently finds nothing (a changed fence style).
    assert len(PYTHON_BLOCKS) >= 10 and BASH_BLOCKS


def test_block_keys_name_one_block_each():
    # A key that matches no block (or several) would silently skip or check the wrong thing.
    for key in [*CANNOT_RUN_HERE, *EXPECTED]:
        found = [f"{doc}:{line}" for doc, line, body in PYTHON_BLOCKS if key in body]
        assert len(found) == 1, f"key {key!r} matches the blocks {found}"


# --- shell blocks ---------------------------------------------------------------------------------


def _commands() -> list[tuple[str, str]]:
    """``("document:line", command)`` of every command in the shell blocks (continuations
    joined)."""
    commands = []
    for document, fence, body in BASH_BLOCKS:
        pending, start = "", 0
        for offset, text in enumerate(body.splitlines(), start=1):
            if not pending:
                start = fence + offset
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            command = (pending + text).strip()
            pending = ""
            if command and not command.startswith("#"):
                commands.append((f"{document}:{start}", command))
    return commands


COMMANDS = _commands()


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser under its older name
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def _compare_parser():
    from pyro_bdl.app.cli import build_parser

    return build_parser()


def _check_pyro_bdl(args: list[str]) -> None:
    from pyro_bdl.app.cli import UsageError

    try:
        _compare_parser().parse_args(args)
    except UsageError as err:
        pytest.fail(f"pyro-bdl refuses {shlex.join(args)!r}: {err}")


def _check_benchmark(module_name: str, args: list[str]) -> None:
    module = importlib.import_module(module_name)
    assert callable(getattr(module, "main", None)), f"{module_name} has no main()"
    source = Path(module.__file__ or "").read_text(encoding="utf-8")
    for arg in args:
        if arg.startswith("--"):
            option = arg.split("=", 1)[0]
            assert f'"{option}"' in source, f"{module_name} has no option {option}"


def _check_script(path: str, args: list[str]) -> None:
    """``path`` exists, imports, and its ``parse_args`` (if any) accepts ``args``."""
    script = ROOT / path
    assert script.is_file(), f"{path} does not exist"
    spec = importlib.util.spec_from_file_location(f"_readme_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines its functions; __name__ is not "__main__"
    parse_args = getattr(module, "parse_args", None)
    if parse_args is not None:
        try:
            parse_args(args)
        except SystemExit:
            pytest.fail(f"{path} refuses {shlex.join(args)!r} (its usage is printed above)")


def _check_pip(args: list[str]) -> None:
    extras = set(_pyproject()["project"].get("optional-dependencies", {}))
    specs = [a for a in args if not a.startswith("-")]
    assert specs, "pip install names nothing to install"
    for spec in specs:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
        assert match, f"pip install {spec!r}: the README installs only from the clone ('.')"
        missing = set((match.group(1) or "").split(",")) - extras - {""}
        assert not missing, f"pip install {spec!r}: no extra {sorted(missing)} in pyproject.toml"


def _check_command(tokens: list[str]) -> None:
    head, args = tokens[0], tokens[1:]
    if head == "make":
        missing = [t for t in args if "=" not in t and t not in _make_targets()]
        assert args and not missing, f"Makefile has no target {missing}"
    elif head == "pip" and args[:1] == ["install"]:
        _check_pip(args[1:])
    elif head == "pyro-bdl":
        assert _pyproject()["project"]["scripts"]["pyro-bdl"] == "pyro_bdl.app.cli:main"
        _check_pyro_bdl(args)
    elif head == "python" and args[:2] == ["-m", "pyro_bdl"]:
        assert (ROOT / "pyro_bdl" / "__main__.py").is_file()
        _check_pyro_bdl(args[2:])
    elif head == "python" and args[:1] == ["-m"] and args[1].startswith("benchmarks."):
        _check_benchmark(args[1], args[2:])
    elif head == "python" and args[:1] and args[0].endswith(".py"):
        _check_script(args[0], args[1:])
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        _check_script(parsed.training_script, parsed.training_script_args)
    else:
        pytest.fail(f"no check for {shlex.join(tokens)!r}: teach tests/test_readme.py one")


@pytest.mark.parametrize("command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_shell_command_exists(command, tmp_path):
    _line, text = command
    for fragment, (stand_in, _reason) in MACHINE_DEPENDENT.items():
        if fragment == "--device cuda" and torch.cuda.is_available():
            continue  # the real thing, parsed as is
        text = text.replace(fragment, stand_in.format(tmp=tmp_path))
    tokens = shlex.split(text, comments=True)
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]):
        tokens.pop(0)  # an environment assignment (PYRO_BDL_DATA=...) before the command
    _check_command(tokens)


def test_machine_dependent_fragments_are_in_the_readme():
    # A stale entry would hide nothing but mislead: each must still occur in a shell block.
    for fragment in MACHINE_DEPENDENT:
        assert any(fragment in text for _, text in COMMANDS), f"{fragment!r} is in no shell block"


# --- commands named in the prose -----------------------------------------------------------------

PROSE = "\n".join(FENCE.sub("", path.read_text(encoding="utf-8")) for path in DOCUMENTS)
INLINE = re.findall(r"`([^`\n]+)`", PROSE)


def test_make_targets_named_in_the_prose_exist():
    named = {span.split()[1] for span in INLINE if span.startswith("make ")}
    assert named, "the documents name no make target"
    assert named <= _make_targets(), f"Makefile has no target {sorted(named - _make_targets())}"


def test_benchmark_modules_named_in_the_prose_import():
    names = set(re.findall(r"python -m (benchmarks\.\w+)", PROSE))
    assert names, "the documents name no benchmark module"
    for name in sorted(names):
        assert callable(getattr(importlib.import_module(name), "main", None)), name


def test_pyro_bdl_options_named_in_the_prose_exist():
    compare = _compare_parser()._subparsers._group_actions[0].choices["compare"]  # type: ignore[union-attr]
    options = set(compare._option_string_actions)
    spans = [span for span in INLINE if span.startswith("pyro-bdl compare")]
    named = {tok for span in spans for tok in span.split() if tok.startswith("--")}
    assert named, "the documents name no pyro-bdl compare option in the prose"
    assert named <= options, f"pyro-bdl compare has no option {sorted(named - options)}"
