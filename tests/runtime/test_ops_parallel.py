"""The parallel layout as numbers, one-rank collectives, and the ops' shard metadata exercised on two gloo ranks.

Issue 5 owns multi-rank runs; these tests only establish that the ops are shard-ready: every family's
assembled model, built for each rank of `tp2_moetp1ep2`, `tp2_moetp2ep1` and `dep2` and loaded through
`param.shard`, reproduces the one-process logits (fp32, 2e-5 relative to the largest logit). MiniMax-M2
also runs with one key/value head, so that head is replicated on both ranks and its whole-projection
k-norm statistic is all-reduced over duplicates.
"""
from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime import parallel
from runtime.parallel import Layout

# --- Layout -----------------------------------------------------------------------------------------


def test_layout_numbers_ranks_as_documented():
    kimi = Layout(tp=16, moe_tp=4, ep=4)  # tp16_moetp4ep4
    assert kimi.world == 16
    assert [kimi.ep_rank(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert [kimi.moe_tp_rank(r) for r in (0, 3, 4, 15)] == [0, 3, 0, 3]
    assert kimi.tp_rank(5) == 5 and kimi.dp_rank(5) == 0
    dep4 = Layout(tp=1, moe_tp=1, ep=4, dp=4)
    assert [dep4.dp_rank(r) for r in range(4)] == [0, 1, 2, 3] and dep4.tp_rank(3) == 0
    mixed = Layout(tp=2, moe_tp=2, ep=2, dp=2)
    assert mixed.tp_group_ranks(1) == (2, 3) and mixed.dp_group_ranks(1) == (1, 3)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tp=2, moe_tp=1, ep=1), "must equal world"),
        (dict(tp=4, moe_tp=2, ep=4), "must equal world"),
        (dict(tp=0), "positive"),
    ],
)
def test_layout_refuses_inconsistent_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_layout_refuses_a_rank_outside_its_world():
    with pytest.raises(ValueError, match="outside"):
        Layout(tp=2, moe_tp=2).tp_rank(2)


def test_collectives_return_their_input_on_one_rank():
    assert not dist.is_initialized()
    x = torch.randn(3, 4)
    assert parallel.all_reduce(x) is x
    assert parallel.all_gather(x, dim=-1) is x
    assert parallel.reduce_scatter(x, dim=0, group=parallel.WORLD) is x
    assert parallel.group_size(parallel.TP) == 1 and parallel.group_rank(parallel.DP) == 0


def test_tensor_parallel_shards_are_tagged_for_the_loader():
    from runtime.ops import GQAttention, LMHead

    attn = GQAttention(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True,
                       sinks=True, qk_norm="projection", tp_rank=3, tp_size=4)
    shards = {n: getattr(p, "shard", None) for n, p in attn.named_parameters()}
    assert shards["q_proj.weight"] == (0, 3, 4) and shards["q_proj.bias"] == (0, 3, 4)
    assert shards["k_proj.weight"] == (0, 1, 2)  # 2 kv heads on 4 ranks: rank 3 holds head 1
    assert shards["k_norm.weight"] == (0, 1, 2) and shards["q_norm.weight"] == (0, 3, 4)
    assert shards["o_proj.weight"] == (1, 3, 4) and shards["o_proj.bias"] is None  # added once, after the sum
    assert shards["sinks"] == (0, 3, 4)
    single = LMHead(hidden_size=64, vocab_size=128)
    assert not hasattr(single.weight, "shard")  # one rank: nothing is a shard


# --- two gloo ranks ----------------------------------------------------------------------------------

LAYOUTS = {
    "tp2_moetp1ep2": Layout(tp=2, moe_tp=1, ep=2),
    "tp2_moetp2ep1": Layout(tp=2, moe_tp=2, ep=1),
    "dep2": Layout(tp=1, moe_tp=1, ep=2, dp=2),
}
CASES = [(f, {}) for f in ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "minimax_m2")]
CASES.append(("minimax_m2", dict(num_key_value_heads=1)))


def _worker(rank: int, world: int, work_dir: str) -> None:
    from tests.runtime.assemble import BUILDERS, load_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    errors = {}
    try:
        for i, (family, overrides) in enumerate(CASES):
            case = torch.load(os.path.join(work_dir, f"case{i}.pt"), weights_only=False)
            config = case["config"]
            for name, layout in LAYOUTS.items():
                parallel.init_process_groups(layout)
                model = BUILDERS[family](config, dtype=torch.float32, layout=layout, rank=rank).eval()
                load_checkpoint(model, case["tensors"], expert_parallel=layout.ep > 1)
                # Attention data parallel: replica d runs batch row d; otherwise both ranks run the batch.
                rows = slice(rank, rank + 1) if layout.dp > 1 else slice(None)
                with torch.no_grad():
                    got = model(case["ids"][rows], torch.arange(case["ids"].shape[1]))
                ref = case["logits"][rows]
                errors[f"{family}{sorted(overrides)}:{name}"] = float((got - ref).abs().max() / ref.abs().max())
    finally:
        torch.save(errors, os.path.join(work_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_models_on_two_ranks_match_one_process():
    from tests.runtime.assemble import BUILDERS, checkpoint_tensors, hf_model, load_checkpoint, tiny_config

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with tempfile.TemporaryDirectory() as work_dir:
        # One-process reference logits and the checkpoint, made here so every rank reads the same files.
        for i, (family, overrides) in enumerate(CASES):
            config = tiny_config(family, **overrides)
            tensors = checkpoint_tensors(hf_model(config, dtype=torch.float32, seed=3 + i))
            whole = BUILDERS[family](config, dtype=torch.float32).eval()
            load_checkpoint(whole, tensors)
            with torch.no_grad():
                logits = whole(ids, torch.arange(ids.shape[1]))
            torch.save(dict(config=config, tensors=tensors, ids=ids, logits=logits),
                       os.path.join(work_dir, f"case{i}.pt"))
        mp.spawn(_worker, args=(2, work_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(work_dir, f"rank{r}.pt")) for r in range(2)]
    for rank, errors in enumerate(results):
        assert len(errors) == len(CASES) * len(LAYOUTS), f"rank {rank} stopped early: {sorted(errors)}"
        bad = {k: v for k, v in errors.items() if not v < 2e-5}
        assert not bad, f"rank {rank}: {bad}"
