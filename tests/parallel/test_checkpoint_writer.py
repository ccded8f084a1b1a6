"""The checkpoint writer behind `--tiny` writes exactly what the loader reads: every family's layout round-trips, and every tiny build loads what it wrote.

A tiny checkpoint only proves anything about sharded loading if it is stored the way real checkpoints
are; so each storage layout is read back through the checkpoint package's own `experts_source` and
compared tensor by tensor (a gate/up swap in gpt-oss's interleaved rows would load silently and only
change the logits), and every declared tiny checkpoint loads into its one-rank build with nothing
missing and nothing left over.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from generated import run
from generated._build_index import INDEX
from runtime.checkpoint import CheckpointReader, experts_source
from runtime.checkpoint.writer import save_checkpoint, stored_expert_tensors
from runtime.experts.base import MoeShape, random_source

PREFIX = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("layout,fmt", [("gate_up_down", "fp8_block_scales"), ("w1_w3_w2", "bf16"),
                                        ("gpt_oss_bf16", "bf16"), ("gpt_oss_mxfp4", "w4a16_mxfp4"),
                                        ("gate_up_down", "nvfp4")])
def test_every_experts_layout_reads_back_as_written(layout, fmt, tmp_path):
    spec = MoeShape(hidden_size=128, intermediate_size=64, num_experts=3, top_k=2, activation="silu_glu",
                        expert_bias=layout.startswith("gpt_oss"))
    canonical = random_source(spec, fmt, range(3), torch.Generator().manual_seed(1)).tensors
    save_checkpoint(stored_expert_tensors(canonical, 3, layout, PREFIX), tmp_path)
    with CheckpointReader(tmp_path) as reader:
        source = experts_source(reader, PREFIX)
        for (expert, proj, kind), value in canonical.items():
            got = source.get(expert, proj, kind)
            assert got.dtype == value.dtype and torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), \
                (layout, expert, proj, kind)


TINY_ONE_RANK = sorted((t["name"], t["model"], t["sm"], t["checkpoint"], t["module"]) for t in INDEX["targets"]
                       if t["model"].startswith("tiny_") and t["parallel"] == "tp1")


@pytest.mark.parametrize("target,model,sm,checkpoint,module", TINY_ONE_RANK, ids=[t[0] for t in TINY_ONE_RANK])
def test_every_tiny_checkpoint_loads_into_its_one_rank_build(target, model, sm, checkpoint, module, tmp_path):
    run.write_tiny(model, sm, checkpoint, tmp_path, seed=0)
    built = importlib.import_module(module, "generated").MODEL_CLASS(device="cpu")
    # The loader refuses missing and unexpected tensors alike, so a clean load is the claim.
    built.load_checkpoint(str(tmp_path))
    with torch.no_grad():
        logits = built(torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    for folder, seed in (("a", 0), ("b", 0), ("c", 1)):
        run.write_tiny("tiny_qwen3_moe", 90, "tiny_qwen3_moe_bf16", tmp_path / folder, seed=seed)
    a, b, c = ((tmp_path / f / "model.safetensors").read_bytes() for f in "abc")
    assert a == b and a != c


def test_a_sharded_build_cannot_write_a_checkpoint():
    from runtime.checkpoint.writer import random_tensors

    module = importlib.import_module(".tiny_qwen3_moe.tiny_qwen3_moe_bf16__sm_90__tp2.modeling", "generated")
    with pytest.raises(ValueError, match="write a checkpoint from a one-rank \\(tp1\\) build"):
        random_tensors(module.MODEL_CLASS(device="meta", rank=0), "gate_up_down")


def test_a_tiny_fp8_block_checkpoint_stores_its_linears_as_deepseek_does(tmp_path):
    """FP8_BLOCK_SCALES: attention, dense-MLP and shared-expert linears as E4M3 codes with their 128x128 block
    scales, like the routed experts; the router, norms, embedding and head unquantized (DeepSeek-V3's layout)."""
    run.write_tiny("tiny_deepseek_v3", 90, "tiny_deepseek_v3_fp8", tmp_path, seed=0)
    with CheckpointReader(tmp_path) as reader:
        dtypes = {name: reader.info(name).dtype for name in reader.names()}
    for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"):
        assert dtypes[name] == torch.float8_e4m3fn, name
        assert dtypes[name[: -len("weight")] + "weight_scale_inv"] == torch.float32, name
    for name in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert dtypes[name] in (torch.bfloat16, torch.float32), name
