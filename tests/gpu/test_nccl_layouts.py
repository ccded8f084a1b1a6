"""A tp2_moetp1ep2 build of tiny_qwen3_moe on two GPUs under NCCL reproduces its single-GPU logits: issue 5's check on real GPUs.

The CPU tests (tests/parallel/) prove the layouts on gloo; this proves the same launcher, builds and
collectives on NCCL, where communicators, device placement and the bf16 kernels differ. One GPU runs
the tp1 build, two GPUs run tp2_moetp1ep2 (the specialized build, and the generic build taking the
layout at load), all loading one seeded tiny checkpoint; plus the fp32 VANILLA generic build on both
sides, where the sharded sum must match to fp32 precision (tolerances: tests/parallel/common.py).

Run on a host with two GPUs (torch >= 2.11 with CUDA, safetensors, pydantic), from the repository root:

    python tests/gpu/test_nccl_layouts.py            # or: python -m pytest tests/gpu/test_nccl_layouts.py -s

Every process runs with NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set here, before
torch loads, and passed to each rank by the launcher). The result goes to stdout and, when $OUT is
set, to $OUT/nccl_layouts.json.
"""
import os

# Before torch is imported anywhere in this process; spawned ranks inherit them (and the launcher
# sets them again for every CUDA rank).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages, and the ranks inherit it

import torch  # noqa: E402

try:
    import pytest
except ImportError:  # a plain script run on a host without pytest
    pytest = None

# tp2_moetp1ep2: attention TP + expert parallel (one all-reduce); dep2: attention data parallel + expert
# parallel (all-to-all dispatch and combine).
MODEL, CHECKPOINT, PARALLELS = "tiny_qwen3_moe", "tiny_qwen3_moe_bf16", ("tp2_moetp1ep2", "dep2")


def run_check(device: str = "cuda", parallel: str = PARALLELS[0]) -> dict:
    """Both runs, compared; returns the record written to $OUT/nccl_layouts.json (`device="cpu"`: the
    same check on gloo, to try the script without GPUs)."""
    from generated import run
    from runtime.launch import ForwardJob, forward_jobs, launch
    from tests.parallel import common

    start = time.monotonic()
    cuda = device == "cuda"
    # tiny_qwen3_moe's targets are declared for sm_90 (H100/H200); on another SM the generic build serves.
    sm = torch.cuda.get_device_capability(0)[0] * 10 + torch.cuda.get_device_capability(0)[1] if cuda else 90
    tokens = common.TOKENS
    record = {
        "check": f"{MODEL} {parallel} on 2 ranks vs tp1 on 1 rank, {device} ({'NCCL' if cuda else 'gloo'})",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
        "sm": sm,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="moegen-nccl-") as folder:
        run.write_tiny(MODEL, sm, CHECKPOINT, folder, seed=0)

        def job(parallel, mode, fp32=False):
            return ForwardJob(MODEL, sm, parallel, folder, CHECKPOINT, tokens, mode=mode,
                              loader=common.load_fp32_reference if fp32 else None)

        kinds = [("auto", False, "bf16, specialized when sm_90"), ("off", False, "bf16, generic"),
                 ("off", True, "fp32 VANILLA, generic")]
        one = launch(forward_jobs, 1, (run.load_model, [job("tp1", "auto"), job("tp1", "off", True)]),
                     device=device, timeout_s=120, job_timeout_s=240)[0]
        two = launch(forward_jobs, 2, (run.load_model, [job(parallel, mode, fp32) for mode, fp32, _ in kinds]),
                     device=device, timeout_s=120, job_timeout_s=240)[0]
    references = {False: one[0], True: one[1]}
    ok = True
    for (mode, fp32, label), got in zip(kinds, two):
        ref = references[fp32]
        errors = common.position_errors(got["logits"], ref["logits"])
        within = float((errors < common.BF16_TOL).float().mean())
        passed = bool(errors.max() < common.FP32_TOL) if fp32 else bool(
            within >= common.BF16_WITHIN and errors.max() < common.BF16_FLIP_TOL)
        ok &= passed
        record["runs"].append({
            "run": label, "build": got["build"], "reference_build": ref["build"], "dtype": got["dtype"],
            "max_relative_error": float(errors.max()), "positions_within_bf16_tol": within, "passed": passed,
            "tolerance": common.FP32_TOL if fp32 else
            f"{common.BF16_WITHIN:.0%} of positions < {common.BF16_TOL}, all < {common.BF16_FLIP_TOL}",
        })
    record["ok"] = ok
    record["wall_s"] = round(time.monotonic() - start, 1)
    return record


def _report(record: dict, parallel: str) -> None:
    text = json.dumps(record, indent=2)
    print(text)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / f"nccl_layouts_{parallel}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"written to {out}")


if pytest is not None:

    @pytest.mark.gpu
    @pytest.mark.slow
    @pytest.mark.parametrize("parallel", PARALLELS)
    def test_a_two_gpu_layout_reproduces_the_single_gpu_logits(parallel):
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA GPUs")
        record = run_check(parallel=parallel)
        _report(record, parallel)
        assert record["ok"], json.dumps(record["runs"], indent=2)


if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        sys.exit(f"needs two CUDA GPUs; this host has {torch.cuda.device_count()}")
    results = [run_check(parallel=p) for p in PARALLELS]
    for p, result in zip(PARALLELS, results):
        _report(result, p)
    sys.exit(0 if all(r["ok"] for r in results) else 1)
