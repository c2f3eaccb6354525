"""The shape of the code (docs/architecture.md): the layers import downwards only (also by string,
through importlib), no import cycles among quantcli's modules, no function over 60 lines, no file
over 400 lines, and the top of quantcli/ holds a handful of modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package dir -> import name (recipes/ and kernels/ install as quantcli.recipes / quantcli.kernels)
PACKAGES = {ROOT / "quantcli": "quantcli", ROOT / "recipes": "quantcli.recipes"}
# Layer of each package, top (the face) to bottom; a module may import its own layer or lower ones.
LAYERS = [
    ("face", ["quantcli.cli", "quantcli.__main__", "quantcli.testing"]),
    ("jobs", ["quantcli.convert", "quantcli.calibrate", "quantcli.evaluate", "quantcli.inspect", "quantcli.verify"]),
    ("planning", ["quantcli.planning"]),
    ("model", ["quantcli.model"]),
    ("formats", ["quantcli.formats", "quantcli.recipes", "quantcli.rounding"]),
    ("bytes", ["quantcli.checkpoint", "quantcli.kernels"]),
    ("base", ["quantcli", "quantcli.errors", "quantcli.reports", "quantcli.memory", "quantcli.atomic",
              "quantcli.schemas"]),
]
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "errors.py", "reports.py", "memory.py", "atomic.py", "testing.py"}
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for base, name in PACKAGES.items():
        for p in base.rglob("*.py"):
            rel = p.relative_to(base).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            out[".".join([name, *parts])] = p
    return out


def imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """quantcli modules that `mod` imports at module level or in functions (all edges count)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif _is_import_by_string(node):
            names = [node.args[0].value]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                found.add(n)
    return found


def _is_import_by_string(node: ast.AST) -> bool:
    """importlib.import_module("quantcli.x") or __import__("quantcli.x"): an import all the same."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return name in ("import_module", "__import__") and isinstance(node.args[0].value, str)


def layer_of(mod: str) -> int:
    """Index in LAYERS (0 = face), by the longest package prefix that names the module."""
    best, rank = "", None
    for i, (_, packages) in enumerate(LAYERS):
        for pkg in packages:
            if (mod == pkg or mod.startswith(pkg + ".")) and len(pkg) > len(best):
                best, rank = pkg, i
    assert rank is not None, f"{mod} is in no layer: add its package to LAYERS"
    return rank


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def test_no_import_cycles():
    g = graph()
    # a package's __init__ importing its own submodules is not a cycle of concern; drop pkg->child edges
    for m in g:
        g[m] = {d for d in g[m] if not d.startswith(m + ".")}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    up = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
          for m, deps in graph().items() for d in deps
          if not d.startswith(m + ".") and layer_of(d) < layer_of(m)]
    assert not up, "upward imports:\n" + "\n".join(sorted(up))


def test_the_layer_check_sees_imports_by_string():
    tree = ast.parse('importlib.import_module("quantcli.cli")')
    assert _is_import_by_string(tree.body[0].value)


def test_top_level_holds_a_handful_of_modules():
    top = {p.name for p in (ROOT / "quantcli").glob("*.py")}
    assert top <= TOP_LEVEL_MODULES, f"put {sorted(top - TOP_LEVEL_MODULES)} in the folder of its layer"


@pytest.mark.parametrize("path", sorted(modules().values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_sizes(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(text.splitlines())} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: " + ", ".join(long)
