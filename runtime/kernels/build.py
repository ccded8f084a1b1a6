"""Compile the CUPY kernels with the host's nvcc: a CI check for every SM the registry declares, and
prebuilt cubins that a GPU machine loads instead of compiling (`MOEGEN_CUBIN_DIR`).

    python -m runtime.kernels.build --sm 90 --out DIR [--verbose]

Every GEMM variant any CUPY class can request is instantiated, so a clean build means every kernel
a build may launch compiles; `--verbose` prints ptxas' register and spill report per kernel.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import all_instances, cubin_name, source_text


def nvcc() -> str | None:
    return shutil.which("nvcc")


def compile_cubin(sm: int, out_dir: Path, verbose: bool = False) -> Path:
    """nvcc -cubin for sm_<sm> of the full source; returns the cubin path (named for the loader)."""
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc is not on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / cubin_name(sm)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "moe_kernels_all.cu"
        src.write_text(source_text(all_instances()))
        cmd = [compiler, f"-gencode=arch=compute_{sm},code=sm_{sm}", "-cubin", "-std=c++17", "-O3",
               "-o", str(target), str(src)]
        if verbose:
            cmd.insert(1, "-Xptxas=-v")
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed for sm_{sm}:\n{result.stderr}")
    if verbose:
        sys.stderr.write(result.stderr)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--sm", type=int, action="append", default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    for sm in args.sm or [90]:
        print(compile_cubin(sm, args.out, args.verbose))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
