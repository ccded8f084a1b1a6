"""Find the line of a TOML file that sets a given field, so validation errors can say file:line.

tomllib keeps no positions, so this reads the text the way our declaration files are written: table
headers (`[model]`, `[[targets]]`, `[targets.selection]`) and `key = value` lines. A field it cannot
place falls back to the line of its nearest enclosing table or key.
"""

from __future__ import annotations

import re

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r'^\s*("(?:[^"\\]|\\.)*"|[A-Za-z0-9_.-]+)\s*=')


def _split_key(key: str) -> tuple[str, ...]:
    if key.startswith('"'):
        return (key[1:-1],)
    return tuple(part.strip() for part in key.split("."))


def line_index(text: str) -> dict[tuple, int]:
    """Map each field path (`("targets", 1, "sm")`) to the 1-based line that sets it."""
    index: dict[tuple, int] = {}
    counts: dict[tuple, int] = {}
    table: tuple = ()
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header and not _KEY.match(line):
            parts = _split_key(header[2])
            if header[1] == "[[":
                n = counts.get(parts, -1) + 1
                counts[parts] = n
                table = parts + (n,)
            else:
                # A sub-table of the latest array element: [targets.selection] -> targets, n, selection.
                head = parts[:1]
                if head in counts:
                    table = head + (counts[head],) + parts[1:]
                else:
                    table = parts
            index.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            index.setdefault(table + _split_key(key[1]), number)
    return index


def line_of(text: str, loc: tuple) -> int:
    """The line of `loc`, or of its nearest enclosing field; 1 when nothing encloses it."""
    index = line_index(text)
    for end in range(len(loc), 0, -1):
        if tuple(loc[:end]) in index:
            return index[tuple(loc[:end])]
    return 1
