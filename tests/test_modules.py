"""The shape of the production code (issue 11, "Done when"): no import cycle between its modules, and no module over 400 lines.

Production modules are every `.py` file of `contract.py`, `registry/`, `codegen/`, `runtime/` and
`families/` (when present); `generated/` (rendered, checked by `python -m codegen check`) and `tests/`
are not. Imports are read from the source with `ast`, so the test imports nothing it checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("registry", "codegen", "runtime", "families", "serving")
MAX_LINES = 400


def production_files() -> dict[str, Path]:
    """Dotted module name -> file, for every production module."""
    found = {"contract": ROOT / "contract.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _module_level(body):
    """The statements Python runs when the module is imported: the top level, and the bodies of
    if/try/with/class blocks there. A function's body runs only when the function is called, so an
    import inside a function (a lazy import) is not an edge: it cannot take part in an import-time
    cycle, which is what fails (a partly initialised module) and what this test refuses."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from _module_level(inner)


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The production modules `name` imports at import time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from pkg import mod` imports the module pkg.mod when there is one; it reads a name of pkg
            # itself (an edge to pkg) only for a name that is not a submodule.
            submodules = {f"{source}.{alias.name}" for alias in node.names} & modules
            out.update(submodules)
            if len(submodules) < len(node.names):
                out.add(source)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = production_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each listed sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_imports_it_must():
    # Control: the graph holds edges known to exist (so an empty cycle list is not an empty graph),
    # relative imports resolve, and a lazy import inside a function is not an edge.
    graph = import_graph()
    assert "contract" in graph["registry.model"]
    assert "registry.errors" in graph["registry.model"]
    assert "runtime.experts.canonical" in graph["runtime.experts.base"]   # a relative import (`.canonical`)
    assert "codegen.verify" not in graph["codegen.files"]   # file I/O only: generate verifies, then writes
    assert "runtime.checkpoint.scales" in graph["runtime.checkpoint.loader"]
    assert "runtime.checkpoint" not in graph["runtime.checkpoint.loader"]   # `from runtime.checkpoint import scales`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_production_modules():
    found = cycles(import_graph())
    assert found == [], "import cycles (module-level imports): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_contract_imports_only_the_standard_library():
    # ARCHITECTURE "Rooms": contract.py may import the stdlib only (a generated build and the GPU host import it)
    tree = ast.parse((ROOT / "contract.py").read_text(encoding="utf-8"))
    roots = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    import sys

    assert roots <= set(sys.stdlib_module_names), sorted(roots - set(sys.stdlib_module_names))


def test_no_production_module_exceeds_400_lines():
    # Keep modules small with one role (COMMON quality bar; issue 11 "no module over ~400 lines").
    over = {name: n for name, path in production_files().items() if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines: " + ", ".join(f"{m} ({n})" for m, n in sorted(over.items()))


def top_level_redefinitions(source: str) -> list[str]:
    """Names a module's top level defines twice by `def` or `class`: the later silently replaces the earlier."""
    seen, twice = set(), []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(f"{node.name} (line {node.lineno})")
            seen.add(node.name)
    return twice


def test_no_module_defines_a_top_level_function_twice():
    # bench/moe_layer.py once got a second `_fill` (a table helper) that replaced the weight filler: every cell
    # failed with a TypeError on the GPU machine while every CPU test passed.
    assert top_level_redefinitions("def a(): pass\nclass b: pass\ndef a(x): pass\n") == ["a (line 3)"]
    files = dict(production_files(), **{f"bench.{p.stem}": p for p in sorted((ROOT / "bench").glob("*.py"))})
    found = {name: twice for name, path in files.items() if (twice := top_level_redefinitions(path.read_text(encoding="utf-8")))}
    assert found == {}, f"defined twice at the top level: {found}"
