"""The package's layers only point down (docs/architecture.md, "Layers").

spec (``quantlens.march``) -> kernels -> op-site capture (``quantlens.sites``) -> quantization -> compiler -> profiler -> search -> cli / demo / zoo.
A module may import its own layer and any layer below it, never one above. Every ``import`` statement counts,
including the ones inside functions (a lazy import is still a dependency: it only hides the edge from an
import-time check), and ``if TYPE_CHECKING:`` blocks too (a type that lives above is a design smell as well).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: bottom to top; a module belongs to the layer of the longest prefix that names it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("quantlens", "quantlens.errors", "quantlens._advice", "quantlens._io", "quantlens._finite",
              "quantlens._threads", "quantlens.march")),
    ("kernels", ("quantlens.kernels",)),
    ("sites", ("quantlens.sites",)),
    ("quantization", ("quantlens.quantization",)),
    ("compiler", ("quantlens.compiler",)),
    ("profiler", ("quantlens.profiler",)),
    ("search", ("quantlens.search",)),
    ("application", ("quantlens.zoo", "quantlens.cli", "quantlens.demo", "quantlens.__main__")),
]
#: inside the base layer the spec points down to errors only: march may not import the helpers of the layers
#: above (they are base modules for convenience, not spec)
SPEC = "quantlens.march"


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    if rank is None:
        raise AssertionError(f"module {module} is in no layer: add it to tests/test_layers.py's LAYERS")
    return rank


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every module an import statement names (``from pkg import name`` counts as ``pkg.name`` when that is a
    module, else as ``pkg``; the caller resolves it), with its line."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
    return found


def upward_edges(root: Path) -> list[str]:
    """``"src.module:line -> target (layer a -> layer b)"`` for every import of a higher layer under ``root``
    (the folder that holds the ``quantlens`` package)."""
    files = sorted((root / "quantlens").rglob("*.py"))
    modules = {_module_name(p, root): p for p in files}
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        source_layer = layer_of(name)
        for target, line in _imports(tree, name, path.name == "__init__.py"):
            if not (target == "quantlens" or target.startswith("quantlens.")):
                continue
            # "from pkg import name": the module pkg.name when it is one, else a name of pkg (checked as pkg)
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            target_layer = layer_of(target)
            spec_reaching_up = (name == SPEC or name.startswith(SPEC + ".")) and target not in (
                "quantlens.errors",) and not (target == SPEC or target.startswith(SPEC + "."))
            if target_layer > source_layer or spec_reaching_up:
                edges.append(f"{name}:{line} -> {target} ({LAYERS[source_layer][0]} -> {LAYERS[target_layer][0]})")
    return sorted(set(edges))


def test_no_module_imports_a_higher_layer():
    edges = upward_edges(SRC)
    assert edges == [], "imports that reach up a layer:\n" + "\n".join(edges)


def test_every_module_is_in_a_layer():
    for path in (SRC / "quantlens").rglob("*.py"):
        layer_of(_module_name(path, SRC))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "quantlens" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_check_finds_an_upward_import_inside_a_function(tmp_path):
    """A test of the test: a lazy import from kernels up to the compiler, a relative one from quantization up
    to the profiler, and the spec importing a base helper are each reported; downward imports are not."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "_io.py": "",
        "march/__init__.py": "from quantlens.errors import *\n",
        "march/spec.py": "import quantlens._io\n",
        "kernels/__init__.py": "from quantlens.march import spec\n",
        "kernels/ops.py": "def f():\n    from quantlens.compiler.ir import Node\n    return Node\n",
        "quantization/__init__.py": "",
        "quantization/emulation.py": "from ..profiler import metrics\nfrom quantlens.kernels import ops\n",
        "compiler/__init__.py": "",
        "compiler/ir.py": "from quantlens.quantization import emulation\n",
        "profiler/__init__.py": "",
        "profiler/metrics.py": "from quantlens.compiler import ir\n",
    })
    edges = upward_edges(root)
    assert edges == [
        "quantlens.kernels.ops:2 -> quantlens.compiler.ir (kernels -> compiler)",
        "quantlens.march.spec:1 -> quantlens._io (base -> base)",
        "quantlens.quantization.emulation:1 -> quantlens.profiler.metrics (quantization -> profiler)",
    ], edges


#: a package ``__init__`` of at most this many lines only re-exports: importing a name from it is importing the
#: module that defines it, so it is no node of the import graph (a longer one is a module of its own)
THIN_INIT = 40


def _reexports(modules: dict[str, Path], thin: set[str]) -> dict[str, str]:
    """``"pkg.name" -> module`` for every name a thin ``__init__`` takes from one of its modules."""
    found: dict[str, str] = {}
    for init in thin:
        for target, _ in _imports(ast.parse(modules[init].read_text(encoding="utf-8")), init, True):
            owner = target.rpartition(".")[0]
            found.setdefault(f"{init}.{target.rpartition('.')[2]}", owner if owner in modules else target)
    return found


def _import_graph(root: Path) -> tuple[list[str], dict[str, set[str]]]:
    """The modules under ``root`` and, for each, the modules of its own top-level package it imports (a thin
    ``__init__`` is no node: a name taken from it is taken from the module it re-exports)."""
    files = sorted((root / "quantlens").rglob("*.py"))
    modules = {_module_name(p, root): p for p in files}
    thin = {n for n, p in modules.items()
            if p.name == "__init__.py" and len(p.read_text(encoding="utf-8").splitlines()) <= THIN_INIT}
    reexports = _reexports(modules, thin)

    def resolve(target: str) -> str:
        seen = set()
        while target not in seen and target not in modules:
            seen.add(target)
            target = reexports.get(target) or target.rpartition(".")[0] or target
        return target

    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name in thin or name.count(".") < 1:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, _ in _imports(tree, name, path.name == "__init__.py"):
            target = resolve(target)
            if target in thin or target == name or target.split(".")[:2] != name.split(".")[:2]:
                continue
            edges.setdefault(name, set()).add(target)
    return sorted(modules), edges


