"""One dep2 rank's decode step captures in a CUDA graph on one GPU and replays without a host sync (issue 16).

torch.distributed's fake process group stands in for the peer rank: the step's collectives (the MoE
exchange's all-gather and reduce-scatter, runtime/ops/moe.py) are issued and captured like NCCL's,
but carry no data, so this proves capturability only. Numerics: tests/parallel/test_dep_decode.py
(the same fixed-capacity step on gloo ranks against the one-process logits) and the two-GPU NCCL run.

    python -m pytest tests/gpu/test_dep_decode_graph.py
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.decoding import Decoder
from tests.generated import builds

pytestmark = pytest.mark.gpu

DEP2 = "generated.tiny_qwen3_moe.tiny_qwen3_moe_bf16__sm_90__dep2.modeling"


@pytest.fixture
def fake_world():
    """This process as rank 0 of a world of 2 whose collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dep_rank_decode_step_captures_and_replays_without_host_syncs(fake_world):
    model = builds.load(DEP2).MODEL_CLASS(device="cuda", rank=0)
    model.init_random(seed=4)
    model.eval()
    vocab = model.lm_head.weight.shape[0]
    ids = builds.token_ids(vocab, batch=2, length=4).cuda()
    # Decoder itself, not model.decoder: the bucket agreement that one reads back is a fake all-gather too.
    # No prefill: its variable exchange reads counts the fake group never wrote.
    decoder = Decoder(model, 2, 256)
    # Warm-up and capture: the warm-up builds lazy index tables on the device (a copy that syncs, once);
    # a host sync during the capture itself fails it.
    decoder.step(ids[:, 0])
    assert decoder.graph is not None
    with builds.no_host_sync():
        for t in range(1, ids.shape[1]):
            logits = decoder.step(ids[:, t])
    torch.cuda.synchronize()
    assert logits.shape == (2, vocab)
    assert int(decoder.position) == ids.shape[1]
