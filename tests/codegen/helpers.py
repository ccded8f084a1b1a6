"""Shared pieces of the generator tests: a user's own small model, the CLI in-process, tree snapshots.

`MYMOE` is a two-layer mixtral-family model with two targets on sm_90: `tp1` honors only the TORCH
grouped GEMM (AUTO binds it, restricted to the honored set), `tp2` honors any implementation and is
built under backend TORCH (so what it binds does not move when a preferred backend is registered).
Its messages depend on nothing the project's own declarations may change, so they are asserted exactly.
"""

from __future__ import annotations

from pathlib import Path

from codegen.cli import main

ROOT = Path(__file__).resolve().parents[2]
GROUPED_BF16 = "torch.grouped_mm.grouped_gemm.bf16"
EAGER_BF16 = "torch.eager.loop.bf16"

MYMOE = """\
[model]
name = "mymoe"
family = "mixtral"
doc = "A user's own model."

[config]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_local_experts = 4
num_experts_per_tok = 2
num_attention_heads = 4
num_key_value_heads = 2

[[checkpoints]]
name = "mymoe_bf16"

[[targets]]
checkpoint = "mymoe_bf16"
sm = 90
parallel = "tp1"
moe_impls_honored = ["torch.grouped_mm.grouped_gemm.bf16"]

[[targets]]
checkpoint = "mymoe_bf16"
sm = 90
parallel = "tp2"
moe_impls_honored = "*"
selection = { backend = "TORCH" }
"""


def write_models(folder: Path, **declarations: str) -> Path:
    """A `--models` folder holding `<name>.toml` for each keyword."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in declarations.items():
        (folder / f"{name}.toml").write_text(text, encoding="utf-8")
    return folder


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run `python -m codegen ARGS` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` with its bytes and mtime (ns): what a command that writes nothing keeps."""
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def files(root: Path) -> dict[str, bytes]:
    return {k: v[0] for k, v in snapshot(root).items()}
