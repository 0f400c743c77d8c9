"""The package's layers only point down (docs/architecture.md, "Layers").

spec (``quantlens.march``) -> kernels -> quantization -> compiler -> profiler -> search -> cli / demo / zoo.
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


#: rooms a reader can know: no module of src/ above this many lines (docs/architecture.md, "A budget that stays")
MAX_LINES = 500


def test_no_module_is_over_the_line_budget():
    long = {str(p.relative_to(SRC)): n for p in (SRC / "quantlens").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split them along their seams): {long}"
