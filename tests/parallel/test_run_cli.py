"""`python -m generated.run` is the one launcher for users and tests: run as a command, and under torchrun, it reproduces the one-process logits.

Both runs use `--tiny` with the default seed, i.e. the same checkpoint the session's reference loads, and
`--logits-out` to hand rank 0's logits back; the command's first line names the target, the build that
ran and the world it ran on.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parallel import common

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [",".join(str(int(t)) for t in row) for row in common.TOKENS]


def _run(prefix: list[str], parallel: str, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [*prefix, "--model", "tiny_qwen3_moe", "--sm", "90", "--parallel", parallel, "--tiny",
            "--tokens", *TOKENS, "--timeout", "60", "--logits-out", str(out)]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def _check(done: subprocess.CompletedProcess, out: Path, target: str, ranks: str, reference: torch.Tensor) -> None:
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"{target}: generated.tiny_qwen3_moe.{target}.modeling on {ranks}"
    saved = torch.load(out, weights_only=False)
    assert saved["target"] == target and torch.equal(saved["tokens"], common.TOKENS)
    errors = common.position_errors(saved["logits"], reference)
    assert float((errors < common.BF16_TOL).float().mean()) >= common.BF16_WITHIN and errors.max() < common.BF16_FLIP_TOL


@pytest.mark.slow
def test_the_command_runs_a_layout_on_its_ranks(tmp_path, references):
    out = tmp_path / "logits.pt"
    done = _run([sys.executable, "-m", "generated.run", "--nproc", "2"], "tp2_moetp1ep2", out)
    _check(done, out, "tiny_qwen3_moe_bf16__sm_90__tp2_moetp1ep2", "2 ranks (gloo, cpu)",
           references["tiny_qwen3_moe", False])


@pytest.mark.slow
def test_under_torchrun_each_process_runs_as_the_rank_torchrun_made_it(tmp_path, references):
    out = tmp_path / "logits.pt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "generated.run"]
    done = _run(torchrun, "dep2", out, env={"OMP_NUM_THREADS": "1"})
    _check(done, out, "tiny_qwen3_moe_bf16__sm_90__dep2", "2 ranks (gloo, cpu)", references["tiny_qwen3_moe", False])
