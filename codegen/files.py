"""Generated files on disk: write atomically and only on change, find drift, remove orphans (file I/O only).

`render` functions elsewhere are pure (text in, text out); this module is the only one that touches
the tree, so `generate` and `check` share one code path (RULES GN2, GN3). It verifies nothing: its
callers (`codegen.generate`) verify what `changed` and `check_outputs` find would be written before
anything is written, so a file whose bytes already match what was verified when it was written is
not parsed again, which is what keeps `make check` on a clean tree fast.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from codegen.errors import GenerationError
from codegen.headers import MARKER


@dataclass(frozen=True)
class Output:
    path: str       # relative, posix
    content: str
    claims: object = field(default=None, compare=False)   # codegen.claims.Claims of a build's model file

    @property
    def data(self) -> bytes:
        return self.content.encode("utf-8")


def _read(target: Path) -> bytes | None:
    try:
        return target.read_bytes() if target.is_file() else None
    except OSError as exc:
        raise GenerationError(f"cannot read {target}: {exc.strerror or exc}") from None


def symlink_on_path(root: Path, rel: str) -> Path | None:
    """The first of root/rel and the folders between root and it that is a symbolic link, else None.

    A generated file is a regular file inside its root: one read through a link is another file (or a
    folder outside the tree), whatever its bytes say.
    """
    path = root
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            return path
        if not path.exists():
            return None
    return None


def changed(outputs: list[Output], root: Path) -> list[Output]:
    """The outputs whose bytes differ from the file on disk (or that have none, or are reached through a link)."""
    return [o for o in outputs if symlink_on_path(root, o.path) is not None or _read(root / o.path) != o.data]


def write_verified(pending: list[Output], root: Path) -> list[str]:
    """Write each output atomically (replacing any link on its way); return the paths written.

    The caller verified them (`codegen.verify.verify_outputs`) and chose them (`changed`)."""
    written = []
    for out in pending:
        target = root / out.path
        try:
            _unlink_symlinks(root, out.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(target, out.data)
        except OSError as exc:
            raise GenerationError(f"cannot write {target}: {exc.strerror or exc}") from None
        written.append(out.path)
    return written


def _unlink_symlinks(root: Path, rel: str) -> None:
    """Remove each link on the way to root/rel (the link only: what it points to is outside the tree
    and never written through); the folders are then made as real ones."""
    while (link := symlink_on_path(root, rel)) is not None:
        link.unlink()


# A temp file of `_atomic_write`: `.<name>.moegen-<pid>-<random>.tmp`. The pid says whose it is: one
# whose process is gone was left by a killed write, and the next command that writes removes it.
_TEMP = re.compile(r"^\..+\.moegen-(\d+)-[^/]*\.tmp$")


def _atomic_write(target: Path, data: bytes) -> None:
    """Write beside the target and rename over it, so a failed write keeps the old file."""
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.moegen-{os.getpid()}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class Drift:
    missing: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)    # "path (link -> where it points)"
    diffs: list[str] = field(default_factory=list)
    pending: list[Output] = field(default_factory=list)   # what generate would write: for the caller to verify

    @property
    def clean(self) -> bool:
        return not (self.missing or self.stale or self.orphaned or self.linked)


def check_outputs(outputs: list[Output], root: Path, scan_orphans: bool = True, label: str = "") -> Drift:
    """Compare what would be generated with the tree, writing nothing (GN3).

    What would be written (missing, stale and linked files) is `drift.pending`, which the caller
    verifies as `generate` would before writing it. With
    `scan_orphans`, every other file under `root` is an orphan: a generated root holds exactly what
    the declarations produce. `label` prefixes the paths in the diff headers (e.g. `generated/`).
    """
    drift = Drift()
    pending = drift.pending
    for out in outputs:
        link = symlink_on_path(root, out.path)
        if link is not None:
            drift.linked.append(f"{out.path} ({label}{link.relative_to(root).as_posix()} -> {os.readlink(link)})")
            pending.append(out)
            continue
        committed = _read(root / out.path)
        if committed is None:
            drift.missing.append(out.path)
            pending.append(out)
            continue
        if committed != out.data:
            drift.stale.append(out.path)
            pending.append(out)
            drift.diffs.append(_diff(committed, out.content, label + out.path))
    if scan_orphans:
        drift.orphaned = orphans(outputs, root)
    return drift


def _diff(committed: bytes, generated: str, name: str) -> str:
    old = committed.decode("utf-8", errors="replace").splitlines(keepends=True)
    new = generated.splitlines(keepends=True)
    if [l.rstrip("\r\n") for l in old] == [l.rstrip("\r\n") for l in new]:
        # Only line ends differ (CRLF, a missing final newline): spell them out, or the diff reads as noise.
        old, new = [_visible(l) for l in old], [_visible(l) for l in new]
    lines = difflib.unified_diff(old, new, f"{name} (committed)", f"{name} (generated)")
    return "".join(l if l.endswith("\n") else l + "\n" for l in lines)


def _visible(line: str) -> str:
    body = line.rstrip("\r\n")
    return body + line[len(body):].replace("\r", "\\r").replace("\n", "\\n") + "\n"


def _stale(name: str) -> bool:
    found = _TEMP.match(name)
    if found is None:
        return False
    pid = int(found.group(1))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False   # alive, someone else's
    return False


def remove_stale_temps(folder: Path, recursive: bool = True) -> list[Path]:
    """Delete the temp files that a killed write of moegen left in `folder` (and below it)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    removed = []
    for directory, dirs, names in os.walk(folder) if recursive else [(str(folder), [], [p.name for p in folder.iterdir()])]:
        for name in names:
            path = Path(directory) / name
            if _stale(name) and path.is_file() and not path.is_symlink():
                path.unlink()
                removed.append(path)
    return removed


def _entries(root: Path) -> list[tuple[str, Path]]:
    """Every file and symbolic link under `root`, without following links (bytecode caches aside)."""
    found = []
    for directory, dirs, names in os.walk(root):
        base = Path(directory)
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names) + [d for d in dirs if (base / d).is_symlink()]:
            path = base / name
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def orphans(outputs: list[Output], root: Path) -> list[str]:
    """Files and links under `root` that no output produces (bytecode caches aside).

    A link to a folder that holds outputs is no orphan: those outputs are reported as reached through it.
    """
    if not root.is_dir():
        return []
    expected = {o.path for o in outputs}
    prefixes = {p.rsplit("/", i)[0] for p in expected for i in range(1, p.count("/") + 1)}
    return [rel for rel, path in _entries(root) if rel not in expected and not (path.is_symlink() and rel in prefixes)]


def remove_orphans(outputs: list[Output], root: Path) -> tuple[list[str], list[str]]:
    """Delete the orphans that carry the generated marker (so a hand-placed file is never lost), and
    every orphaned link (removing a link loses nothing; what it points to stays).

    Returns (removed, kept); folders left empty are removed too.
    """
    removed, kept = [], []
    for rel in orphans(outputs, root):
        path = root / rel
        if path.is_symlink():
            path.unlink()
            removed.append(rel)
            continue
        try:
            head = path.read_bytes()[:512]
        except OSError:
            head = b""
        if MARKER.encode() in head:
            path.unlink()
            removed.append(rel)
            parent = path.parent
            while parent != root and parent.is_dir() and not any(p.name != "__pycache__" for p in parent.iterdir()):
                for cache in parent.glob("__pycache__"):
                    for f in cache.iterdir():
                        f.unlink()
                    cache.rmdir()
                parent.rmdir()
                parent = parent.parent
        else:
            kept.append(rel)
    return removed, kept
