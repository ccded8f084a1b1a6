"""Claims about rendered Python, checked with libcst before a file is written (RULES GN1, GN4).

A generated file is only as trustworthy as what can be proven about it from its text: every rendered
Python file must parse and name, call and import only what an allow-list for its kind permits (RULES
GN4: so code a declaration value smuggled in fails here even if a template slips), and a build's model
file must import nothing but torch, the runtime's ops and the experts classes of the implementations
its plan binds (never the resolver), with the constants it declares equal to the plan's. libcst, not `ast`, because it is the concrete tree the rules name and
keeps every token of the text it checks. A violated claim is a `GenerationError` naming the file, the
line and the claim; `verify_tree` runs the same claims on a checked-in tree for the tests. The
allow-lists and the claims themselves are `codegen.claims`'.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from codegen.claims import (ATTRIBUTES, BUILTINS, DATA, DATA_CLAIMS, DRAFT, DYNAMIC_LOADERS, EXPERTS_CONTRACT, GENERIC,
                            GENERIC_CLAIMS, ROOT, ROOT_CLAIMS, ROOT_IMPORTS, SPECIALIZED, Claims, claims_for_draft,
                            claims_for_modeling)
from codegen.cst_nodes import bound_name as _bound_name, targets as _targets, walk as _walk
from codegen.errors import GenerationError

def verify_outputs(outputs) -> None:
    """Parse every Python output (a `codegen.files.Output`) and check its claims (GN1, GN4); the first
    violation raises. A Python output that declares no claims is held to the strictest: constants only."""
    for out in outputs:
        if out.path.endswith(".py"):
            verify_python(out.path, out.content, out.claims or DATA_CLAIMS)


def verify_python(path: str, text: str, claims: Claims | None = None) -> None:
    """Parse `text` (GN4) and, given claims, check them (GN1); raise `GenerationError` naming path:line."""
    import libcst  # lazily: a `check` with nothing to write never pays for it

    try:
        module = libcst.parse_module(text)
    except libcst.ParserSyntaxError as exc:
        raise GenerationError(f"{path}:{exc.raw_line}: the template rendered invalid Python: {exc.message}") from None
    if claims is not None:
        _Checker(path, module, claims).run()


@dataclass
class _Import:
    node: object
    module: str          # absolute dotted name, or "." / ".." prefixed for relative imports
    names: tuple[str, ...] | None   # None: `import X` (the module itself); ("*",): a star import


class _Checker:
    def __init__(self, path: str, module, claims: Claims):
        self.path, self.module, self.claims = path, module, claims
        self._positions = None

    # -- reporting ---------------------------------------------------------------------------------
    def positions(self):
        if self._positions is None:
            import libcst.metadata as meta

            # Positions are computed only when a claim fails: the clean path never pays for them.
            wrapper = meta.MetadataWrapper(self.module, unsafe_skip_copy=True)
            self._positions = wrapper.resolve(meta.PositionProvider)
        return self._positions

    def line(self, node) -> int:
        return 1 if node is None else self.positions()[node].start.line

    def fail(self, node, claim: str, detail: str, rule: str = "GN1") -> None:
        raise GenerationError(f"{self.path}:{self.line(node)}: claim '{claim}' does not hold: {detail} (RULES {rule})")

    # -- collection ----------------------------------------------------------------------------------
    def run(self) -> None:
        import libcst

        imports: list[_Import] = []
        calls: list[tuple[object, str]] = []
        code = self.module.code_for_node
        for node in _walk(self.module):
            if isinstance(node, libcst.Import):
                imports += [_Import(node, code(alias.name), None) for alias in node.names]
            elif isinstance(node, libcst.ImportFrom):
                dots = "." * len(node.relative)
                name = dots + (code(node.module) if node.module is not None else "")
                names = ("*",) if isinstance(node.names, libcst.ImportStar) else tuple(code(a.name) for a in node.names)
                imports.append(_Import(node, name, names))
            elif isinstance(node, libcst.Call):
                func = node.func
                if isinstance(func, libcst.Name):
                    calls.append((node, func.value))
                elif isinstance(func, libcst.Attribute):
                    calls.append((node, func.attr.value))
        if self.claims.kind == GENERIC:
            self.check_generic(imports)
        elif self.claims.kind in (SPECIALIZED, DRAFT):
            self.check_imports(imports)
            for node, name in calls:
                if name in DYNAMIC_LOADERS:
                    self.fail(node, "a specialized build is pre-bound", f"it calls {name}(), which loads code by name at run time")
            self.check_constants()
        # Last, so that a broken template claim above is reported by its own, more specific message.
        self.check_allowed(imports)

    # -- the allow-list (GN4) --------------------------------------------------------------------------
    def check_allowed(self, imports: list[_Import]) -> None:
        """Every name is bound by the module or an allowed builtin, every attribute an allowed one, every
        import one its kind may make: what a declaration value could smuggle in names something else."""
        import libcst

        kind = self.claims.kind
        for imp in imports:
            root = imp.module.split(".")[0]
            if kind == DATA or (kind == ROOT and root not in ROOT_IMPORTS and not imp.module.startswith(".")):
                self.fail(imp.node, "imports only what its kind may", f"it imports {imp.module}", "GN4")
        bound, definitions, called, dotted, refused = set(), set(), set(), set(), []
        for node in _walk(self.module):
            if id(node) in dotted:
                continue   # a module path inside an import statement
            if isinstance(node, (libcst.Import, libcst.ImportFrom)):
                for alias in node.names if not isinstance(node.names, libcst.ImportStar) else ():
                    bound.add(_bound_name(alias))
                inside = [n for n in _walk(node) if n is not node]
                dotted.update(id(n) for n in inside)
                definitions.update(id(n) for n in inside if isinstance(n, libcst.Name))
            elif isinstance(node, (libcst.FunctionDef, libcst.ClassDef, libcst.Param)):
                bound.add(node.name.value)
                definitions.add(id(node.name))
            elif isinstance(node, libcst.AsName):
                bound.update(_targets(node.name))
                definitions.add(id(node.name))
            elif isinstance(node, (libcst.AssignTarget, libcst.AnnAssign, libcst.AugAssign, libcst.NamedExpr)):
                bound.update(_targets(node.target))
            elif isinstance(node, (libcst.For, libcst.CompFor)):
                bound.update(_targets(node.target))
            elif isinstance(node, libcst.Arg) and node.keyword is not None:
                definitions.add(id(node.keyword))
            elif isinstance(node, libcst.Attribute):
                definitions.add(id(node.attr))
                if node.attr.value not in ATTRIBUTES[kind]:
                    refused.append((node, "uses only the runtime API its kind may", f"it reads the attribute .{node.attr.value}"))
            elif isinstance(node, (libcst.Global, libcst.Nonlocal)):
                definitions.update(id(item.name) for item in node.names)
            elif isinstance(node, libcst.Call) and isinstance(node.func, libcst.Name):
                called.add(id(node.func))
        allowed = bound | BUILTINS[kind]
        for node in _walk(self.module):
            if isinstance(node, libcst.Name) and id(node) not in definitions and node.value not in allowed:
                what = f"it calls {node.value}()" if id(node) in called else f"it names {node.value}"
                refused.append((node, "names only what it binds, imports or an allowed builtin", what))
        if refused:
            # The first offence in the text; of nested ones starting together, the innermost (`a.b` of `a.b.c`).
            where = self.positions()
            node, claim, detail = min(refused, key=lambda r: (where[r[0]].start.line, where[r[0]].start.column,
                                                             where[r[0]].end.line, where[r[0]].end.column))
            self.fail(node, claim, detail, "GN4")

    # -- imports ---------------------------------------------------------------------------------------
    def check_imports(self, imports: list[_Import]) -> None:
        """Only torch, runtime ops and the bound experts classes; never the resolver (GN1)."""
        allowed = "imports only torch, runtime ops and its bound experts classes"
        seen: dict[str, set[str]] = {}
        first_experts = None
        for imp in imports:
            mod = imp.module
            root = mod.split(".")[0]
            if root == "registry":
                self.fail(imp.node, "never imports the resolver", f"it imports {mod}")
            if mod == "__future__" or root == "torch":
                continue
            if mod.startswith("."):
                # draft.py reads its target's constants and layer builders from the sibling modeling.py.
                if self.claims.kind == DRAFT and mod == ".modeling":
                    continue
                self.fail(imp.node, allowed, f"it imports {mod}")
            if root != "runtime":
                self.fail(imp.node, allowed, f"it imports {mod}")
            targets = [mod] if imp.names is None or mod != "runtime" else [f"runtime.{n}" for n in imp.names]
            for target in targets:
                parts = target.split(".")
                if len(parts) > 1 and parts[1] == "kernels":
                    self.fail(imp.node, allowed, f"it imports {target} (kernels are reached through the bound experts classes)")
                if len(parts) < 2 or parts[1] != "experts" or target == EXPERTS_CONTRACT:
                    continue
                if target not in self.claims.experts:
                    self.fail(imp.node, "imports exactly its bound experts classes",
                              f"it imports {target}, which holds none of its bound classes ({_classes(self.claims)})")
                if imp.names is None or imp.names == ("*",) or mod == "runtime":
                    self.fail(imp.node, "imports exactly its bound experts classes",
                              f"it imports the module {target} instead of naming the bound classes it uses")
                first_experts = first_experts or imp.node
                seen.setdefault(target, set()).update(imp.names)
        got = {m: frozenset(n) for m, n in seen.items()}
        if got != self.claims.experts:
            self.fail(first_experts, "imports exactly its bound experts classes",
                      f"it imports {_describe(got)}; its plan binds {_classes(self.claims)}")

    def check_generic(self, imports: list[_Import]) -> None:
        """A generic build resolves at load through registry.generic and names no experts class (GN1)."""
        if not any(imp.module == "registry.generic" for imp in imports):
            self.fail(None, "a generic build resolves through registry.generic", "it does not import registry.generic")
        for imp in imports:
            root = imp.module.split(".")[0]
            # ".modeling": a generic draft.py reads its sibling generic build's constants and layer builders.
            if root not in ("__future__", "torch", "runtime") and imp.module not in ("registry.generic", "..facts", ".modeling"):
                self.fail(imp.node, "a generic build imports only torch, the runtime, registry.generic, its facts and its modeling",
                          f"it imports {imp.module}")
            targets = [imp.module] if imp.module != "runtime" or imp.names is None else [f"runtime.{n}" for n in imp.names]
            for target in targets:
                if target.startswith("runtime.experts") and target != EXPERTS_CONTRACT:
                    self.fail(imp.node, "a generic build imports no experts class directly", f"it imports {target}")

    # -- constants -------------------------------------------------------------------------------------
    def check_constants(self) -> None:
        c = self.claims
        values = self.assignments()
        if c.kind == SPECIALIZED:
            self.expect(values, "MOE_IMPLS_HONORED", c.honored, "the target's honored ids")
            self.expect(values, "DRAFT_MOE_IMPLS_HONORED", c.draft_honored, "the target's honored draft ids")
            self.expect_layers(values)
        else:
            self.expect(values, "DRAFT_LAYERS", c.draft_layers, "the plan's draft layer table")
        self.expect_implementations(values)
        # TG4: a declared list of honored ids is a hard constraint on what a build binds.
        honored = c.honored if c.kind == SPECIALIZED else c.draft_honored
        outside = sorted(set(c.implementations) - set(honored)) if isinstance(honored, tuple) else []
        if outside:
            side = "MOE_IMPLS_HONORED" if c.kind == SPECIALIZED else "its target's DRAFT_MOE_IMPLS_HONORED"
            self.fail(values["IMPLEMENTATIONS"][0], "binds only honored ids",
                      f"it binds {', '.join(outside)}, which {side} {honored!r} does not list (TG4)")

    def assignments(self) -> dict[str, list]:
        """Top-level `NAME = value` statements, by name (a constant assigned twice is reported)."""
        import libcst

        found: dict[str, list] = {}
        for stmt in self.module.body:
            if not isinstance(stmt, libcst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, libcst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, libcst.Name):
                    found.setdefault(small.targets[0].target.value, []).append(small)
                elif isinstance(small, (libcst.AnnAssign, libcst.AugAssign)) and isinstance(small.target, libcst.Name):
                    found.setdefault(small.target.value, []).append(small)
        return found

    def single(self, values, name: str):
        nodes = values.get(name, [])
        if not nodes:
            self.fail(None, f"{name} equals the plan", f"{name} is not assigned at the top of the file")
        if len(nodes) > 1 or not hasattr(nodes[0], "targets"):
            self.fail(nodes[-1], f"{name} equals the plan", f"{name} is assigned {len(nodes)} times; a constant is assigned once")
        return nodes[0]

    def expect(self, values, name: str, expected, what: str) -> None:
        node = self.single(values, name)
        try:
            actual = ast.literal_eval(self.module.code_for_node(node.value))
        except (ValueError, SyntaxError):
            self.fail(node, f"{name} equals the plan", f"{name} is not a literal")
        self.compare(node, name, actual, expected, what)

    def expect_layers(self, values) -> None:
        """`LAYERS`: runs `(range(start, stop), id)`, read from the tree (range's two integers, the id a literal)."""
        import libcst

        node = self.single(values, "LAYERS")
        claim, runs = "LAYERS equals the plan", []
        elements = node.value.elements if isinstance(node.value, libcst.Tuple) else None
        for element in elements if elements is not None else [node]:
            run = element.value
            call = run.elements[0].value if isinstance(run, libcst.Tuple) and len(run.elements) == 2 else None
            ok = (isinstance(call, libcst.Call) and isinstance(call.func, libcst.Name) and call.func.value == "range"
                  and len(call.args) == 2 and all(a.keyword is None and isinstance(a.value, libcst.Integer) for a in call.args))
            try:
                impl = ast.literal_eval(self.module.code_for_node(run.elements[1].value)) if ok else None
            except (ValueError, SyntaxError):
                ok = False
            if not ok:
                self.fail(element, claim, "each run reads (range(start, stop), 'id' or None)")
            runs.append((range(*(int(a.value.value) for a in call.args)), impl))
        self.compare(node, "LAYERS", tuple(runs), self.claims.layers, "the plan's layer table", table=True)

    def compare(self, node, name: str, actual, expected, what: str, table: bool = False) -> None:
        if actual == expected and type(actual) is type(expected):
            return
        table = table or (isinstance(expected, tuple) and len(expected) > 3)
        if table and isinstance(actual, tuple) and isinstance(expected, tuple) and len(actual) == len(expected):
            # A table: name the first entry that differs rather than printing both tables.
            i = next(k for k, (a, e) in enumerate(zip(actual, expected)) if a != e or type(a) is not type(e))
            self.fail(node, f"{name} equals the plan", f"{name}[{i}] = {actual[i]!r}, but in {what} it is {expected[i]!r}")
        if table and isinstance(actual, tuple) and isinstance(expected, tuple):
            self.fail(node, f"{name} equals the plan", f"{name} has {len(actual)} entries, but {what} has {len(expected)}")
        self.fail(node, f"{name} equals the plan", f"{name} = {actual!r}; {what}: {expected!r}")

    def expect_implementations(self, values) -> None:
        import libcst

        node = self.single(values, "IMPLEMENTATIONS")
        claim = "IMPLEMENTATIONS equals the plan"
        if not isinstance(node.value, libcst.Dict):
            self.fail(node, claim, "IMPLEMENTATIONS is not a dict display")
        got = {}
        for element in node.value.elements:
            if not isinstance(element, libcst.DictElement):
                self.fail(node, claim, "IMPLEMENTATIONS unpacks another mapping")
            value = element.value
            try:
                key = ast.literal_eval(self.module.code_for_node(element.key))
                ok = isinstance(value, libcst.Tuple) and len(value.elements) == 2 and isinstance(value.elements[0].value, libcst.Name)
                backend = ast.literal_eval(self.module.code_for_node(value.elements[1].value)) if ok else None
            except (ValueError, SyntaxError):
                ok = False
            if not ok:
                self.fail(element, claim, "each entry reads 'id': (ExpertsClass, 'BACKEND')")
            if key in got:
                self.fail(element, claim, f"{key!r} is listed twice")
            got[key] = (value.elements[0].value.value, backend)
        if got != self.claims.implementations:
            self.fail(node, claim, f"it binds {_describe_impls(got)}; the plan binds {_describe_impls(self.claims.implementations)}")


def _classes(claims: Claims) -> str:
    return _describe(claims.experts) or "no experts class"


def _describe(modules: dict) -> str:
    return "; ".join(f"{m}: {', '.join(sorted(n))}" for m, n in sorted(modules.items())) or "nothing"


def _describe_impls(impls: dict) -> str:
    return ", ".join(f"{i} -> {c} ({f})" for i, (c, f) in sorted(impls.items())) or "nothing"


def verify_tree(root: Path, plans, registry) -> list[str]:
    """Check the claims on a generated tree as it is on disk; return the files checked.

    `plans` are the build plans whose files live under `root` (`<model>/<target>/...`); every model
    folder's `generic/modeling.py` is checked as a generic build, the root package's `__init__.py` and
    `run.py` as its code, and every other Python file as constants only. A violation raises `GenerationError`.
    """
    claims: dict[str, Claims] = {"__init__.py": ROOT_CLAIMS, "run.py": ROOT_CLAIMS}
    for plan in plans:
        base = f"{plan.model}/{plan.target}"
        claims[f"{base}/modeling.py"] = claims_for_modeling(plan, registry)
        if plan.draft is not None:
            claims[f"{base}/draft.py"] = claims_for_draft(plan, registry)
    for path in [*root.glob("*/generic/modeling.py"), *root.glob("*/generic/draft.py")]:
        claims[path.relative_to(root).as_posix()] = GENERIC_CLAIMS
    checked = []
    for rel in sorted({p.relative_to(root).as_posix() for p in root.rglob("*.py")} | set(claims)):
        verify_python(rel, (root / rel).read_text(encoding="utf-8"), claims.get(rel, DATA_CLAIMS))
        checked.append(rel)
    return checked
