"""Every layout of issue 5 runs on gloo ranks and reproduces the one-process logits, specialized and generic build alike.

One launch per world size runs all of that world's builds in turn (process groups are created once per
layout and re-selected at each forward), so the 2-core CI host pays for three worlds, not fifteen. Each
rank builds through `generated.load_model(..., rank=r)` as `python -m generated.run` does, reads its
shard of the session's tiny checkpoint and runs its replica's rows; rank 0 returns the whole batch's
logits. Two claims per layout (tolerances and their reasons: tests/parallel/common.py):

- the bf16 builds users run (the target's specialized build, and the generic build taking the layout
  at load) match the tp1 specialized build within bf16 rounding;
- the sharding itself is exact: the generic build in fp32 on the VANILLA reference experts matches its
  tp1 self to fp32 precision.
"""
import pytest

from generated import run
from runtime.launch import forward_jobs, launch
from tests.parallel import common

WORLDS = {
    2: [("tiny_qwen3_moe", "tp2"), ("tiny_qwen3_moe", "tp2_moetp1ep2"), ("tiny_qwen3_moe", "dep2")],
    4: [("tiny_qwen3_moe", "tp4_moetp2ep2")],     # two key/value heads replicated over four ranks
    16: [("tiny_kimi_k3", "tp16_moetp4ep4")],     # kimi_k3's own layout: MLA, one head per rank, MXFP4 experts
}
# (mode, fp32): require = the target's specialized build (inlined LAYOUT) or fail; off = the generic build.
RUNS = {("require", False): "specialized bf16", ("off", False): "generic bf16", ("off", True): "generic fp32 VANILLA"}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(WORLDS))
def test_sharded_builds_reproduce_the_one_process_logits(world, checkpoints, references):
    jobs, labels = [], []
    for model, parallel in WORLDS[world]:
        for mode, fp32 in RUNS:
            jobs.append(common.job(model, parallel, checkpoints[model], mode, fp32))
            labels.append((model, parallel, mode, fp32))
    results = launch(forward_jobs, world, (run.load_model, jobs), timeout_s=60, job_timeout_s=180,
                     preload=run.PRELOAD)[0]
    assert len(results) == len(jobs)
    problems = []
    for (model, parallel, mode, fp32), result in zip(labels, results):
        target = f"{common.CHECKPOINT[model]}__sm_{common.SM[model]}__{parallel}"
        what = f"{target} ({RUNS[mode, fp32]})"
        expected_module = f"{target}.modeling" if mode == "require" else "generic.modeling"
        assert result["build"].endswith(expected_module), (what, result["build"])
        ref = references[model, fp32]
        assert result["logits"].shape == ref.shape, what
        errors = common.position_errors(result["logits"], ref)
        if fp32:
            if not errors.max() < common.FP32_TOL:
                problems.append(f"{what}: max relative error {errors.max():.3g} >= {common.FP32_TOL}")
        else:
            within = float((errors < common.BF16_TOL).float().mean())
            if within < common.BF16_WITHIN or not errors.max() < common.BF16_FLIP_TOL:
                problems.append(f"{what}: {within:.0%} of positions within {common.BF16_TOL}, "
                                f"max {errors.max():.3g}; per position {errors.tolist()}")
    assert not problems, "\n".join(problems)
