"""Every family's tiny build, sharded over two gloo ranks under each two-rank layout kind, reproduces its one-process logits to fp32 precision.

The generic build of each family's tiny model (taking the layout at load) in fp32 on the VANILLA reference
experts, under tp2_moetp1ep2 (attention TP, experts split by EP), tp2_moetp2ep1 (every expert split by MoE
TP) and dep2 (attention data parallel, EP), on a checkpoint transformers wrote; plus a MiniMax-M2 variant
with one key/value head, replicated over both ranks with its qk-norm over the whole projection, built by
the CLI (tests/generated/builds.variant_build). One launch runs every build in turn. Each rank builds
through the loader `forward_jobs` calls, reads its shard of the full checkpoint and runs its replica's
rows; the reference is the same generic build on one rank in this process. Tolerance: common.FP32_TOL
(the sharded sums equal the whole one up to fp32 summation order); a weight read from another rank's
shard, or a reduction left out, is off by the logits' own size.
"""
import pytest
import torch

from generated import run
from runtime.launch import ForwardJob, forward_jobs, launch
from tests.generated import builds
from tests.parallel import common

LAYOUTS = ("tp2_moetp1ep2", "tp2_moetp2ep1", "dep2")
VARIANT = ("minimax_one_kv_head", "tiny_minimax_m2", {"num_key_value_heads": 1})


@pytest.mark.slow
def test_every_family_sharded_on_two_ranks_reproduces_its_one_process_logits():
    name, model, overrides = VARIANT
    _, variant_folder = builds.variant_build(name, model, **overrides)
    # (model, checkpoint name, checkpoint folder): every family's tiny model and the variant.
    cases = [(m, f"{m}_bf16", str(builds.transformers_checkpoint(m))) for m in sorted(builds.TINY.values())]
    cases.append((name, name, str(variant_folder)))
    tokens = builds.token_ids(min(builds.facts(m).CONFIG["vocab_size"] for m in builds.TINY.values()), batch=2, length=8)
    jobs, labels, references = [], [], {}
    for model_name, checkpoint_name, folder in cases:
        whole = common.load_fp32_reference(model_name, 90, "tp1", checkpoint=folder, checkpoint_name=checkpoint_name)
        with torch.no_grad():
            references[model_name] = whole.eval()(tokens).float()
        for layout in LAYOUTS:
            jobs.append(ForwardJob(model_name, 90, layout, folder, checkpoint_name, tokens, mode="off",
                                          loader=common.load_fp32_reference))
            labels.append((model_name, layout))
    results = launch(forward_jobs, 2, (run.load_model, jobs), timeout_s=60, job_timeout_s=480,
                     preload=run.PRELOAD, env={common.VARIANT_PATH_ENV: str(builds.variant_path())})[0]
    assert len(results) == len(jobs)
    problems = []
    for (model_name, layout), result in zip(labels, results):
        assert result["build"].endswith("generic.modeling"), (model_name, layout, result["build"])
        assert result["logits"].shape == references[model_name].shape
        errors = common.position_errors(result["logits"], references[model_name])
        if not errors.max() < common.FP32_TOL:
            problems.append(f"{model_name} {layout}: max relative error {errors.max():.3g} >= {common.FP32_TOL}")
    assert not problems, "\n".join(problems)
