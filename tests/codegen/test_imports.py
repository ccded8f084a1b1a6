"""What the check path imports (ARCHITECTURE "Rooms"; PERFORMANCE §3: `make check` with torch not imported).

Each claim runs in a fresh interpreter, so what this test process already imported cannot hide a
dependency.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.codegen.helpers import ROOT


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_check_path_never_imports_torch():
    # ARCHITECTURE: codegen never imports torch; `make check` runs on a bare host
    result = run(
        """
        import contextlib, io, sys
        from codegen.cli import main
        import codegen.generate, codegen.files, codegen.outputs, codegen.plan, codegen.render, codegen.verify
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(["check"])
        print("torch" in sys.modules, code in (0, 1))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_importing_the_check_path_does_not_load_libcst_until_something_needs_verifying():
    # PERFORMANCE §3: a clean check parses nothing; libcst is imported only to verify what would be written
    result = run(
        """
        import sys
        import codegen.cli, codegen.generate, codegen.files, codegen.outputs, codegen.verify
        print(sorted(m for m in ("torch", "libcst") if m in sys.modules))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
