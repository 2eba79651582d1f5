"""The modules of the package import each other without a circle: a module's imports,
function-local ones included, never lead back to it. Read with ast, nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"mlasandbox": ROOT / "sandbox", "mlasandbox.cli": ROOT / "cli"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports_of(name: str, path: Path, known) -> set[str]:
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for a in node.names:  # `from . import x` may name a module
                if f"{mod}.{a.name}" in known:
                    found.add(f"{mod}.{a.name}")
            if mod in known and not any(f"{mod}.{a.name}" in known for a in node.names):
                found.add(mod)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports_of(n, p, mods) for n, p in mods.items()}


def find_cycle(g):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(g):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def test_the_graph_is_read():
    g = graph()
    assert "mlasandbox.cli.bench_cmd" in g["mlasandbox.cli.main"]
    assert "mlasandbox.registry" in g["mlasandbox.archs"]


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)
