"""Rendering: templates (jinja2, StrictUndefined) turn plans into file contents. Pure: no file I/O here.

Every value that reaches generated code goes through the `py` filter (a Python literal via repr, with
dict keys sorted), so no string from a declaration is ever pasted into code unquoted (names are also
checked as identifier-safe tokens when declarations load).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from codegen.files import normalize, python_header, verify_python

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
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    raise TypeError(f"cannot render {type(value).__name__} into generated code")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = py
    return env


def render_python(template: str, path: str, command: str, fingerprint: str, what: str, **context) -> str:
    """Render a Python template with the generated header, normalize it and parse it (GN2, GN4)."""
    header = python_header(command, fingerprint, what)
    text = normalize(environment().get_template(template).render(header=header, **context))
    verify_python(path, text)
    return text
