"""The parallel layout as numbers, one-rank collectives, and the ops' shard metadata for the loader.

Multi-rank runs of the generated builds: tests/parallel (every family on two gloo ranks:
test_families_gloo.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

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