def package_circles(root: Path) -> list[list[str]]:
    """The import circles inside each package of ``quantlens`` (its top-level packages: quantization, compiler ...),
    every import counted as in :func:`upward_edges` (inside functions and ``TYPE_CHECKING`` blocks too): the
    strongly connected components of more than one module, each sorted, in sorted order."""
    import sys

    modules, edges = _import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(modules)))
    try:
        for v in sorted(modules):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(circles)


def test_no_import_circle_inside_a_package():
    """No exception is kept: where two modules need one thing, it lives in a leaf both import."""
    circles = package_circles(SRC)
    assert circles == [], "import circles inside a package:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_check_finds_a_circle_closed_inside_a_function(tmp_path):
    """A test of the test: two modules importing each other, one of them inside a function, are a circle; a
    thin ``__init__`` that re-exports is no node, but a name taken from it is taken from the module it re-exports
    (zoo: m -> n -> the package's g, which is m's); a longer ``__init__`` is a node."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "sites/__init__.py": "from quantlens.sites.a import f\n",
        "sites/a.py": "from quantlens.sites import b\n",
        "sites/b.py": "def g():\n    from quantlens.sites.a import f\n    return f\n",
        "sites/c.py": "from quantlens.sites import f\n",
        "zoo/__init__.py": "from quantlens.zoo.m import g\n",
        "zoo/m.py": "def g():\n    from quantlens.zoo.n import h\n",
        "zoo/n.py": "from quantlens.zoo import g\nh = 1\n",
        "cli/__init__.py": "from quantlens.cli import cmd\n" + "x = 1\n" * 41,
        "cli/cmd.py": "from quantlens.cli import x\n",
    })
    assert package_circles(root) == [["quantlens.cli", "quantlens.cli.cmd"], ["quantlens.sites.a", "quantlens.sites.b"],
                                     ["quantlens.zoo.m", "quantlens.zoo.n"]]


#: rooms a reader can know: no module of src/ above this many lines (docs/architecture.md, "A budget that stays")
MAX_LINES = 500


def test_no_module_is_over_the_line_budget():
    long = {str(p.relative_to(SRC)): n for p in (SRC / "quantlens").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_crossings(root: Path) -> list[str]:
    """``"module:line -> target"`` for every import of a private name of another module (``from m import _x``), and
    of a private module (``pkg/_m.py``) from outside the package that holds it, every import counted as in
    :func:`upward_edges`. A private module is its package's: the package's own modules may share it, the rest of
    quantlens may not; a name with an underscore is its module's alone (what modules share gets a public name)."""
    files = sorted((root / "quantlens").rglob("*.py"))
    modules = {_module_name(p, root): p for p in files}
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, line in _imports(tree, name, path.name == "__init__.py"):
            if not target.startswith("quantlens."):
                continue
            module = target
            while module not in modules and "." in module:
                module = module.rpartition(".")[0]
            imported = target[len(module) + 1:]
            if imported and _private(imported.split(".")[0]):
                found.append(f"{name}:{line} -> {target}")
                continue
            parts = module.split(".")
            for i, part in enumerate(parts):
                owner = ".".join(parts[:i])  # the package a private module (or package) belongs to
                if _private(part) and not (name == owner or name.startswith(owner + ".")):
                    found.append(f"{name}:{line} -> {module}")
                    break
    return sorted(set(found))


def test_no_private_name_crosses_modules():
    crossings = private_crossings(SRC)
    assert crossings == [], ("private names or modules imported across modules (give what modules share a public "
                             "name inside its package):\n" + "\n".join(crossings))


def test_the_check_finds_private_names_and_modules_that_cross(tmp_path):
    """A test of the test: a private name imported inside a function, a private module imported from outside its
    package (relatively, too) are reported; a package's own modules sharing its private module, and quantlens'
    top-level private modules, are not."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "_io.py": "",
        "kernels/__init__.py": "",
        "kernels/_int.py": "def f():\n    pass\n",
        "kernels/ops.py": "from quantlens.kernels._int import f\nimport quantlens._io\n",
        "kernels/integer/__init__.py": "from quantlens.kernels import _int\n",
        "compiler/__init__.py": "",
        "compiler/state.py": "_Converter = 1\n",
        "compiler/gemm.py": "def g():\n    from quantlens.compiler.state import _Converter\n    return _Converter\n",
        "compiler/arity.py": "from ..kernels._int import f\n",
    })
    assert private_crossings(root) == [
        "quantlens.compiler.arity:1 -> quantlens.kernels._int",
        "quantlens.compiler.gemm:2 -> quantlens.compiler.state._Converter",
    ], private_crossings(root)


def test_every_package_folder_has_an_init():
    """setuptools' package discovery (pyproject's ``packages.find``) leaves a folder without ``__init__.py`` out of
    the wheel: an editable install would still import it, an installed one would not."""
    missing = [str(d.relative_to(SRC)) for d in (SRC / "quantlens").rglob("*")
               if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert missing == [], f"package folders without __init__.py: {missing}"
