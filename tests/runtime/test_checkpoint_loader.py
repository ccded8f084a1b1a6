"""Loading a checkpoint into a build: every family and format lands where transformers and the float64 oracles say, and every bad input stops the load with a precise message before anything changes."""
import json
import math

import pytest
import torch
from torch import nn

from families import FAMILIES
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.loader import check_checkpoint, find_experts_modules, load_checkpoint
from runtime.checkpoint.reader import CheckpointReader
from runtime.experts.base import MoeShape
from runtime.experts.vanilla import (TorchEagerBf16Experts, TorchEagerFp8BlockScalesExperts,
                                     TorchEagerNvfp4Experts, TorchEagerW4a16Mxfp4Experts,
                                     TorchEagerW4a16Nvfp4Experts)
from runtime.experts.torch_grouped import TorchGroupedMmBf16Experts
from tests.runtime import fixtures_checkpoints as fc

E, H, I = fc.EXPERTS, fc.HIDDEN, fc.MOE_INTER


def _spec(family: str, hidden: int = H, inter: int = I) -> MoeShape:
    return MoeShape(hidden_size=hidden, intermediate_size=inter, num_experts=E, top_k=2,
                        activation=fc.activation(family), expert_bias=family == "gpt_oss")


def _build(reader: CheckpointReader, experts: dict, quantized: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A build with one parameter per non-expert checkpoint tensor; a quantized linear (a name in
    `quantized`, the unquantized values by name) becomes a bf16 parameter of its unquantized shape."""
    quantized = quantized or {}
    companions = {n[: -len("weight")] for n in quantized}
    params = {}
    for name in reader.names():
        if any(name.startswith(p + ".") for p in experts):
            continue
        if name in quantized:
            params[name] = (tuple(quantized[name].shape), torch.bfloat16)
        elif name.rsplit(".", 1)[0] + "." not in companions:
            params[name] = (reader.info(name).shape, reader.dtype(name))
    build = fc.mirror(params, experts)
    for module in experts.values():
        for buf in module.buffers():
            buf.zero_()
    return build


def _runtime_name(family: str, name: str) -> str:
    # transformers names the MoE block `mlp` at run time and `block_sparse_moe` on disk (Mixtral, MiniMax).
    return name.replace(".block_sparse_moe.", ".mlp.")


@pytest.mark.parametrize("family", fc.FAMILIES)
def test_a_checkpoint_saved_by_transformers_loads_into_a_build_of_each_family(family):
    saved = fc.saved_model(family)
    experts = {fc.experts_prefix(family, layer): TorchEagerBf16Experts(_spec(family)) for layer in fc.moe_layers(family)}
    with CheckpointReader(saved.path) as r:
        build = _build(r, experts)
    report = load_checkpoint(build, saved.path)
    assert report.experts_layers == sorted(experts)
    # Oracle: the transformers model the checkpoint was saved from, in its own run-time layout.
    plain = list(build.named_parameters())   # the experts modules hold buffers, not parameters
    assert len(plain) > 10
    for name, param in plain:
        assert torch.equal(param, saved.state[_runtime_name(family, name)]), name
    for prefix, module in experts.items():
        fused = _runtime_name(family, prefix)
        gate_up, down = saved.state[f"{fused}.gate_up_proj"], saved.state[f"{fused}.down_proj"]
        if family == "gpt_oss":   # [E, H, 2I] interleaved, [E, I, H]
            gate, up, down_w = gate_up[..., ::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2), down.transpose(1, 2)
            assert torch.equal(module.gate_bias, saved.state[f"{fused}.gate_up_proj_bias"][:, ::2])
            assert torch.equal(module.up_bias, saved.state[f"{fused}.gate_up_proj_bias"][:, 1::2])
            assert torch.equal(module.down_bias, saved.state[f"{fused}.down_proj_bias"])
        else:                     # [E, 2I, H] = [gate; up], [E, H, I]
            gate, up, down_w = gate_up[:, :I], gate_up[:, I:], down
        assert torch.equal(module.gate_weight, gate), prefix
        assert torch.equal(module.up_weight, up), prefix
        assert torch.equal(module.down_weight, down_w), prefix


def test_experts_modules_are_found_under_their_checkpoint_prefix():
    experts = {"model.layers.1.mlp.experts": TorchEagerBf16Experts(_spec("qwen3_moe"))}
    build = fc.mirror({"model.layers.1.mlp.gate.weight": ((E, H), torch.bfloat16)}, experts)
    assert find_experts_modules(build) == experts


def _bf16_bound(values: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    # The loader rounds a float result to bf16 once: allow half a bf16 ulp (2^-9 relative) more.
    return bound + values.abs() * 2.0 ** -8


def test_a_deepseek_fp8_checkpoint_dequantizes_non_expert_linears_and_fills_fp8_experts():
    ckpt = fc.deepseek_fp8()
    hidden, inter = fc.FP8_HIDDEN, fc.FP8_MOE_INTER
    prefix = fc.experts_prefix("deepseek_v3", 1)
    experts = {prefix: TorchEagerFp8BlockScalesExperts(_spec("deepseek_v3", hidden, inter))}
    non_expert = {n: w for n, w in ckpt.originals.items() if not n.startswith(prefix + ".")}
    with CheckpointReader(ckpt.path) as r:
        assert len(r.files) == 2
        build = _build(r, experts, non_expert)
        report = load_checkpoint(build, r)
        params = dict(build.named_parameters())
        assert sorted(report.dequantized) == sorted(non_expert)
        for name, original in non_expert.items():
            stem = name[: -len("weight")]
            # float64 oracle: value = fp8 * the fp32 multiplier of its 128x128 block.
            oracle = fc.fp8_block_f64(r.read(name), r.read(stem + "weight_scale_inv"))
            got = params[name].double()
            assert params[name].dtype == torch.bfloat16
            assert (got - oracle).abs().le(oracle.abs() * 2.0 ** -8).all(), name
            # and close to the weight it was quantized from: E4M3 keeps 3 mantissa bits.
            scale = r.read(stem + "weight_scale_inv").double().repeat_interleave(128, 0).repeat_interleave(128, 1)
            bound = original.double().abs() / 16 + scale[: original.shape[0], : original.shape[1]] * 2.0 ** -9
            assert (got - original.double()).abs().le(_bf16_bound(got, bound)).all(), name
        # Experts keep the canonical FP8 tensors: bit-identical to the checkpoint's.
        module = experts[prefix]
        for e in range(E):
            for proj, stored in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                w = r.read(f"{prefix}.{e}.{stored}.weight")
                assert torch.equal(getattr(module, f"{proj}_weight")[e].view(torch.uint8), w.view(torch.uint8))
                assert torch.equal(getattr(module, f"{proj}_weight_scale_inv")[e], r.read(f"{prefix}.{e}.{stored}.weight_scale_inv"))
    # Unquantized parameters (norms, router, embeddings) are the transformers model's.
    assert torch.equal(params["model.layers.1.mlp.gate.weight"], ckpt.state["model.layers.1.mlp.gate.weight"])
    assert torch.equal(params["model.norm.weight"], ckpt.state["model.norm.weight"])


@pytest.mark.parametrize("experts_class", [TorchEagerNvfp4Experts, TorchEagerW4a16Nvfp4Experts])
def test_a_modelopt_nvfp4_checkpoint_loads_for_both_nvfp4_run_formats(experts_class):
    # The W4A16 run format does not read input_scale, but the checkpoint carries it: not "unexpected".
    ckpt = fc.qwen3_moe_nvfp4()
    experts = {fc.experts_prefix("qwen3_moe", layer): experts_class(_spec("qwen3_moe")) for layer in fc.moe_layers("qwen3_moe")}
    non_expert = {n: w for n, w in ckpt.originals.items() if ".experts." not in n}
    assert any("self_attn.q_proj" in n for n in non_expert)
    with CheckpointReader(ckpt.path) as r:
        build = _build(r, experts, non_expert)
        load_checkpoint(build, r)
        params = dict(build.named_parameters())
        for name in non_expert:
            stem = name[: -len("weight")]
            oracle = fc.nvfp4_f64(r.read(name), r.read(stem + "weight_scale"), r.read(stem + "weight_scale_2"))
            assert (params[name].double() - oracle).abs().le(oracle.abs() * 2.0 ** -8).all(), name
        for prefix, module in experts.items():
            for e in range(E):
                for proj in ("gate", "up", "down"):
                    stem = f"{prefix}.{e}.{proj}_proj."
                    assert torch.equal(getattr(module, f"{proj}_weight")[e], r.read(stem + "weight"))
                    assert torch.equal(getattr(module, f"{proj}_weight_scale")[e].view(torch.uint8),
                                       r.read(stem + "weight_scale").view(torch.uint8))
                    assert torch.equal(getattr(module, f"{proj}_weight_scale_2")[e], r.read(stem + "weight_scale_2"))
                    if experts_class is TorchEagerNvfp4Experts:
                        assert torch.equal(getattr(module, f"{proj}_input_scale")[e], r.read(stem + "input_scale"))


def test_a_gpt_oss_mxfp4_checkpoint_fills_mxfp4_experts_that_decode_like_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = fc.gpt_oss_mxfp4()
    experts = {fc.experts_prefix("gpt_oss", layer): TorchEagerW4a16Mxfp4Experts(_spec("gpt_oss")) for layer in fc.moe_layers("gpt_oss")}
    with CheckpointReader(ckpt.path) as r:
        build = _build(r, experts)
        load_checkpoint(build, r)
        for prefix, module in experts.items():
            oracle = convert_moe_packed_tensors(r.read(f"{prefix}.gate_up_proj_blocks"),
                                                r.read(f"{prefix}.gate_up_proj_scales"), dtype=torch.float32)
            down = convert_moe_packed_tensors(r.read(f"{prefix}.down_proj_blocks"),
                                              r.read(f"{prefix}.down_proj_scales"), dtype=torch.float32)
            for e in range(E):
                gate = fc.mxfp4_f64(module.gate_weight[e], module.gate_weight_scale[e]).float()
                up = fc.mxfp4_f64(module.up_weight[e], module.up_weight_scale[e]).float()
                assert torch.equal(gate, oracle[e][:, ::2].T) and torch.equal(up, oracle[e][:, 1::2].T)
                assert torch.equal(fc.mxfp4_f64(module.down_weight[e], module.down_weight_scale[e]).float(), down[e].T)
            assert torch.equal(module.gate_bias, r.read(f"{prefix}.gate_up_proj_bias")[:, ::2])
            assert torch.equal(module.down_bias, r.read(f"{prefix}.down_proj_bias"))
        assert torch.equal(dict(build.named_parameters())["model.layers.0.mlp.router.bias"],
                           ckpt.state["model.layers.0.mlp.router.bias"])


def test_mtp_layers_are_unexpected_unless_the_build_ignores_them():
    ckpt = fc.deepseek_fp8(mtp=True)
    prefix = fc.experts_prefix("deepseek_v3", 1)
    non_expert = {n: w for n, w in ckpt.originals.items() if not n.startswith(prefix + ".")}
    with CheckpointReader(ckpt.path) as r:
        mtp_names = r.names("model.layers.2.")
        assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
                "model.layers.2.shared_head.head.weight", "model.layers.2.embed_tokens.weight",
                "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"} <= set(mtp_names)
        experts = {prefix: TorchEagerFp8BlockScalesExperts(_spec("deepseek_v3", fc.FP8_HIDDEN, fc.FP8_MOE_INTER))}
        build = _build(r, experts, non_expert)
        for name in [n for n, _ in build.named_parameters() if n.startswith("model.layers.2.")]:
            *path, leaf = name.split(".")
            delattr(build.get_submodule(".".join(path)), leaf)

    with pytest.raises(CheckpointError) as e:
        load_checkpoint(build, ckpt.path)
    assert e.value.problems == [f"unexpected tensor {n}: no parameter of this build reads it" for n in mtp_names]

    patterns = FAMILIES["deepseek_v3"].draft_ignore(ckpt.config)   # what the target build ignores
    assert patterns == ("model.layers.2.*",)
    report = load_checkpoint(build, ckpt.path, ignore=patterns)
    assert report.ignored == mtp_names


# -- bad inputs -----------------------------------------------------------------------------------------

PREFIX = "model.layers.1.mlp.experts"
SMALL_H, SMALL_I = 32, 8


def _small_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    tensors = {
        "model.embed_tokens.weight": rnd(16, SMALL_H),
        "model.layers.1.self_attn.q_proj.weight": rnd(64, SMALL_H),
        "model.layers.1.mlp.gate.weight": rnd(E, SMALL_H, dtype=torch.float32),
        "lm_head.weight": rnd(16, SMALL_H),
    }
    for e in range(E):
        tensors[f"{PREFIX}.{e}.gate_proj.weight"] = rnd(SMALL_I, SMALL_H)
        tensors[f"{PREFIX}.{e}.up_proj.weight"] = rnd(SMALL_I, SMALL_H)
        tensors[f"{PREFIX}.{e}.down_proj.weight"] = rnd(SMALL_H, SMALL_I)
    return tensors


def _small_build_unfilled() -> tuple[nn.Module, TorchEagerBf16Experts]:
    experts = TorchEagerBf16Experts(MoeShape(hidden_size=SMALL_H, intermediate_size=SMALL_I, num_experts=E,
                                                 top_k=2, activation="silu_glu"))
    params = {n: (tuple(t.shape), t.dtype) for n, t in _small_tensors().items() if not n.startswith(PREFIX)}
    return fc.mirror(params, {PREFIX: experts}, fill=0.5), experts


def _small_build() -> tuple[nn.Module, TorchEagerBf16Experts]:
    build, experts = _small_build_unfilled()
    for buf in experts.buffers():
        buf.fill_(0.25)
    return build, experts


def _write(tmp_path, tensors, shards=1):
    return fc.write_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "qwen3_moe"}, shards=shards)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = module.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed by a failed load"


def test_the_small_checkpoint_loads_when_nothing_is_wrong(tmp_path):
    tensors = _small_tensors()
    build, experts = _small_build()
    report = load_checkpoint(build, _write(tmp_path, tensors, shards=3))
    assert report.tensors == len(tensors)
    params = dict(build.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in tensors.items() if not n.startswith(PREFIX))
    assert torch.equal(experts.down_weight[3], tensors[f"{PREFIX}.3.down_proj.weight"])


BAD_INPUTS = {
    "missing": (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.q_proj.weight"},
                "missing tensor model.layers.1.self_attn.q_proj.weight: the build expects shape (64, 32) bfloat16"),
    "unexpected": (lambda t: {**t, "model.layers.9.mlp.gate.weight": torch.zeros(E, SMALL_H)},
                   "unexpected tensor model.layers.9.mlp.gate.weight: no parameter of this build reads it"),
    "unexpected_under_experts": (lambda t: {**t, f"{PREFIX}.2.gate_proj.weight_scale_inv": torch.ones(1, 1)},
                                 f"unexpected tensor {PREFIX}.2.gate_proj.weight_scale_inv: no parameter of this build reads it"),
    "shape": (lambda t: {**t, "model.layers.1.self_attn.q_proj.weight": torch.zeros(64, 16, dtype=torch.bfloat16)},
              "model.layers.1.self_attn.q_proj.weight: expected shape (64, 32), found (64, 16)"),
    "dtype": (lambda t: {**t, "model.layers.1.mlp.gate.weight": torch.zeros(E, SMALL_H, dtype=torch.int32)},
              "model.layers.1.mlp.gate.weight: expected dtype float32, found int32"),
    "expert_shape": (lambda t: {**t, f"{PREFIX}.3.up_proj.weight": torch.zeros(SMALL_I, 16, dtype=torch.bfloat16)},
                     f"{PREFIX}.3.up_proj.weight: expected shape (8, 32) bfloat16, found (8, 16) bfloat16"),
    "expert_dtype": (lambda t: {**t, f"{PREFIX}.0.down_proj.weight": torch.zeros(SMALL_H, SMALL_I, dtype=torch.int16)},
                     f"{PREFIX}.0.down_proj.weight: expected shape (32, 8) bfloat16, found (32, 8) int16"),
    "expert_missing": (lambda t: {k: v for k, v in t.items() if k != f"{PREFIX}.1.gate_proj.weight"},
                       f"{PREFIX}.1.gate_proj.weight: missing from the checkpoint (expected shape (8, 32) bfloat16)"),
}


def test_a_router_stored_in_bf16_loads_into_an_fp32_parameter_by_value(tmp_path):
    # Producers differ (transformers keeps DeepSeek's router fp32, the hub checkpoints hold bf16):
    # between plain float dtypes the loader casts, as every HF loader does.
    tensors = _small_tensors()
    stored = torch.randn(E, SMALL_H).to(torch.bfloat16)
    tensors["model.layers.1.mlp.gate.weight"] = stored
    build, _ = _small_build()
    load_checkpoint(build, _write(tmp_path, tensors))
    loaded = dict(build.named_parameters())["model.layers.1.mlp.gate.weight"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, stored.float())


@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_unquantized_expert_weights_of_any_float_dtype_load_into_the_dtype_the_experts_keep(tmp_path, stored):
    # transformers saves fp32 by default. VANILLA computes in fp32, so in an fp32 build it keeps the
    # values exactly; in a bf16 build, and TORCH always (bf16 GEMM operands), they are rounded once to bf16.
    tensors = _small_tensors()
    gen = torch.Generator().manual_seed(3)
    for e in range(E):
        for proj, shape in (("gate", (SMALL_I, SMALL_H)), ("up", (SMALL_I, SMALL_H)), ("down", (SMALL_H, SMALL_I))):
            tensors[f"{PREFIX}.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=gen).to(stored)
    path = _write(tmp_path, tensors)
    spec = MoeShape(hidden_size=SMALL_H, intermediate_size=SMALL_I, num_experts=E, top_k=2, activation="silu_glu")
    want = torch.stack([tensors[f"{PREFIX}.{e}.down_proj.weight"] for e in range(E)])
    for cls, dtype, kept in ((TorchEagerBf16Experts, torch.float32, torch.float32),
                             (TorchEagerBf16Experts, torch.bfloat16, torch.bfloat16),
                             (TorchGroupedMmBf16Experts, torch.float32, torch.bfloat16)):
        experts = cls(spec, dtype=dtype)
        params = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items() if not n.startswith(PREFIX)}
        load_checkpoint(fc.mirror(params, {PREFIX: experts}, fill=0.5), path)
        loaded = experts.down_weight if cls is TorchEagerBf16Experts else experts.w2
        assert loaded.dtype == kept, cls
        assert torch.equal(loaded, want.to(kept)), cls


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_bad_checkpoint_stops_the_load_with_a_precise_message_and_changes_nothing(tmp_path, case):
    change, message = BAD_INPUTS[case]
    build, _ = _small_build()
    before = _snapshot(build)
    path = _write(tmp_path, change(_small_tensors()), shards=2)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(build, path)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)
    _assert_unchanged(build, before)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_check_checkpoint_refuses_from_the_headers_what_the_load_refuses_on_a_build_without_storage(tmp_path, case):
    change, message = BAD_INPUTS[case]
    with torch.device("meta"):
        build, _ = _small_build_unfilled()
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(build, _write(tmp_path, change(_small_tensors()), shards=2))
    assert str(e.value) == message


def test_check_checkpoint_passes_what_loads_and_allocates_nothing(tmp_path):
    with torch.device("meta"):
        build, experts = _small_build_unfilled()
    path = _write(tmp_path, _small_tensors(), shards=2)
    assert check_checkpoint(build, path) is None
    assert all(t.is_meta for t in (*build.parameters(), *build.buffers()))
    load_checkpoint(build, path)
    assert torch.equal(experts.down_weight[3], _small_tensors()[f"{PREFIX}.3.down_proj.weight"])


def test_a_shard_file_missing_from_disk_stops_the_load(tmp_path):
    build, _ = _small_build()
    before = _snapshot(build)
    path = _write(tmp_path, _small_tensors(), shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    (path / "model-00003-of-00003.safetensors").unlink()
    lost = sorted(n for n, f in index.items() if f == "model-00003-of-00003.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(build, path)
    assert str(e.value) == (f"missing shard file model-00003-of-00003.safetensors referenced by "
                            f"model.safetensors.index.json ({len(lost)} tensors, e.g. {lost[0]})")
    _assert_unchanged(build, before)


def test_several_problems_are_reported_together(tmp_path):
    tensors = _small_tensors()
    del tensors["lm_head.weight"]
    tensors["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(64, 16, dtype=torch.bfloat16)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, SMALL_H, dtype=torch.bfloat16)
    build, _ = _small_build()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(build, _write(tmp_path, tensors))
    assert str(e.value) == "\n".join([
        "3 problems with the checkpoint:",
        "  missing tensor lm_head.weight: the build expects shape (16, 32) bfloat16",
        "  model.layers.1.self_attn.q_proj.weight: expected shape (64, 32), found (64, 16)",
        "  unexpected tensor model.layers.1.self_attn.k_proj.weight: no parameter of this build reads it",
    ])


# -- shards, ties, meta device, progress ----------------------------------------------------------------


def _param(shape, dtype=torch.bfloat16, shard=None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    if shard is not None:
        p.shard = shard
    return p


def test_a_tensor_parallel_shard_reads_only_its_chunk(tmp_path):
    tensors = {"a.weight": torch.randn(64, 32).to(torch.bfloat16), "b.weight": torch.randn(16, 48).to(torch.bfloat16)}
    path = _write(tmp_path, tensors)
    build = nn.Module()
    build.a = nn.Module()
    build.b = nn.Module()
    build.a.weight = _param((32, 32), shard=(0, 1, 2))
    build.b.weight = _param((16, 16), shard=(1, 2, 3))
    load_checkpoint(build, path)
    assert torch.equal(build.a.weight, tensors["a.weight"][32:64])
    assert torch.equal(build.b.weight, tensors["b.weight"][:, 32:48])

    build.a.weight = _param((32, 32), shard=(0, 1, 3))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(build, path)
    assert str(e.value) == "a.weight: expected shape (96, 32) (shard 1 of 3 along dim 0), found (64, 32)"


def test_a_segmented_shard_reads_its_chunk_of_each_segment(tmp_path):
    # A fused projection [z 8 | x 8 | B 4 | dt 2] rows (a Mamba-2 in_proj): rank 1 of 2 holds rows 4:8, 12:16, 18:20, 21:22.
    tensors = {"p.weight": torch.randn(22, 6).to(torch.bfloat16), "p.bias": torch.randn(22).to(torch.bfloat16)}
    path = _write(tmp_path, tensors)
    build = nn.Module()
    build.p = nn.Module()
    build.p.weight = _param((11, 6), shard=(0, 1, 2, (8, 8, 4, 2)))
    build.p.bias = _param((11,), shard=(0, 1, 2, (8, 8, 4, 2)))
    load_checkpoint(build, path)
    rows = [*range(4, 8), *range(12, 16), *range(18, 20), 21]
    assert torch.equal(build.p.weight, tensors["p.weight"][rows])
    assert torch.equal(build.p.bias, tensors["p.bias"][rows])


def test_a_quantized_tensor_is_not_read_in_segments():
    ckpt = fc.deepseek_fp8()
    up = "model.layers.0.mlp.up_proj.weight"      # [288, 192] FP8 blocks
    with CheckpointReader(ckpt.path) as r:
        root = fc.mirror({})
        fc._module_at(root, up.split(".")[:-1]).register_parameter("weight", _param((144, 192), shard=(0, 0, 2, (256, 32))))
        ignore = [n for n in r.names() if not n.startswith("model.layers.0.mlp.up_proj.")]
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(root, r, ignore=ignore, experts={})
    assert str(e.value) == (f"{up}: a quantized (fp8_block) tensor is read whole or in one chunk per rank, not in the segments of a "
                            "fused projection (shard 0 of 2 along dim 0); build this layer with tp1")


def test_a_shard_of_a_quantized_weight_equals_that_part_of_the_whole_dequantized_weight():
    ckpt = fc.deepseek_fp8()
    up = "model.layers.0.mlp.up_proj.weight"      # [288, 192]: shards start off the 128-blocks
    down = "model.layers.0.mlp.down_proj.weight"  # [192, 288]
    with CheckpointReader(ckpt.path) as r:
        whole_up = fc.fp8_block_f64(r.read(up), r.read(up[:-6] + "weight_scale_inv")).to(torch.bfloat16)
        whole_down = fc.fp8_block_f64(r.read(down), r.read(down[:-6] + "weight_scale_inv")).to(torch.bfloat16)
        for rank in range(2):
            build = nn.Module()
            build.up = _param((144, 192), shard=(0, rank, 2))
            build.down = _param((192, 144), shard=(1, rank, 2))
            names = {"model.layers.0.mlp.up_proj": build.up, "model.layers.0.mlp.down_proj": build.down}
            root = fc.mirror({})
            for name, p in names.items():
                fc._module_at(root, name.split(".")).register_parameter("weight", p)
            ignore = [n for n in r.names() if not n.startswith(("model.layers.0.mlp.up_proj.", "model.layers.0.mlp.down_proj."))]
            load_checkpoint(root, r, ignore=ignore, experts={})
            rows = slice(144 * rank, 144 * (rank + 1))
            assert (build.up.double() - whole_up[rows].double()).abs().le(whole_up[rows].double().abs() * 2.0 ** -7).all()
            assert (build.down.double() - whole_down[:, rows].double()).abs().le(whole_down[:, rows].double().abs() * 2.0 ** -7).all()


def test_an_nvfp4_shard_must_cut_between_scale_groups():
    ckpt = fc.qwen3_moe_nvfp4()
    name = "model.layers.0.self_attn.q_proj.weight"     # [64, 64] NVFP4
    with CheckpointReader(ckpt.path) as r:
        others = [n for n in r.names() if not n.startswith("model.layers.0.self_attn.q_proj.")]
        whole = fc.nvfp4_f64(r.read(name), r.read(name[:-6] + "weight_scale"), r.read(name[:-6] + "weight_scale_2"))
        root = fc.mirror({})
        q = fc._module_at(root, ["model", "layers", "0", "self_attn", "q_proj"])
        q.weight = _param((64, 16), shard=(1, 1, 4))
        load_checkpoint(root, r, ignore=others, experts={})
        assert (q.weight.double() - whole[:, 16:32]).abs().le(whole[:, 16:32].abs() * 2.0 ** -8).all()
        q.weight = _param((64, 8), shard=(1, 1, 8))
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(root, r, ignore=others, experts={})
        assert str(e.value) == (f"{name}: a shard of input columns 8:16 does not fall on the 16-element "
                                f"scale groups of nvfp4")


def test_tied_parameters_need_one_of_their_names_in_the_checkpoint(tmp_path):
    embed = torch.randn(16, 8).to(torch.bfloat16)
    path = _write(tmp_path, {"model.embed_tokens.weight": embed})
    build = fc.mirror({"model.embed_tokens.weight": ((16, 8), torch.bfloat16)})
    build.lm_head = nn.Module()
    build.lm_head.weight = build.model.embed_tokens.weight
    load_checkpoint(build, path)
    assert torch.equal(build.lm_head.weight, embed) and build.lm_head.weight is build.model.embed_tokens.weight


def test_a_build_on_the_meta_device_gets_real_tensors_that_keep_their_shard_tag(tmp_path):
    weight = torch.randn(64, 32).to(torch.bfloat16)
    path = _write(tmp_path, {"proj.weight": weight, "norm.weight": torch.ones(32, dtype=torch.bfloat16)})
    build = nn.Module()
    with torch.device("meta"):
        build.proj = nn.Linear(32, 32, bias=False, dtype=torch.bfloat16)
        build.norm = nn.Module()
        build.norm.register_buffer("weight", torch.empty(32, dtype=torch.bfloat16))
    build.proj.weight.shard = (0, 1, 2)
    load_checkpoint(build, path)
    assert build.proj.weight.device.type == "cpu" and build.proj.weight.shard == (0, 1, 2)
    assert isinstance(build.proj.weight, nn.Parameter)
    assert torch.equal(build.proj.weight, weight[32:])
    assert torch.equal(build.norm.weight, torch.ones(32, dtype=torch.bfloat16))


def test_a_meta_build_with_experts_loads_whole(tmp_path):
    tensors = _small_tensors()
    with torch.device("meta"):
        build, experts = _small_build_unfilled()
    load_checkpoint(build, _write(tmp_path, tensors))
    assert not any(t.is_meta for t in build.state_dict().values())
    assert torch.equal(experts.gate_weight[2], tensors[f"{PREFIX}.2.gate_proj.weight"])
    assert torch.equal(dict(build.named_parameters())["lm_head.weight"], tensors["lm_head.weight"])


def test_an_experts_module_given_by_prefix_may_sit_anywhere_in_the_tree(tmp_path):
    tensors = _small_tensors()
    build, experts = _small_build()
    moved = fc.mirror({n: (tuple(t.shape), t.dtype) for n, t in tensors.items() if not n.startswith(PREFIX)})
    moved.add_module("moe_of_layer_1", experts)
    load_checkpoint(moved, _write(tmp_path, tensors), experts={PREFIX: experts})
    assert torch.equal(experts.up_weight[1], tensors[f"{PREFIX}.1.up_proj.weight"])


def test_the_progress_bar_goes_to_stderr_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    path = _write(tmp_path, _small_tensors())
    load_checkpoint(_small_build()[0], path, progress=True)
    assert "loading checkpoint" in capsys.readouterr().err
    load_checkpoint(_small_build()[0], path)   # pytest's stderr is not a terminal: no bar
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("scheme", ["fp8_per_tensor", "fp8_per_channel", "mxfp4"])
def test_other_quantized_linear_schemes_dequantize_to_their_float64_values(tmp_path, scheme):
    # ModelOpt FP8 (weight + fp32 weight_scale scalar + input_scale), per-channel FP8 scales, and an
    # MXFP4 non-expert linear (weight + E8M0 weight_scale), read whole and as a row shard.
    from runtime.formats import fp8, mxfp4

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(5))
    name = "model.layers.0.self_attn.o_proj.weight"
    stem = name[: -len("weight")]
    if scheme == "mxfp4":
        packed, bits = mxfp4.quantize_mxfp4(w)
        tensors = {name: packed, stem + "weight_scale": bits}
        oracle = fc.mxfp4_f64(packed, bits)
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / 448 if scheme == "fp8_per_channel" else w.abs().amax() / 448
        q = fp8.to_e4m3(w / scale)
        tensors = {name: q, stem + "weight_scale": scale.float(), stem + "input_scale": torch.tensor(0.5)}
        oracle = fc.e4m3_f64(q) * scale.double()
    path = _write(tmp_path, tensors)
    for shard, rows in ((None, slice(None)), ((0, 1, 2), slice(24, 48))):
        build = fc.mirror({})
        o = fc._module_at(build, name.split(".")[:-1])
        o.weight = _param((48 if shard is None else 24, 64), shard=shard)
        report = load_checkpoint(build, path)
        assert report.dequantized == [name]
        want = oracle[rows]
        assert (o.weight.double() - want).abs().le(want.abs() * 2.0 ** -8).all(), (scheme, shard)


# -- NaN and infinite scales ----------------------------------------------------------------------------

def _corrupted(saved, tmp_path, changes: dict[str, tuple[tuple[int, ...], float | int]]):
    """A copy of `saved`'s folder with single scale elements overwritten: name -> (index, value)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(saved.path, path)
    with CheckpointReader(path) as r:
        files = {name: r.info(name).file for name in changes}
    for file in sorted(set(files.values())):
        tensors = load_file(str(path / file))
        for name, (index, value) in changes.items():
            if files[name] == file:
                t = tensors[name]
                if t.dtype == torch.float8_e4m3fn:   # e4m3 has no infinity; its NaN is the byte 0x7f
                    t.view(torch.uint8)[index] = 0x7F
                else:
                    t[index] = value
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    return path


def _scale_message(name, count, numel, what="scale values are NaN or infinite"):
    return f"{name}: {count} of the {numel} {what}; the checkpoint is corrupt: download or quantize it again"


def _refused(build, path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(build, path)
    return str(e.value)


@pytest.mark.parametrize("name, value", [
    (f"{fc.experts_prefix('deepseek_v3', 1)}.2.up_proj.weight_scale_inv", float("nan")),
    ("model.layers.1.self_attn.o_proj.weight_scale_inv", float("inf")),
])
def test_nan_and_infinite_fp8_block_scales_are_refused_naming_the_tensor(tmp_path, name, value):
    saved = fc.deepseek_fp8()
    prefix = fc.experts_prefix("deepseek_v3", 1)
    path = _corrupted(saved, tmp_path, {name: ((1, 0), value)})
    non_expert = {n: w for n, w in saved.originals.items() if not n.startswith(prefix + ".")}
    experts = {prefix: TorchEagerFp8BlockScalesExperts(_spec("deepseek_v3", fc.FP8_HIDDEN, fc.FP8_MOE_INTER))}
    with CheckpointReader(path) as r:
        build = _build(r, experts, non_expert)
        numel = math.prod(r.shape(name))
    assert _refused(build, path) == _scale_message(name, 1, numel)
    # The intact checkpoint loads into the same build.
    load_checkpoint(build, saved.path)


@pytest.mark.parametrize("kind, index, value", [("weight_scale", (5, 1), None), ("weight_scale_2", (), float("inf")),
                                                ("input_scale", (), float("nan"))])
def test_nan_and_infinite_nvfp4_expert_scales_are_refused_naming_the_tensor(tmp_path, kind, index, value):
    saved = fc.qwen3_moe_nvfp4()
    name = f"{fc.experts_prefix('qwen3_moe', 1)}.2.up_proj.{kind}"
    path = _corrupted(saved, tmp_path, {name: (index, value)})
    experts = {fc.experts_prefix("qwen3_moe", layer): TorchEagerNvfp4Experts(_spec("qwen3_moe"))
               for layer in fc.moe_layers("qwen3_moe")}
    non_expert = {n: w for n, w in saved.originals.items() if ".experts." not in n}
    with CheckpointReader(path) as r:
        build = _build(r, experts, non_expert)
        numel = math.prod(r.shape(name))
    before = _snapshot(experts[fc.experts_prefix("qwen3_moe", 1)])
    assert _refused(build, path) == _scale_message(name, 1, numel)
    # The experts module whose scale is bad keeps its old values (it swaps in only complete loads).
    _assert_unchanged(experts[fc.experts_prefix("qwen3_moe", 1)], before)


@pytest.mark.parametrize("kind", ["weight_scale", "weight_scale_2"])
def test_a_nan_nvfp4_scale_of_a_non_expert_linear_is_refused(tmp_path, kind):
    saved = fc.qwen3_moe_nvfp4()
    name = f"model.layers.1.self_attn.k_proj.{kind}"
    path = _corrupted(saved, tmp_path, {name: ((0, 0) if kind == "weight_scale" else (), float("nan"))})
    experts = {fc.experts_prefix("qwen3_moe", layer): TorchEagerW4a16Nvfp4Experts(_spec("qwen3_moe"))
               for layer in fc.moe_layers("qwen3_moe")}
    with CheckpointReader(path) as r:
        build = _build(r, experts, {n: w for n, w in saved.originals.items() if ".experts." not in n})
        numel = math.prod(r.shape(name))
    assert _refused(build, path) == _scale_message(name, 1, numel)


def test_an_e8m0_nan_in_a_gpt_oss_mxfp4_scale_is_refused_naming_the_expert_and_rows(tmp_path):
    # Fused row 6 of expert 1 is gate row 3 (gate/up rows interleave); E8M0 byte 255 is NaN.
    saved = fc.gpt_oss_mxfp4()
    prefix = fc.experts_prefix("gpt_oss", 1)
    path = _corrupted(saved, tmp_path, {f"{prefix}.gate_up_proj_scales": ((1, 6, 1), 255)})
    experts = {fc.experts_prefix("gpt_oss", layer): TorchEagerW4a16Mxfp4Experts(_spec("gpt_oss"))
               for layer in fc.moe_layers("gpt_oss")}
    with CheckpointReader(path) as r:
        build = _build(r, experts)
    assert _refused(build, path) == _scale_message(f"{prefix}.gate_up_proj_scales[1, 0::2]", 1, I * H // 32,
                                                   "E8M0 scale bytes are 255 (NaN)")
