"""Dense MLP, shared experts and the MoE block against the transformers MLP / sparse-MoE modules of each family.

Routed experts are the VANILLA reference class (`runtime.experts.vanilla`, fp32 GEMMs) loaded through the
runtime's own checkpoint source for the transformers module's expert tensors
(`runtime.checkpoint.experts_sources`), so these tests check the block's wiring (router, shared expert, its
sigmoid gate, the block-held MiniMax bias, summation) rather than an experts implementation.
Tolerances: fp32 atol 1e-5 on outputs of O(0.1-1); bf16 2e-2 relative to the largest output (transformers
accumulates the k expert outputs in bf16, ours in fp32).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.checkpoint.experts_sources import experts_source
from runtime.checkpoint.reader import CheckpointReader
from runtime.experts.base import MoeShape
from runtime.experts.vanilla import TorchEagerBf16Experts
from runtime.ops.mlp import MLP, SharedExpertGate
from runtime.ops.moe import MoEBlock
from runtime.parallel import Layout
from runtime.routing import LinearTopKSoftmaxRouter, SigmoidTopKRouter, SoftmaxTopKRouter

H, I, E = 64, 32, 8
DTYPES = [torch.float32, torch.bfloat16]


def _config(family, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{"hidden_size": H, **kw})


@torch.no_grad()
def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        t.copy_((0.2 * torch.randn(t.shape, generator=g)).to(t.dtype))


@torch.no_grad()
def _copy_by_name(ours, theirs, skip=("experts.",)):
    ours_params = dict(ours.named_parameters())
    for name, t in list(theirs.named_parameters()) + list(theirs.named_buffers()):
        if name.startswith(skip):
            continue
        ours_params[name].copy_(t)


def _vanilla_experts(hf_experts, *, top_k, activation="silu_glu", expert_bias=False, dtype):
    """The VANILLA experts of a transformers 5 experts module's weights, written as its checkpoint holds them
    and read back through the runtime's source for that layout."""
    if activation == "swiglu_oai":  # gpt-oss keeps its checkpoint layout (gpt_oss_bf16) in memory
        tensors = {f"experts.{n}": t.detach() for n, t in hf_experts.named_parameters()}
    else:  # fused [E, 2I, H] = [gate; up] per expert and [E, H, I] in memory; one tensor per expert on disk
        gate_up, down = hf_experts.gate_up_proj.detach(), hf_experts.down_proj.detach()
        tensors = {}
        for e in range(gate_up.shape[0]):
            tensors[f"experts.{e}.gate_proj.weight"], tensors[f"experts.{e}.up_proj.weight"] = gate_up[e].chunk(2, dim=0)
            tensors[f"experts.{e}.down_proj.weight"] = down[e]
    spec = MoeShape(H, I, E, top_k, activation, expert_bias=expert_bias)
    experts = TorchEagerBf16Experts(spec, dtype=dtype)
    with tempfile.TemporaryDirectory() as folder:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(Path(folder) / "model.safetensors"))
        with CheckpointReader(folder) as reader:
            experts.load_weights(experts_source(reader, "experts"))
    return experts


def _assert_close(out, ref):
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    else:
        err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 2e-2, f"bf16 relative error {err:.3e}"


