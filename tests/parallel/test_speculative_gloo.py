"""Speculative decoding under tensor parallelism (issue 16 item 3) on two gloo ranks: the MTP draft of
tiny_deepseek_v3 and an always-agreeing external drafter, at tp2 and tp2_moetp1ep2, give exactly the greedy
tokens of the one-process build (RULES SD1), with the acceptance counts a drafter of the target's own weights
must reach. (`dep<N>` is refused before any rank starts: tests/generated/test_speculative.py.)

fp32 builds on the VANILLA experts: the sharded sums differ from the whole ones by fp32 summation order only
(2e-7 to 5e-7 relative, measured for tiny_qwen3_moe: tests/parallel/common.py), so the tokens must match
exactly; a near-tie flipped by that order would show here as a failure. The oracle is the tp1 build's
uncached greedy decoding: a full forward over everything so far for each new token, no cache, no draft.
"""
from __future__ import annotations

import math

import pytest
import torch

from generated import load_model, run
from runtime.processes import launch
from runtime.speculative import ExternalDrafter, Speculation, vocab_size
from tests.generated.builds import greedy_reference

MODEL, SM, CHECKPOINT = "tiny_deepseek_v3", 90, "tiny_deepseek_v3_bf16"
LAYOUTS = ("tp2", "tp2_moetp1ep2")
NEW = 32
PROMPT = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(11))


def _load(parallel: str, checkpoint: str, rank: int = 0, device: str = "cpu", draft: bool = True):
    spec = {"speculative_config": {"mode": "mtp"}} if draft else {}
    return load_model(MODEL, SM, parallel, checkpoint=checkpoint, checkpoint_name=CHECKPOINT, device=device,
                      rank=rank, dtype=torch.float32, moe_config={"backend": "VANILLA"}, **spec).eval()


def _report(out) -> tuple:
    return out.tokens, out.rounds, out.proposed, out.accepted


def _speculative_rank(rank: int, world: int, device: str, checkpoint: str) -> dict:
    results = {}
    for parallel in LAYOUTS:
        target = _load(parallel, checkpoint, rank, device)
        for k in (1, 3):
            results[parallel, "mtp", k] = _report(target.generate(PROMPT, NEW, speculative=k))
        twin = _load(parallel, checkpoint, rank, device, draft=False)
        results[parallel, "twin", 3] = _report(target.generate(PROMPT, NEW, speculative=Speculation(3, ExternalDrafter(twin, target))))
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-deepseek-v3")
    run.write_tiny(MODEL, SM, CHECKPOINT, folder, seed=0)   # the launcher's --tiny checkpoint, MTP layer included
    return str(folder)


@pytest.mark.slow
def test_speculative_decoding_under_tensor_parallelism_gives_the_one_process_greedy_tokens(checkpoint):
    whole = _load("tp1", checkpoint)
    assert vocab_size(whole) == 512
    expected = greedy_reference(whole, PROMPT, NEW)
    results = launch(_speculative_rank, 2, (checkpoint,), timeout_s=60, job_timeout_s=600, preload=run.PRELOAD)[0]
    assert sorted(results) == sorted((p, kind, k) for p in LAYOUTS for kind, k in (("mtp", 1), ("mtp", 3), ("twin", 3)))
    for (parallel, kind, k), (tokens, rounds, proposed, accepted) in results.items():
        what = f"{parallel} {kind} k={k}"
        assert torch.equal(tokens, expected), what
        assert proposed == k * rounds, what
        if kind == "twin":   # the target's own weights propose the target's tokens: all accepted
            assert rounds == math.ceil((NEW - 1) / (k + 1)) and accepted == proposed, what

