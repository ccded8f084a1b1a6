"""Reading a libcst tree without rebuilding it: every node under a root, and the names imports and assignments bind."""

from __future__ import annotations

# Fields that hold only whitespace, comments and punctuation: nothing a claim reads lives there.
_SKIP_FIELDS = frozenset({
    "header", "footer", "leading_lines", "lines_after_decorators", "trailing_whitespace", "whitespace_before",
    "whitespace_after", "whitespace_before_colon", "whitespace_after_colon", "whitespace_before_params",
    "whitespace_after_def", "whitespace_after_class", "whitespace_before_args", "whitespace_after_func",
    "whitespace_after_arg", "whitespace_after_star", "whitespace_after_star_star", "whitespace_after_import",
    "whitespace_before_import", "whitespace_after_from", "whitespace_after_as", "whitespace_before_as",
    "whitespace_after_in", "whitespace_before_in", "whitespace_before_equal", "whitespace_after_equal",
    "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace", "comma", "semicolon", "colon", "dot", "equal",
    "operator", "star", "indent", "newline", "asynchronous",
})


def walk(root):
    """Every node under `root`, found by reading fields (no visitor: libcst's visitors rebuild each
    node they pass, which costs several times the parse; this reads the tree and changes nothing)."""
    import libcst

    node_type = libcst.CSTNode
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        for name in node.__dataclass_fields__:
            if name in _SKIP_FIELDS:
                continue
            value = getattr(node, name)
            if isinstance(value, node_type):
                stack.append(value)
            elif isinstance(value, (list, tuple)):
                stack.extend(v for v in value if isinstance(v, node_type))


def bound_name(alias) -> str:
    """The name an import alias binds: `import a.b` binds `a`, `import a.b as c` and `from a import b as c` bind `c`."""
    import libcst

    node = alias.asname.name if alias.asname is not None else alias.name
    while isinstance(node, libcst.Attribute):
        node = node.value
    return node.value


def targets(node) -> set[str]:
    """The names an assignment target binds (a name, or names inside tuples and lists; not attributes)."""
    import libcst

    if isinstance(node, libcst.Name):
        return {node.value}
    if isinstance(node, (libcst.Tuple, libcst.List)):
        return set().union(*(targets(e.value) for e in node.elements)) if node.elements else set()
    if isinstance(node, libcst.StarredElement):
        return targets(node.value)
    return set()
