"""The house rules that a reader of the code can check, checked on ``pyro_bdl/`` from its syntax.

1. **No private name of another module.** A name with one leading underscore (``_x``, not
   ``__x__``) belongs to the module that defines it: no other module may import it
   (``from pyro_bdl.m import _x``, at module level or inside a function) or reach it through an
   imported module (``m._x`` with ``m`` bound by an import). Where two modules need a helper, it
   is public to the package. A *private module* (``_files.py``) is different: it is a package's
   internal file and may be imported, and its public names used, only by modules inside the
   directory of the package that holds it (``pyro_bdl.checkpoint._files`` from
   ``pyro_bdl/checkpoint/``; ``pyro_bdl._validation`` from anywhere in ``pyro_bdl/``). Private
   names of third-party packages (Pyro's ``_PYRO_STACK``) are outside this rule: it is about the
   layering of our own modules. Attribute access on objects that are not modules (``guide._x``)
   cannot be resolved from the syntax and is not checked.
2. **No import cycle** among ``pyro_bdl`` modules, counting every import: module level,
   function level and type-only (``if TYPE_CHECKING:``) ones, because a cycle that the
   interpreter tolerates is still two modules that cannot be read or changed one at a time.
   ``from pkg import name`` is an edge to the submodule ``pkg.name`` when that is a module, else
   to ``pkg`` itself (its ``__init__``).
3. **No module above** :data:`MAX_LINES` **lines**: past that it is usually two ideas.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pyro_bdl"
MAX_LINES = 800

# ----------------------------------------------------------------------------- reading the tree


def module_files(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of ``package`` under ``root``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _absolute(node: ast.ImportFrom, module: str, modules: dict[str, Path]) -> str:
    """The absolute module named by ``from ... import``, resolving a relative import."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module, modules):
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_module_misuse(importer: str, target: str, package: str) -> str | None:
    """Why ``importer`` may not import module ``target`` (a private component outside its
    package's directory), or ``None``."""
    parts = target.split(".")
    for i, part in enumerate(parts[1:], 1):
        owner = ".".join(parts[:i])
        if is_private(part) and not (importer == owner or importer.startswith(owner + ".")):
            return f"private module: {importer} imports {target} from outside {owner}"
    return None


