"""Rendering: templates (jinja2, StrictUndefined) turn plans into file contents. Pure: no file I/O here.

Every value that reaches generated code goes through the `py` filter (a Python literal via repr, with
dict keys sorted), so no string from a declaration is ever pasted into code unquoted (names are also
checked as identifier-safe tokens when declarations load); text inside a docstring goes through `doc`,
which no value can end. Rendered Python is parsed and its claims
checked by `codegen.verify` before it is written (RULES GN1, GN4), not here: what `check` finds
unchanged on disk was verified when it was written.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jinja2

from codegen.errors import GenerationError
from codegen.headers import normalize, printable, python_header
from codegen.plan import layer_runs
from families import ROOT as FAMILY_TEMPLATES

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def py(value) -> str:
    """A deterministic Python literal: dicts with sorted keys, tuples and lists as written."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py(v) for v in value)
        if isinstance(value, tuple):
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(value, float):
        # TOML has nan and inf, whose repr is a bare name in Python: spell them as expressions.
        # A bare `nan` would parse and then fail with NameError when the build is imported.
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "-float('inf')"
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    raise TypeError(f"cannot render {type(value).__name__} into generated code")


def doc(text) -> str:
    """`text` as it may stand inside a triple-quoted docstring: backslashes, double quotes and any
    non-printable character (a line break included) escaped, so no value can end the docstring (GN4)."""
    return printable(str(text).replace("\\", "\\\\").replace('"', '\\"'))


def py_block(value, indent: int = 0, width: int = 110, fill: bool = False) -> str:
    """`py`, but a dict, list or tuple too long for one line gets one item per line (reviewable diffs);
    with `fill`, a sequence of scalars (a table of like values: honored ids, per-layer windows) is packed
    instead, as many items a line as fit in `width - indent`."""
    flat = py(value)
    if indent + len(flat) <= width or not isinstance(value, (dict, list, tuple)) or not value:
        return flat
    return _lines(value, indent, width, fill)


def _lines(value, indent: int, width: int, fill: bool) -> str:
    """A non-empty dict, list or tuple one item a line (`fill`: scalars packed), its closing bracket at `indent`."""
    pad, inner = " " * indent, " " * (indent + 4)
    if isinstance(value, dict):
        items = []
        for k, v in sorted(value.items()):
            # A value stays after its key when it fits there whole; broken, its lines start at the next indent
            # and so have the whole width, not what the key leaves.
            head, flat = f"{inner}{py(k)}: ", py(v)
            whole = len(head) + len(flat) <= width or not isinstance(v, (dict, list, tuple)) or not v
            items.append(head + (flat if whole else _lines(v, indent + 4, width, fill)) + ",")
        return "{\n" + "\n".join(items) + f"\n{pad}}}"
    opening, closing = ("(", ")") if isinstance(value, tuple) else ("[", "]")
    if fill and not any(isinstance(v, (dict, list, tuple)) for v in value):
        lines = [""]
        for item in (py(v) for v in value):
            if lines[-1] and len(lines[-1]) + len(item) + 2 > width - indent:
                lines.append("")
            lines[-1] += item + ", "
        return opening + "\n" + "\n".join(f"{inner}{line.rstrip()}" for line in lines) + f"\n{pad}{closing}"
    items = [f"{inner}{py_block(v, indent + 4, width, fill)}," for v in value]
    return opening + "\n" + "\n".join(items) + f"\n{pad}{closing}"


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        # The base templates, then each family's folder (`<family>/modeling.py.j2`).
        loader=jinja2.FileSystemLoader([str(TEMPLATES), str(FAMILY_TEMPLATES)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        auto_reload=False,   # one process renders one tree: never stat a template twice
    )
    env.filters["py"] = py
    env.filters["py_block"] = py_block
    env.filters["doc"] = doc
    env.filters["layer_runs"] = layer_runs
    return env


def render_python(template: str, path: str, command: str, fingerprint: str | None, what: str, **context) -> str:
    """Render a Python template with the generated header and normalize it (GN2); `path` names it in errors."""
    header = python_header(command, fingerprint, what)
    try:
        text = environment().get_template(template).render(header=header, **context)
    except jinja2.UndefinedError as exc:
        raise GenerationError(f"{path}: template {template} uses an undefined value: {exc.message} (RULES GN4)") from None
    return normalize(text)
