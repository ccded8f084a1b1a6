"""Experts sources: every family's storage layout comes back as the canonical per-expert [out, in] tensors, exactly, and slices read only what was asked."""
import pytest
import torch

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.experts_sources import (GptOssFusedSource, PerExpertSource, detect_layout,
                                                experts_source)
from runtime.checkpoint.reader import CheckpointReader
from tests.runtime import fixtures_checkpoints as fc

E, H, I = fc.EXPERTS, fc.HIDDEN, fc.MOE_INTER


def _expert_names(family: str, layer: int) -> set[str]:
    with CheckpointReader(fc.saved_model(family).path) as r:
        prefix = fc.experts_prefix(family, layer)
        return {n[len(prefix) + 1:] for n in r.names(prefix + ".")}


def test_transformers_5_saves_per_expert_hub_names_for_five_families_and_fused_tensors_for_gpt_oss():
    # transformers 5 fuses experts at run time but reverts to the hub names on save, except gpt-oss,
    # whose fused bf16 tensors are saved as they are (the module docstring of experts_sources records this).
    per_expert = {f"{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    w1w3w2 = {f"{e}.{p}.weight" for e in range(E) for p in ("w1", "w3", "w2")}
    for family in ("deepseek_v3", "qwen3_moe", "glm4_moe"):
        assert _expert_names(family, fc.moe_layers(family)[-1]) == per_expert, family
    for family in ("mixtral", "minimax_m2"):
        assert fc.experts_prefix(family, 0) == "model.layers.0.block_sparse_moe.experts"
        assert _expert_names(family, 0) == w1w3w2, family
    assert _expert_names("gpt_oss", 0) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    with CheckpointReader(fc.saved_model("gpt_oss").path) as r:
        assert r.shape("model.layers.0.mlp.experts.gate_up_proj") == (E, H, 2 * I)   # input-major
        assert r.shape("model.layers.0.mlp.experts.down_proj") == (E, I, H)
    routers = {
        "deepseek_v3": {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"},
        "glm4_moe": {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"},
        "qwen3_moe": {"model.layers.1.mlp.gate.weight"},
        "mixtral": {"model.layers.1.block_sparse_moe.gate.weight"},
        "minimax_m2": {"model.layers.1.block_sparse_moe.gate.weight",
                       "model.layers.1.block_sparse_moe.e_score_correction_bias"},
        "gpt_oss": {"model.layers.1.mlp.router.weight", "model.layers.1.mlp.router.bias"},
    }
    for family, names in routers.items():
        with CheckpointReader(fc.saved_model(family).path) as r:
            layer = {n for n in r.names("model.layers.1.")
                     if not any(part in n for part in (".experts.", "self_attn", "layernorm", "_proj."))}
            assert layer == names, family


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "glm4_moe", "mixtral", "minimax_m2"])
def test_a_per_expert_source_returns_what_transformers_holds_for_each_expert(family):
    # Oracle: the transformers model's fused run-time experts [E, 2I, H] = concat(gate, up) and
    # [E, H, I], which its own loading code built from the per-expert tensors.
    saved = fc.saved_model(family)
    with CheckpointReader(saved.path) as r:
        for layer in fc.moe_layers(family):
            source = experts_source(r, fc.experts_prefix(family, layer))
            assert isinstance(source, PerExpertSource)
            gate_up = saved.state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            down = saved.state[f"model.layers.{layer}.mlp.experts.down_proj"]
            for e in range(E):
                assert torch.equal(source.get(e, "gate", "weight"), gate_up[e, :I])
                assert torch.equal(source.get(e, "up", "weight"), gate_up[e, I:])
                assert torch.equal(source.get(e, "down", "weight"), down[e])
                assert source.shape(e, "gate", "weight") == (I, H)
                assert source.shape(e, "down", "weight") == (H, I)
                assert source.dtype(e, "up", "weight") == torch.bfloat16
                assert source.shape(e, "gate", "weight_scale_inv") is None
            assert source.shape(E, "gate", "weight") is None


def test_w1_w3_w2_mean_gate_up_down():
    with CheckpointReader(fc.saved_model("mixtral").path) as r:
        source = experts_source(r, "model.layers.1.block_sparse_moe.experts")
        assert source.name(2, "gate", "weight") == "model.layers.1.block_sparse_moe.experts.2.w1.weight"
        assert source.name(2, "up", "weight") == "model.layers.1.block_sparse_moe.experts.2.w3.weight"
        assert source.name(2, "down", "weight") == "model.layers.1.block_sparse_moe.experts.2.w2.weight"


def test_the_gpt_oss_bf16_layout_is_deinterleaved_with_gpt_oss_gate_convention():
    # GptOssExperts computes x @ gate_up_proj[e] and takes [..., ::2] as gate and [..., 1::2] as up;
    # the canonical gate weight is therefore the even columns, transposed to [out, in].
    saved = fc.saved_model("gpt_oss")
    with CheckpointReader(saved.path) as r:
        for layer in fc.moe_layers("gpt_oss"):
            source = experts_source(r, fc.experts_prefix("gpt_oss", layer))
            assert isinstance(source, GptOssFusedSource) and not source.quantized
            p = f"model.layers.{layer}.mlp.experts"
            gu, gub = saved.state[f"{p}.gate_up_proj"], saved.state[f"{p}.gate_up_proj_bias"]
            dn, dnb = saved.state[f"{p}.down_proj"], saved.state[f"{p}.down_proj_bias"]
            for e in range(E):
                assert torch.equal(source.get(e, "gate", "weight"), gu[e][:, ::2].T)
                assert torch.equal(source.get(e, "up", "weight"), gu[e][:, 1::2].T)
                assert torch.equal(source.get(e, "down", "weight"), dn[e].T)
                assert torch.equal(source.get(e, "gate", "bias"), gub[e, ::2])
                assert torch.equal(source.get(e, "up", "bias"), gub[e, 1::2])
                assert torch.equal(source.get(e, "down", "bias"), dnb[e])
                assert source.shape(e, "gate", "weight") == (I, H)
                assert source.shape(e, "down", "weight") == (H, I)
            # The per-expert products equal transformers' fused GEMM, de-interleaved.
            x = torch.randn(3, H, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
            fused = x.float() @ gu[1].float()
            assert torch.allclose(x.float() @ source.get(1, "gate", "weight").float().T, fused[:, ::2])
            assert torch.allclose(x.float() @ source.get(1, "up", "weight").float().T, fused[:, 1::2])


def test_the_gpt_oss_mxfp4_layout_dequantizes_like_transformers_convert_moe_packed_tensors():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = fc.gpt_oss_mxfp4()
    with CheckpointReader(ckpt.path) as r:
        for layer in fc.moe_layers("gpt_oss"):
            p = fc.experts_prefix("gpt_oss", layer)
            source = experts_source(r, p)
            assert isinstance(source, GptOssFusedSource) and source.quantized
            blocks, scales = r.read(f"{p}.gate_up_proj_blocks"), r.read(f"{p}.gate_up_proj_scales")
            # transformers' dequant gives [E, H, 2I] (its run-time layout); gate = [..., ::2].
            oracle = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            down_oracle = convert_moe_packed_tensors(r.read(f"{p}.down_proj_blocks"),
                                                     r.read(f"{p}.down_proj_scales"), dtype=torch.float32)
            for e in range(E):
                for proj, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    w, s = source.get(e, proj, "weight"), source.get(e, proj, "weight_scale")
                    assert w.shape == (I, H // 2) and w.dtype == torch.uint8
                    assert s.shape == (I, H // 32) and s.dtype == torch.uint8
                    # The raw bytes are the interleaved rows of the stored tensor ...
                    assert torch.equal(w, blocks[e, cols].reshape(I, H // 2))
                    assert torch.equal(s, scales[e, cols])
                    # ... and decode to transformers' values.
                    assert torch.equal(fc.mxfp4_f64(w, s).float(), oracle[e][:, cols].T)
                w, s = source.get(e, "down", "weight"), source.get(e, "down", "weight_scale")
                assert torch.equal(fc.mxfp4_f64(w, s).float(), down_oracle[e].T)
                # The quantized values are close to the bf16 weights they came from (OCP floor rule:
                # elements may clip, so compare loosely; the point is orientation and interleave).
                orig = ckpt.originals[f"{p}.gate_up_proj"][e][:, ::2].T.float()
                deq = fc.mxfp4_f64(source.get(e, "gate", "weight"), source.get(e, "gate", "weight_scale")).float()
                assert torch.corrcoef(torch.stack([orig.flatten(), deq.flatten()]))[0, 1] > 0.95


@pytest.mark.parametrize("case", ["per_expert", "gpt_oss_bf16", "gpt_oss_mxfp4", "nvfp4"])
def test_a_slice_is_the_same_slice_of_the_whole_canonical_tensor(case):
    path, prefix, kinds = {
        "per_expert": (fc.saved_model("qwen3_moe").path, "model.layers.1.mlp.experts", ["weight"]),
        "gpt_oss_bf16": (fc.saved_model("gpt_oss").path, "model.layers.1.mlp.experts", ["weight", "bias"]),
        "gpt_oss_mxfp4": (fc.gpt_oss_mxfp4().path, "model.layers.1.mlp.experts", ["weight", "weight_scale", "bias"]),
        "nvfp4": (fc.qwen3_moe_nvfp4().path, "model.layers.0.mlp.experts", ["weight", "weight_scale"]),
    }[case]
    gen = torch.Generator().manual_seed(7)
    with CheckpointReader(path) as r:
        source = experts_source(r, prefix)
        for proj in ("gate", "up", "down"):
            for kind in kinds:
                whole = source.get(2, proj, kind)
                for _ in range(4):
                    r0, r1 = sorted(torch.randint(0, whole.shape[0] + 1, (2,), generator=gen).tolist())
                    if whole.dim() == 1:
                        assert torch.equal(source.get(2, proj, kind, rows=slice(r0, r1)), whole[r0:r1])
                        continue
                    c0, c1 = sorted(torch.randint(0, whole.shape[1] + 1, (2,), generator=gen).tolist())
                    got = source.get(2, proj, kind, rows=slice(r0, r1), cols=slice(c0, c1))
                    assert torch.equal(got, whole[r0:r1, c0:c1]), (proj, kind, r0, r1, c0, c1)
                    assert got.is_contiguous() and got.untyped_storage().nbytes() == got.numel() * got.element_size()


def test_scalar_kinds_are_read_whole_and_missing_kinds_are_none():
    with CheckpointReader(fc.qwen3_moe_nvfp4().path) as r:
        source = experts_source(r, "model.layers.0.mlp.experts")
        assert source.shape(0, "gate", "weight_scale_2") == ()
        assert source.get(0, "gate", "weight_scale_2").shape == ()
        # gate and up of one expert share weight_scale_2 (ModelOpt), down has its own
        assert torch.equal(source.get(1, "gate", "weight_scale_2"), source.get(1, "up", "weight_scale_2"))
        assert source.shape(0, "down", "input_scale") == ()
        assert source.shape(0, "down", "bias") is None
    with CheckpointReader(fc.gpt_oss_mxfp4().path) as r:
        source = experts_source(r, "model.layers.0.mlp.experts")
        assert source.shape(0, "gate", "weight_scale_inv") is None
        assert source.shape(E, "gate", "weight") is None


def test_an_ungated_up_down_layout_has_no_gate(tmp_path):
    # Nemotron-H's relu2 experts: up_proj and down_proj only.
    tensors = {f"backbone.layers.1.mixer.experts.{e}.{p}.weight": torch.randn(*shape).to(torch.bfloat16)
               for e in range(2) for p, shape in (("up_proj", (8, 16)), ("down_proj", (16, 8)))}
    with CheckpointReader(fc.write_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "nemotron_h"})) as r:
        prefix = "backbone.layers.1.mixer.experts"
        assert detect_layout(r, prefix) == "gate_up_down"
        source = experts_source(r, prefix)
        assert source.shape(1, "gate", "weight") is None
        assert torch.equal(source.get(1, "up", "weight"), tensors[f"{prefix}.1.up_proj.weight"])


def test_a_prefix_without_experts_is_refused_with_what_was_looked_for():
    with CheckpointReader(fc.saved_model("qwen3_moe").path) as r:
        with pytest.raises(CheckpointError) as e:
            experts_source(r, "model.layers.1.mlp.shared_experts")
        assert str(e.value) == (
            f"no expert tensors under model.layers.1.mlp.shared_experts in the checkpoint at {r.path} "
            "(looked for model.layers.1.mlp.shared_experts.{e}.gate_proj|up_proj|down_proj.*, "
            "model.layers.1.mlp.shared_experts.{e}.w1|w3|w2.*, model.layers.1.mlp.shared_experts.gate_up_proj_blocks "
            "and model.layers.1.mlp.shared_experts.gate_up_proj)")


def test_a_slice_past_the_canonical_tensor_names_the_fused_part():
    with CheckpointReader(fc.gpt_oss_mxfp4().path) as r:
        source = experts_source(r, "model.layers.0.mlp.experts")
        with pytest.raises(CheckpointError) as e:
            source.get(3, "up", "weight", rows=slice(0, I + 1))
        assert str(e.value) == f"model.layers.0.mlp.experts.gate_up_proj_blocks[3, 1::2]: rows 0:{I + 1} out of range for size {I}"
