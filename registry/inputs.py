"""Read TOML and JSON of untrusted origin (declarations, selection files, checkpoint metadata) into plain data or one error naming the file.

Every reader of such a file goes through here, so each way a file can be wrong (missing, a directory,
a dangling link, not UTF-8, not parseable, nested beyond reason, a JSON document that is not an
object) gives one message and the caller's error type, never a traceback.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from registry.errors import DeclarationError, MoegenError

# No file this project reads nests deeper than a few levels; a bound keeps later recursive code
# (validation, rendering) from meeting a structure that exhausts the interpreter's stack.
MAX_DEPTH = 32

_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}


def kind(value) -> str:
    """A JSON value's kind as a user reads it: `an object`, `an array`, `a string`..."""
    return _KINDS.get(type(value), type(value).__name__)


def text_of_path(path) -> str:
    """A path as UTF-8 text for a file moegen writes: bytes a locale could not decode (kept by Python as
    surrogates, which no UTF-8 file can hold) read back as UTF-8, else as backslash escapes."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def read_bytes(path: Path, shown: str, error: type[MoegenError] = DeclarationError) -> bytes:
    """The bytes of a regular file; a missing file, a directory or a dangling link is one message."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        if os.path.islink(path):
            raise error(f"{shown}: a symbolic link to {os.readlink(path)}, which does not exist") from None
        raise error(f"{shown}: no such file") from None
    except IsADirectoryError:
        raise error(f"{shown}: a directory, where a file belongs") from None
    except OSError as exc:
        raise error(f"{shown}: cannot read it ({exc.strerror or exc})") from None


def decode(data: bytes, shown: str, error: type[MoegenError] = DeclarationError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{shown}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8") from None


def _check_depth(value, shown: str, error: type[MoegenError]) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise error(f"{shown}: nested more than {MAX_DEPTH} levels deep, deeper than any file moegen reads")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes, shown: str, error: type[MoegenError] = DeclarationError, what: str = "JSON") -> dict:
    """A JSON object from bytes (a file's, or a safetensors header's): UTF-8, standard numbers only."""
    text = decode(data, shown, error)
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{shown}: nested more than {MAX_DEPTH} levels deep, deeper than any file moegen reads") from None
    except ValueError as exc:
        raise error(f"{shown}: not valid {what}: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{shown}: holds {kind(value)}, where a {what} object belongs")
    _check_depth(value, shown, error)
    return value


def read_json(path: Path, shown: str | None = None, error: type[MoegenError] = DeclarationError) -> dict:
    """A JSON file whose document is an object."""
    shown = shown or str(path)
    return parse_json(read_bytes(path, shown, error), shown, error)


def read_toml(path: Path, shown: str | None = None, error: type[MoegenError] = DeclarationError) -> tuple[str, dict]:
    """A TOML file's text (for file:line messages) and its tables."""
    shown = shown or str(path)
    text = decode(read_bytes(path, shown, error), shown, error)
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise error(f"{shown}: nested more than {MAX_DEPTH} levels deep, deeper than any file moegen reads") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{shown}: not valid TOML: {exc}") from None
    _check_depth(data, shown, error)
    return text, data
