"""The hybrid families' recurrent mixers split over two gloo ranks by heads (Gated DeltaNet by key heads, Mamba-2 by
heads and B/C groups; their fused projections and convolutions read one chunk of each segment): the generic builds
of tiny_qwen3_next and tiny_nemotron_h under tp2_moetp1ep2 and tp2_moetp2ep1 reproduce their one-process logits on
a prompt longer than both chunked scans' chunks, and decode greedily through their sharded recurrent states to the
one-process greedy tokens.

Checkpoints: written by transformers (random weights). Builds: fp32 on the VANILLA experts (common.load_fp32_reference),
the reference the same build on one rank in this process. Tolerance: common.FP32_TOL (sharded sums equal the whole
one up to fp32 summation order); a wrong segment of a fused projection moves the logits by their own size.
"""
import pytest
import torch

from generated import run
from runtime.launch import ForwardJob, forward_jobs, launch
from tests.generated import builds
from tests.parallel import common

MODELS = ("tiny_nemotron_h", "tiny_qwen3_next")
LAYOUTS = ("tp2_moetp1ep2", "tp2_moetp2ep1")
NEW = 12


@pytest.mark.slow
def test_the_recurrent_mixers_split_by_heads_reproduce_the_one_process_build():
    tokens = builds.token_ids(512, batch=2, length=140, seed=7)   # > 128 (Mamba-2's chunk) and 64 (DeltaNet's)
    prompt = tokens[:, :9]
    jobs, labels, references = [], [], {}
    for model in MODELS:
        folder = str(builds.transformers_checkpoint(model))
        whole = common.load_fp32_reference(model, 90, "tp1", checkpoint=folder, checkpoint_name=f"{model}_bf16").eval()
        with torch.no_grad():
            references[model] = whole(tokens).float(), whole.generate(prompt, NEW).tokens
        for layout in LAYOUTS:
            for generate in (0, NEW):
                jobs.append(ForwardJob(model, 90, layout, folder, f"{model}_bf16", prompt if generate else tokens,
                                       mode="off", loader=common.load_fp32_reference, generate=generate))
                labels.append((model, layout, generate))
    results = launch(forward_jobs, 2, (run.load_model, jobs), timeout_s=60, job_timeout_s=480, preload=run.PRELOAD)[0]
    assert len(results) == len(jobs)
    problems = []
    for (model, layout, generate), result in zip(labels, results):
        assert result["layout"][0] == 2, (model, layout, result["layout"])
        logits, greedy = references[model]
        if generate:
            if not torch.equal(result["tokens"], greedy):
                problems.append(f"{model} {layout}: greedy tokens {result['tokens'].tolist()} != {greedy.tolist()}")
            continue
        errors = common.position_errors(result["logits"], logits)
        if not errors.max() < common.FP32_TOL:
            problems.append(f"{model} {layout}: max relative error {errors.max():.3g} >= {common.FP32_TOL}")
    assert not problems, "\n".join(problems)
