"""The shape of the code: no import cycles among quantcli's modules, no function over 60 lines,
no file over 400 lines, and no library module importing the command layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package dir -> import name (recipes/ and kernels/ install as quantcli.recipes / quantcli.kernels)
PACKAGES = {ROOT / "quantcli": "quantcli", ROOT / "recipes": "quantcli.recipes", ROOT / "kernels": "quantcli.kernels"}
COMMAND_LAYER = {"quantcli.cli", "quantcli.commands", "quantcli.__main__"}
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
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                found.add(n)
    return found


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


def test_library_does_not_import_the_command_layer():
    bad = [f"{m} imports {d}" for m, deps in graph().items() if m not in COMMAND_LAYER
           for d in deps if d in COMMAND_LAYER]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", sorted(modules().values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_sizes(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(text.splitlines())} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: " + ", ".join(long)