def _x(seed, dtype):
    return torch.randn(2, 12, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_mlp_matches_deepseek_v3_mlp(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    theirs = DeepseekV3MLP(_config("deepseek_v3"), intermediate_size=96).to(dtype)
    _randomise(theirs, 0)
    ours = MLP(hidden_size=H, intermediate_size=96, dtype=dtype)
    _copy_by_name(ours, theirs)
    x = _x(1, dtype)
    out, ref = ours(x), theirs(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)  # same three GEMMs, same roundings
    else:
        _assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_moe_block_with_shared_experts_matches_deepseek_style_moe(dtype, family):
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as cls
    kw = dict(n_routed_experts=E, num_experts_per_tok=3, moe_intermediate_size=I, n_shared_experts=2,
              n_group=4 if family == "deepseek_v3" else 1, topk_group=2 if family == "deepseek_v3" else 1,
              routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = cls(_config(family, **kw)).to(dtype)
    _randomise(theirs, 2)
    ours = MoEBlock(
        gate=SigmoidTopKRouter(hidden_size=H, num_experts=E, top_k=3, n_group=kw["n_group"],
                               topk_group=kw["topk_group"], routed_scaling_factor=2.5),
        experts=_vanilla_experts(theirs.experts, top_k=3, dtype=dtype),
        shared_experts=MLP(hidden_size=H, intermediate_size=2 * I, reduce_output=False, dtype=dtype),
    )
    _copy_by_name(ours, theirs)
    x = _x(3, dtype)
    _assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_with_gated_shared_expert_matches_qwen2_moe(dtype):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = _config("qwen2_moe", num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                     shared_expert_intermediate_size=48, norm_topk_prob=True)
    theirs = Qwen2MoeSparseMoeBlock(config).to(dtype)
    _randomise(theirs, 4)
    ours = MoEBlock(
        gate=SoftmaxTopKRouter(hidden_size=H, num_experts=E, top_k=3, norm_topk_prob=True, dtype=dtype),
        experts=_vanilla_experts(theirs.experts, top_k=3, dtype=dtype),
        shared_expert=MLP(hidden_size=H, intermediate_size=48, reduce_output=False, dtype=dtype),
        shared_expert_gate=SharedExpertGate(hidden_size=H, dtype=dtype),
    )
    _copy_by_name(ours, theirs)
    x = _x(5, dtype)
    _assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_matches_qwen3_moe_and_mixtral(dtype):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cases = [
        (Qwen3MoeSparseMoeBlock(_config("qwen3_moe", num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                                        norm_topk_prob=False)), 3, False),
        (MixtralSparseMoeBlock(_config("mixtral", num_local_experts=E, num_experts_per_tok=2, intermediate_size=I)),
         2, True),
    ]
    for seed, (theirs, k, renorm) in enumerate(cases):
        theirs = theirs.to(dtype)
        _randomise(theirs, 10 + seed)
        ours = MoEBlock(
            gate=SoftmaxTopKRouter(hidden_size=H, num_experts=E, top_k=k, norm_topk_prob=renorm, dtype=dtype),
            experts=_vanilla_experts(theirs.experts, top_k=k, dtype=dtype),
        )
        _copy_by_name(ours, theirs)
        x = _x(20 + seed, dtype)
        _assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_holds_the_minimax_m2_correction_bias(dtype):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    config = _config("minimax_m2", num_local_experts=E, num_experts_per_tok=3, intermediate_size=I)
    theirs = MiniMaxM2SparseMoeBlock(config).to(dtype)
    _randomise(theirs, 6)
    ours = MoEBlock(
        gate=SigmoidTopKRouter(hidden_size=H, num_experts=E, top_k=3, fp32_gemm=False, bias_on_block=True,
                               dtype=dtype),
        experts=_vanilla_experts(theirs.experts, top_k=3, dtype=dtype),
    )
    assert "e_score_correction_bias" in dict(ours.named_parameters())  # block_sparse_moe.e_score_correction_bias
    _copy_by_name(ours, theirs)
    x = _x(7, dtype)
    _assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_with_biased_router_and_swiglu_experts_matches_gpt_oss(dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = _config("gpt_oss", num_local_experts=E, num_experts_per_tok=2, intermediate_size=I, swiglu_limit=7.0)
    theirs = GptOssMLP(config).to(dtype)
    _randomise(theirs, 8)
    with torch.no_grad():
        theirs.experts.gate_up_proj.mul_(10)  # push some gate/up values past the clamp limit of 7
    ours = MoEBlock(
        router=LinearTopKSoftmaxRouter(hidden_size=H, num_experts=E, top_k=2, dtype=dtype),
        experts=_vanilla_experts(theirs.experts, top_k=2, activation="swiglu_oai", expert_bias=True, dtype=dtype),
    )
    _copy_by_name(ours, theirs)
    x = _x(9, dtype)
    ref = theirs(x)[0]
    if dtype == torch.float32:
        torch.testing.assert_close(ours(x), ref, rtol=1e-5, atol=1e-4)  # outputs of O(10)
    else:
        _assert_close(ours(x), ref)


def test_moe_block_state_dict_has_only_checkpoint_names():
    block = MoEBlock(
        gate=SigmoidTopKRouter(hidden_size=H, num_experts=E, top_k=2),
        experts=TorchEagerBf16Experts(MoeShape(H, I, E, 2, "silu_glu")),
        shared_experts=MLP(hidden_size=H, intermediate_size=I, reduce_output=False),
    )
    top = {k.split(".")[0] + "." + k.split(".")[1] for k in block.state_dict() if not k.startswith("experts.")}
    assert top == {"gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj",
                   "shared_experts.up_proj", "shared_experts.down_proj"}


def test_moe_block_refuses_ambiguous_wiring():
    experts = TorchEagerBf16Experts(MoeShape(H, I, E, 2, "silu_glu"))
    router = SoftmaxTopKRouter(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True)
    with pytest.raises(ValueError, match="exactly one"):
        MoEBlock(gate=router, router=router, experts=experts)
    with pytest.raises(ValueError, match="reduce_output=False"):
        MoEBlock(gate=router, experts=experts, layout=Layout(tp=2, moe_tp=2),
                 shared_experts=MLP(hidden_size=H, intermediate_size=I, tp_size=2, tp_rank=0))