class _ModuleReader(ast.NodeVisitor):
    """Collects one module's imports (graph edges) and its uses of other modules' private names."""

    def __init__(self, module: str, modules: dict[str, Path], package: str):
        self.module, self.modules, self.package = module, modules, package
        self.edges: set[str] = set()
        self.problems: set[str] = set()
        self.bound: dict[str, str] = {}  # local name -> module it is bound to

    def _ours(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _use_module(self, target: str) -> None:
        if target != self.module:
            self.edges.add(target)
        problem = _private_module_misuse(self.module, target, self.package)
        if problem:
            self.problems.add(problem)

    def _use_name(self, owner: str, name: str) -> None:
        """``owner.name``: a submodule, or a name defined (or re-exported) by ``owner``."""
        if f"{owner}.{name}" in self.modules:
            self._use_module(f"{owner}.{name}")
        else:
            self._use_module(owner)
            if is_private(name) and owner != self.module:
                self.problems.add(f"private name: {self.module} uses {owner}.{name}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._ours(alias.name):
                continue
            self._use_module(alias.name)
            if alias.asname:
                self.bound[alias.asname] = alias.name
            else:
                self.bound[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        owner = _absolute(node, self.module, self.modules)
        if not self._ours(owner):
            return
        for alias in node.names:
            if alias.name == "*":
                self._use_module(owner)
                continue
            self._use_name(owner, alias.name)
            if f"{owner}.{alias.name}" in self.modules:
                self.bound[alias.asname or alias.name] = f"{owner}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.bound:
            owner = self.bound[base.id]
            for attr in reversed(chain):
                if f"{owner}.{attr}" in self.modules:
                    owner = f"{owner}.{attr}"
                    continue
                if is_private(attr) and owner != self.module:
                    self.problems.add(f"private name: {self.module} uses {owner}.{attr}")
                break
            return  # the inner Attribute nodes are the same chain
        self.generic_visit(node)


def read_modules(root: Path, package: str) -> tuple[dict[str, set[str]], set[str]]:
    """(import graph ``{module: modules it imports}``, private-name problems) of ``package``."""
    modules = module_files(root, package)
    graph, problems = {}, set()
    for module, path in modules.items():
        reader = _ModuleReader(module, modules, package)
        # Bindings first, so that an attribute use before the import statement (an import at
        # the bottom of a function, say) still resolves; then the whole tree, every scope.
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                reader.visit(node)
        reader.visit(tree)
        graph[module] = {m for m in reader.edges if m in modules}
        problems |= reader.problems
    return graph, problems


def import_cycles(graph: dict[str, set[str]]) -> set[str]:
    """One message per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return {
        "import cycle: " + " <-> ".join(sorted(component))
        for component in components
        if len(component) > 1
    }


def long_modules(root: Path, package: str, max_lines: int = MAX_LINES) -> set[str]:
    out = set()
    for module, path in module_files(root, package).items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            out.add(
                f"long module: {module} has {lines} lines (> {max_lines}); is it two ideas? "
                "Split it into modules named after each"
            )
    return out


def violations(root: Path = ROOT, package: str = PACKAGE) -> set[str]:
    """Every breach of the three rules in ``root/package``, one message each."""
    graph, problems = read_modules(root, package)
    return problems | import_cycles(graph) | long_modules(root, package)


# ----------------------------------------------------------------------------- on pyro_bdl


def test_pyro_bdl_keeps_the_house_rules():
    broken = sorted(violations())
    assert not broken, "house rules broken (see this file's docstring):\n" + "\n".join(broken)


# ----------------------------------------------------------------------------- they can fail


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return tmp_path


SYNTHETIC = {
    "pkg/__init__.py": "",
    "pkg/_internal.py": "def helper(): ...\n",
    "pkg/owner.py": "_hidden = 1\nVISIBLE = 2\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/_files.py": "def write(): ...\n",
    "pkg/sub/ok.py": """
        from pkg import _internal
        from pkg.owner import VISIBLE
        from pkg.sub._files import write
        from . import _files
    """,
    "pkg/from_import.py": "from pkg.owner import _hidden\n",
    "pkg/in_function.py": """
        def f():
            from pkg.owner import _hidden
            return _hidden
    """,
    "pkg/attribute.py": """
        import pkg.owner
        from pkg import owner as o
        def f():
            return pkg.owner._hidden + o._hidden
    """,
    "pkg/other/__init__.py": "",
    "pkg/other/reach.py": "from pkg.sub._files import write\n",
    "pkg/cycle_a.py": "import pkg.cycle_b\n",
    "pkg/cycle_b.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.cycle_a import Thing
    """,
    "pkg/long.py": "x = 1\n" * 12,
}


def test_the_rules_catch_synthetic_violations(tmp_path):
    root = _tree(tmp_path, SYNTHETIC)
    graph, problems = read_modules(root, "pkg")
    assert problems == {
        "private name: pkg.from_import uses pkg.owner._hidden",
        "private name: pkg.in_function uses pkg.owner._hidden",
        "private name: pkg.attribute uses pkg.owner._hidden",
        "private module: pkg.other.reach imports pkg.sub._files from outside pkg.sub",
    }
    assert import_cycles(graph) == {"import cycle: pkg.cycle_a <-> pkg.cycle_b"}
    assert graph["pkg.sub.ok"] == {"pkg._internal", "pkg.owner", "pkg.sub._files"}
    assert long_modules(root, "pkg", max_lines=10) == {
        "long module: pkg.long has 12 lines (> 10); is it two ideas? Split it into modules "
        "named after each"
    }
    assert len(violations(root, "pkg")) == 5  # the long module is within the default limit


@pytest.mark.parametrize(
    "source",
    [
        "from pkg.owner import _hidden as visible\n",
        "import pkg.owner as o\nvalue = o._hidden\n",
        "from . import owner\nvalue = owner._hidden\n",
    ],
)
def test_aliases_and_relative_imports_do_not_hide_a_private_name(tmp_path, source):
    root = _tree(tmp_path, {**SYNTHETIC, "pkg/user.py": source})
    _, problems = read_modules(root, "pkg")
    assert "private name: pkg.user uses pkg.owner._hidden" in problems
