"""Test-only: whole causal LMs of the six families assembled from runtime ops, written the way a generated model file reads.

The op tests check each piece against its transformers module; this file checks that the pieces compose
into the same model, and it is the draft of the templates: each `build_<family>` starts with the
constants a template would inline, builds layers from a literal layer plan, and uses one decoder-layer
class whose forward has no branch on the configuration. Weights are never copied module by module: the
transformers model is written with `save_pretrained` (which emits the real checkpoint names, e.g.
Mixtral's `block_sparse_moe.experts.3.w1.weight`) and our model loads that file by name, exactly as the
checkpoint loader will, honouring `param.shard` for tensor-parallel ranks. So a misnamed parameter fails
the load, and a mis-split one fails the logits.

Routed experts: `runtime.experts.vanilla.TorchEagerBf16Experts` when it exists and the run is bf16 (its
format); otherwise `LoopExperts` below, a per-expert loop with the same constructor-free contract
(`load_weights(source)`, `forward(hidden, topk_ids, topk_weights)`, partial sums under EP / MoE-TP).
"""
from __future__ import annotations

import glob
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from runtime.ops import (
    MLP,
    GQAttention,
    LMHead,
    MLAttention,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
)
from runtime.ops.rotary import mla_softmax_scale
from runtime.parallel import Layout
from runtime.routing import LinearTopKSoftmaxRouter, SigmoidTopKRouter, SoftmaxTopKRouter

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "minimax_m2")

# ---------------------------------------------------------------------------------------------------
# Routed experts
# ---------------------------------------------------------------------------------------------------


class LoopExperts(nn.Module):
    """Reference experts: every owned expert runs on every token, weighted by its routing weight (0 if unchosen).

    Dense over tokens on purpose: no data-dependent indexing, trivially correct, fine at test sizes.
    Canonical per-expert tensors (docs/runtime.md): gate/up `[I, H]`, down `[H, I]`, optional biases.
    Under EP this rank owns experts `[ep_rank * E/ep, (ep_rank + 1) * E/ep)`; under MoE-TP it owns rows
    `moe_tp_rank` of gate/up and the matching columns of down, and only MoE-TP rank 0 adds the down bias.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu_glu",
        expert_bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        moe_tp_rank: int = 0,
        moe_tp_size: int = 1,
        ep_rank: int = 0,
        ep_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.local = num_experts // ep_size
        self.first = ep_rank * self.local
        self.inter = intermediate_size // moe_tp_size
        self.rows = slice(moe_tp_rank * self.inter, (moe_tp_rank + 1) * self.inter)
        self.activation = activation
        self.alpha, self.limit = swiglu_alpha, swiglu_limit
        self.add_down_bias = expert_bias and moe_tp_rank == 0
        e, i, h = self.local, self.inter, hidden_size
        self.gate = nn.Parameter(torch.empty(e, i, h, dtype=dtype), requires_grad=False)
        self.up = nn.Parameter(torch.empty(e, i, h, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.expert_bias = expert_bias
        if expert_bias:
            self.gate_bias = nn.Parameter(torch.empty(e, i, dtype=dtype), requires_grad=False)
            self.up_bias = nn.Parameter(torch.empty(e, i, dtype=dtype), requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)

    @torch.no_grad()
    def load_weights(self, source) -> None:
        for e in range(self.local):
            g = self.first + e
            self.gate[e].copy_(source.get(g, "gate", "weight", rows=self.rows))
            self.up[e].copy_(source.get(g, "up", "weight", rows=self.rows))
            self.down[e].copy_(source.get(g, "down", "weight", cols=self.rows))
            if self.expert_bias:
                self.gate_bias[e].copy_(source.get(g, "gate", "bias")[self.rows])
                self.up_bias[e].copy_(source.get(g, "up", "bias")[self.rows])
                self.down_bias[e].copy_(source.get(g, "down", "bias"))

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu_glu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(self.alpha * gate))

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for e in range(self.local):
            token_weight = (topk_weights * (topk_ids == self.first + e)).sum(dim=-1, keepdim=True)
            gate = F.linear(hidden, self.gate[e], self.gate_bias[e] if self.expert_bias else None)
            up = F.linear(hidden, self.up[e], self.up_bias[e] if self.expert_bias else None)
            y = F.linear(self._act(gate, up), self.down[e], self.down_bias[e] if self.add_down_bias else None)
            out += token_weight * y.float()
        return out.to(hidden.dtype)


def _vanilla_class():
    try:
        from runtime.experts.vanilla import TorchEagerBf16Experts
    except ImportError:
        return None
    return TorchEagerBf16Experts


def make_experts(
    *, num_experts, hidden_size, intermediate_size, top_k, activation="silu_glu", expert_bias=False,
    swiglu_limit=7.0, layout: Layout, rank: int, dtype,
) -> nn.Module:
    """The runtime's VANILLA bf16 class for bf16 runs once it exists, else `LoopExperts`."""
    vanilla = _vanilla_class()
    if vanilla is not None and dtype == torch.bfloat16:
        from runtime.experts.base import ExpertParallel, MoeLayerSpec

        spec = MoeLayerSpec(
            hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts, top_k=top_k,
            activation=activation, expert_bias=expert_bias, swiglu_limit=swiglu_limit,
        )
        parallel = ExpertParallel(
            moe_tp_size=layout.moe_tp, moe_tp_rank=layout.moe_tp_rank(rank), ep_size=layout.ep,
            ep_rank=layout.ep_rank(rank),
        )
        return vanilla(spec, parallel)
    return LoopExperts(
        num_experts=num_experts, hidden_size=hidden_size, intermediate_size=intermediate_size, activation=activation,
        expert_bias=expert_bias, swiglu_limit=swiglu_limit, moe_tp_rank=layout.moe_tp_rank(rank),
        moe_tp_size=layout.moe_tp, ep_rank=layout.ep_rank(rank), ep_size=layout.ep, dtype=dtype,
    )


class CheckpointExpertSource:
    """`ExpertTensorSource` over a dict of checkpoint tensors, for one layer's `...experts.` prefix.

    Three layouts: per-expert `gate_proj/up_proj/down_proj` (DeepSeek, GLM, Qwen), `w1/w3/w2` (Mixtral,
    MiniMax-M2), and gpt-oss's fused `gate_up_proj [E, H, 2I]` (transposed, gate/up interleaved by column)
    with `down_proj [E, I, H]` and their biases, as transformers saves an unquantized gpt-oss.
    """

    PER_EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        self.tensors, self.prefix = tensors, prefix
        self.fused = f"{prefix}gate_up_proj" in tensors
        self.names = self.MIXTRAL if f"{prefix}0.w1.weight" in tensors else self.PER_EXPERT
        self.consumed: set[str] = set()

    def name(self, expert: int, proj: str, kind: str) -> str:
        if self.fused:
            base = "down_proj" if proj == "down" else "gate_up_proj"
            return f"{self.prefix}{base}" + ("_bias" if kind == "bias" else "")
        return f"{self.prefix}{expert}.{self.names[proj]}.{kind}"

    def _full(self, expert: int, proj: str, kind: str) -> torch.Tensor:
        name = self.name(expert, proj, kind)
        self.consumed.add(name)
        if not self.fused:
            return self.tensors[name]
        t = self.tensors[name][expert]
        if proj == "down":
            return t if kind == "bias" else t.t()
        pick = slice(0, None, 2) if proj == "gate" else slice(1, None, 2)
        return t[pick] if kind == "bias" else t[:, pick].t()

    def shape(self, expert, proj, kind):
        return tuple(self._full(expert, proj, kind).shape) if self.name(expert, proj, kind) in self.tensors else None

    def dtype(self, expert, proj, kind):
        return self._full(expert, proj, kind).dtype

    def get(self, expert, proj, kind, rows=None, cols=None):
        t = self._full(expert, proj, kind)
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t.contiguous()


# ---------------------------------------------------------------------------------------------------
# The model skeleton a generated file contains
# ---------------------------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: `h += attn(norm(h)); h += mlp(norm(h))`. `mlp` is a dense MLP or an MoE block."""

    def __init__(self, *, self_attn, mlp, input_layernorm, post_attention_layernorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, hidden, positions, cos, sin, cache=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BlockSparseMoeDecoderLayer(nn.Module):
    """The same layer for checkpoints that name the MoE block `block_sparse_moe` (Mixtral, MiniMax-M2)."""

    def __init__(self, *, self_attn, block_sparse_moe, input_layernorm, post_attention_layernorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.block_sparse_moe = block_sparse_moe
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, hidden, positions, cos, sin, cache=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cos, sin, cache)
        return hidden + self.block_sparse_moe(self.post_attention_layernorm(hidden))


class Backbone(nn.Module):
    def __init__(self, *, embed_tokens, layers, norm, rotary_emb) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb


class CausalLM(nn.Module):
    """`forward(input_ids [B, S], positions [S], caches=None) -> logits [B, S, V]`; `model.*` + `lm_head` names."""

    def __init__(self, *, embed_tokens, layers, norm, lm_head, rotary_emb) -> None:
        super().__init__()
        self.model = Backbone(embed_tokens=embed_tokens, layers=layers, norm=norm, rotary_emb=rotary_emb)
        self.lm_head = lm_head

    def new_caches(self, *, batch_size, max_seq_len, dtype, device=None):
        return [
            layer.self_attn.new_cache(batch_size=batch_size, max_seq_len=max_seq_len, dtype=dtype, device=device)
            for layer in self.model.layers
        ]

    def hidden_states(self, input_ids, positions, caches=None):
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, positions, cos, sin, None if caches is None else caches[i])
        return self.model.norm(hidden)

    def forward(self, input_ids, positions, caches=None):
        return self.lm_head(self.hidden_states(input_ids, positions, caches))


# ---------------------------------------------------------------------------------------------------
# Builders: one per family; each reads like the template that will replace it
# ---------------------------------------------------------------------------------------------------


def _rope(params: dict, rotary_dim: int) -> RotaryEmbedding:
    """The rotary constants of a config's `rope_parameters`, as a template would inline them."""
    kind = params.get("rope_type", "default")
    extra = {}
    if kind == "yarn":
        extra = dict(
            factor=params["factor"], original_max_position_embeddings=params["original_max_position_embeddings"],
            beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
            truncate=params.get("truncate", True), mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"), attention_factor=params.get("attention_factor"),
        )
    elif kind == "llama3":
        extra = dict(
            factor=params["factor"], original_max_position_embeddings=params["original_max_position_embeddings"],
            low_freq_factor=params["low_freq_factor"], high_freq_factor=params["high_freq_factor"],
        )
    return RotaryEmbedding(rotary_dim=rotary_dim, base=params["rope_theta"], scaling=kind, **extra)


def _head_and_embed(c, tp_rank, tp, dtype):
    return (
        VocabEmbedding(vocab_size=c.vocab_size, hidden_size=c.hidden_size, tp_rank=tp_rank, tp_size=tp, dtype=dtype),
        LMHead(hidden_size=c.hidden_size, vocab_size=c.vocab_size, tp_rank=tp_rank, tp_size=tp, dtype=dtype),
    )


def build_deepseek_v3(c, *, dtype, layout: Layout = Layout(), rank: int = 0) -> CausalLM:
    """DeepSeek-V3 / Kimi-K2: MLA, dense first `first_k_dense_replace` layers, sigmoid-routed MoE + shared experts."""
    H, EPS, TP_RANK, TP = c.hidden_size, c.rms_norm_eps, layout.tp_rank(rank), layout.tp
    rope = c.rope_parameters
    SCALE = mla_softmax_scale(
        c.qk_nope_head_dim + c.qk_rope_head_dim, rope.get("rope_type", "default"), rope.get("factor", 1.0),
        rope.get("mscale_all_dim") or 0.0,
    )
    LAYER_IS_MOE = [i >= c.first_k_dense_replace for i in range(c.num_hidden_layers)]

    def layer(is_moe: bool) -> DecoderLayer:
        if is_moe:
            mlp = MoEBlock(
                gate=SigmoidTopKRouter(
                    hidden_size=H, num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, n_group=c.n_group,
                    topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                    routed_scaling_factor=c.routed_scaling_factor,
                ),
                experts=make_experts(
                    num_experts=c.n_routed_experts, hidden_size=H, intermediate_size=c.moe_intermediate_size,
                    top_k=c.num_experts_per_tok, layout=layout, rank=rank, dtype=dtype,
                ),
                shared_experts=MLP(
                    hidden_size=H, intermediate_size=c.moe_intermediate_size * c.n_shared_experts, tp_rank=TP_RANK,
                    tp_size=TP, reduce_output=False, dtype=dtype,
                ),
                layout=layout,
            )
        else:
            mlp = MLP(hidden_size=H, intermediate_size=c.intermediate_size, tp_rank=TP_RANK, tp_size=TP, dtype=dtype)
        return DecoderLayer(
            self_attn=MLAttention(
                hidden_size=H, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, softmax_scale=SCALE,
                rms_norm_eps=EPS, attention_bias=c.attention_bias, interleaved_rope=c.rope_interleave,
                tp_rank=TP_RANK, tp_size=TP, dtype=dtype,
            ),
            mlp=mlp,
            input_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
            post_attention_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        )

    embed, head = _head_and_embed(c, TP_RANK, TP, dtype)
    return CausalLM(
        embed_tokens=embed, layers=[layer(m) for m in LAYER_IS_MOE], norm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        lm_head=head, rotary_emb=_rope(rope, c.qk_rope_head_dim),
    )


def build_glm4_moe(c, *, dtype, layout: Layout = Layout(), rank: int = 0) -> CausalLM:
    """GLM-4.5/4.6: GQA with qkv bias, partial half-split rotary, optional per-head qk-norm; DeepSeek-style MoE."""
    H, EPS, TP_RANK, TP = c.hidden_size, c.rms_norm_eps, layout.tp_rank(rank), layout.tp
    HEAD_DIM = c.head_dim
    ROTARY_DIM = int(HEAD_DIM * c.rope_parameters.get("partial_rotary_factor", 1.0))
    LAYER_IS_MOE = [i >= c.first_k_dense_replace for i in range(c.num_hidden_layers)]

    def layer(is_moe: bool) -> DecoderLayer:
        if is_moe:
            mlp = MoEBlock(
                gate=SigmoidTopKRouter(
                    hidden_size=H, num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, n_group=c.n_group,
                    topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                    routed_scaling_factor=c.routed_scaling_factor,
                ),
                experts=make_experts(
                    num_experts=c.n_routed_experts, hidden_size=H, intermediate_size=c.moe_intermediate_size,
                    top_k=c.num_experts_per_tok, layout=layout, rank=rank, dtype=dtype,
                ),
                shared_experts=MLP(
                    hidden_size=H, intermediate_size=c.moe_intermediate_size * c.n_shared_experts, tp_rank=TP_RANK,
                    tp_size=TP, reduce_output=False, dtype=dtype,
                ),
                layout=layout,
            )
        else:
            mlp = MLP(hidden_size=H, intermediate_size=c.intermediate_size, tp_rank=TP_RANK, tp_size=TP, dtype=dtype)
        return DecoderLayer(
            self_attn=GQAttention(
                hidden_size=H, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=HEAD_DIM,
                qkv_bias=c.attention_bias, o_bias=False, qk_norm="head" if c.use_qk_norm else "none",
                rms_norm_eps=EPS, tp_rank=TP_RANK, tp_size=TP, dtype=dtype,
            ),
            mlp=mlp,
            input_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
            post_attention_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        )

    embed, head = _head_and_embed(c, TP_RANK, TP, dtype)
    return CausalLM(
        embed_tokens=embed, layers=[layer(m) for m in LAYER_IS_MOE], norm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        lm_head=head, rotary_emb=_rope(c.rope_parameters, ROTARY_DIM),
    )


def build_qwen3_moe(c, *, dtype, layout: Layout = Layout(), rank: int = 0) -> CausalLM:
    """Qwen3-MoE: GQA with per-head qk-norm, softmax top-k routing, no shared expert."""
    H, EPS, TP_RANK, TP = c.hidden_size, c.rms_norm_eps, layout.tp_rank(rank), layout.tp
    HEAD_DIM = c.head_dim or H // c.num_attention_heads
    LAYER_IS_MOE = [
        i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
        for i in range(c.num_hidden_layers)
    ]

    def layer(is_moe: bool) -> DecoderLayer:
        if is_moe:
            mlp = MoEBlock(
                gate=SoftmaxTopKRouter(
                    hidden_size=H, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                    norm_topk_prob=c.norm_topk_prob, dtype=dtype,
                ),
                experts=make_experts(
                    num_experts=c.num_experts, hidden_size=H, intermediate_size=c.moe_intermediate_size,
                    top_k=c.num_experts_per_tok, layout=layout, rank=rank, dtype=dtype,
                ),
                layout=layout,
            )
        else:
            mlp = MLP(hidden_size=H, intermediate_size=c.intermediate_size, tp_rank=TP_RANK, tp_size=TP, dtype=dtype)
        return DecoderLayer(
            self_attn=GQAttention(
                hidden_size=H, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=HEAD_DIM,
                qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm="head", rms_norm_eps=EPS,
                sliding_window=c.sliding_window, tp_rank=TP_RANK, tp_size=TP, dtype=dtype,
            ),
            mlp=mlp,
            input_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
            post_attention_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        )

    embed, head = _head_and_embed(c, TP_RANK, TP, dtype)
    return CausalLM(
        embed_tokens=embed, layers=[layer(m) for m in LAYER_IS_MOE], norm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        lm_head=head, rotary_emb=_rope(c.rope_parameters, HEAD_DIM),
    )


def build_mixtral(c, *, dtype, layout: Layout = Layout(), rank: int = 0) -> CausalLM:
    """Mixtral: plain GQA, softmax top-2 always renormalised, `block_sparse_moe` with `w1/w3/w2` experts."""
    H, EPS, TP_RANK, TP = c.hidden_size, c.rms_norm_eps, layout.tp_rank(rank), layout.tp
    HEAD_DIM = c.head_dim or H // c.num_attention_heads

    def layer() -> BlockSparseMoeDecoderLayer:
        return BlockSparseMoeDecoderLayer(
            self_attn=GQAttention(
                hidden_size=H, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=HEAD_DIM,
                sliding_window=c.sliding_window, tp_rank=TP_RANK, tp_size=TP, dtype=dtype,
            ),
            block_sparse_moe=MoEBlock(
                gate=SoftmaxTopKRouter(
                    hidden_size=H, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok, norm_topk_prob=True,
                    dtype=dtype,
                ),
                experts=make_experts(
                    num_experts=c.num_local_experts, hidden_size=H, intermediate_size=c.intermediate_size,
                    top_k=c.num_experts_per_tok, layout=layout, rank=rank, dtype=dtype,
                ),
                layout=layout,
            ),
            input_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
            post_attention_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        )

    embed, head = _head_and_embed(c, TP_RANK, TP, dtype)
    return CausalLM(
        embed_tokens=embed, layers=[layer() for _ in range(c.num_hidden_layers)],
        norm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype), lm_head=head, rotary_emb=_rope(c.rope_parameters, HEAD_DIM),
    )


def build_minimax_m2(c, *, dtype, layout: Layout = Layout(), rank: int = 0) -> CausalLM:
    """MiniMax-M2: GQA with qk-norm over the whole projection, partial rotary, sigmoid routing with the bias
    on `block_sparse_moe`, no groups, no scaling, no shared expert."""
    H, EPS, TP_RANK, TP = c.hidden_size, c.rms_norm_eps, layout.tp_rank(rank), layout.tp
    HEAD_DIM = c.head_dim
    ROTARY_DIM = int(HEAD_DIM * c.rope_parameters.get("partial_rotary_factor", 1.0))

    def layer() -> BlockSparseMoeDecoderLayer:
        return BlockSparseMoeDecoderLayer(
            self_attn=GQAttention(
                hidden_size=H, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=HEAD_DIM,
                qk_norm="projection", rms_norm_eps=EPS, tp_rank=TP_RANK, tp_size=TP, dtype=dtype,
            ),
            block_sparse_moe=MoEBlock(
                gate=SigmoidTopKRouter(
                    hidden_size=H, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok, norm_topk_prob=True,
                    fp32_gemm=False, bias_on_block=True, dtype=dtype,
                ),
                experts=make_experts(
                    num_experts=c.num_local_experts, hidden_size=H, intermediate_size=c.intermediate_size,
                    top_k=c.num_experts_per_tok, layout=layout, rank=rank, dtype=dtype,
                ),
                layout=layout,
            ),
            input_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
            post_attention_layernorm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype),
        )

    embed, head = _head_and_embed(c, TP_RANK, TP, dtype)
    return CausalLM(
        embed_tokens=embed, layers=[layer() for _ in range(c.num_hidden_layers)],
        norm=RMSNorm(hidden_size=H, eps=EPS, dtype=dtype), lm_head=head,
        rotary_emb=_rope(c.rope_parameters, ROTARY_DIM),
    )


def build_gpt_oss(c, *, dtype, layout: Layout = Layout(), rank: int = 0) -> CausalLM:
    """gpt-oss: GQA with all biases, sinks, alternating sliding/full layers, YaRN; biased router; clamped SwiGLU
    experts with biases; norms multiply in fp32."""
    H, EPS, TP_RANK, TP = c.hidden_size, c.rms_norm_eps, layout.tp_rank(rank), layout.tp
    HEAD_DIM = c.head_dim
    SLIDING_WINDOW = [c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]

    def layer(window: int | None) -> DecoderLayer:
        return DecoderLayer(
            self_attn=GQAttention(
                hidden_size=H, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=HEAD_DIM,
                qkv_bias=c.attention_bias, o_bias=c.attention_bias, sinks=True, sliding_window=window,
                tp_rank=TP_RANK, tp_size=TP, dtype=dtype,
            ),
            mlp=MoEBlock(
                router=LinearTopKSoftmaxRouter(
                    hidden_size=H, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok, dtype=dtype
                ),
                experts=make_experts(
                    num_experts=c.num_local_experts, hidden_size=H, intermediate_size=c.intermediate_size,
                    top_k=c.num_experts_per_tok, activation="swiglu_oai", expert_bias=True,
                    swiglu_limit=c.swiglu_limit, layout=layout, rank=rank, dtype=dtype,
                ),
                layout=layout,
            ),
            input_layernorm=RMSNorm(hidden_size=H, eps=EPS, multiply_in_fp32=True, dtype=dtype),
            post_attention_layernorm=RMSNorm(hidden_size=H, eps=EPS, multiply_in_fp32=True, dtype=dtype),
        )

    embed, head = _head_and_embed(c, TP_RANK, TP, dtype)
    return CausalLM(
        embed_tokens=embed, layers=[layer(w) for w in SLIDING_WINDOW],
        norm=RMSNorm(hidden_size=H, eps=EPS, multiply_in_fp32=True, dtype=dtype), lm_head=head,
        rotary_emb=_rope(c.rope_parameters, HEAD_DIM),
    )


BUILDERS = {
    "deepseek_v3": build_deepseek_v3,
    "glm4_moe": build_glm4_moe,
    "qwen3_moe": build_qwen3_moe,
    "mixtral": build_mixtral,
    "minimax_m2": build_minimax_m2,
    "gpt_oss": build_gpt_oss,
}

# ---------------------------------------------------------------------------------------------------
# Tiny configs, the transformers oracle, and loading its checkpoint into ours
# ---------------------------------------------------------------------------------------------------

_COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
)
TINY = {
    "deepseek_v3": dict(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_key_value_heads=4, rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        ),
    ),
    "glm4_moe": dict(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1, first_k_dense_replace=1,
        head_dim=16, attention_bias=True, use_qk_norm=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    ),
    "qwen3_moe": dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
        head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "mixtral": dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "minimax_m2": dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=3, head_dim=16, bos_token_id=None,
        eos_token_id=None, rotary_dim=8,  # the checkpoints' field; the factor too, for transformers < 5.2x
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5),
    ),
    "gpt_oss": dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=4,
        num_hidden_layers=4, swiglu_limit=7.0, attention_bias=True,
        # The real 32x stretch of a 4096 context, scaled down so the tiny max length stays consistent.
        rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, truncate=False,
        ),
    ),
}


def tiny_config(family: str, **overrides):
    """A tiny transformers config of `family` (all fields that matter stated, so the test is about them)."""
    from transformers import AutoConfig

    kwargs = {**_COMMON, **TINY[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


@torch.no_grad()
def hf_model(config, *, dtype: torch.dtype, seed: int):
    """The transformers model, random-initialised from `seed`, eager attention, in `dtype`.

    Tensors transformers initialises to constants (norm weights 1, correction biases and expert biases
    0) are re-drawn, so that a weight loaded into the wrong place cannot go unnoticed.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or t.numel() == 0:
            continue
        flat = t.detach().float().flatten()
        if not bool((flat == flat[0]).all()):
            continue
        if "norm" in name:
            fresh = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
        else:
            fresh = 0.1 * torch.randn(t.shape, generator=gen)
        t.copy_(fresh.to(t.dtype))
    return model


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes: the checkpoint's names and layout, as our loader will see them."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tensors = {}
        for path in sorted(glob.glob(f"{folder}/*.safetensors")):
            tensors.update(load_file(path))
    return tensors


def is_experts(module: nn.Module) -> bool:
    return isinstance(module, LoopExperts) or hasattr(type(module), "IMPL_ID")


@torch.no_grad()
def load_checkpoint(model: nn.Module, tensors: dict[str, torch.Tensor], *, expert_parallel: bool = False) -> None:
    """Fill every tensor of `model` from checkpoint tensors by name (chunk `rank` of `size` for shards).

    Strict both ways: a parameter with no tensor, a shape mismatch, or a checkpoint tensor nobody read
    raises, naming the tensor; with `expert_parallel` the experts of other ranks may stay unread.
    """
    consumed: set[str] = set()
    expert_prefixes = []
    for name, module in model.named_modules():
        if is_experts(module):
            source = CheckpointExpertSource(tensors, f"{name}.")
            module.load_weights(source)
            consumed |= source.consumed
            expert_prefixes.append(f"{name}.")
    for name, param in model.named_parameters():
        if any(name.startswith(p) for p in expert_prefixes):
            continue
        if name not in tensors:
            raise KeyError(f"no checkpoint tensor for parameter {name}")
        full = tensors[name]
        if hasattr(param, "shard"):
            dim, rank, size = param.shard
            full = full.chunk(size, dim=dim)[rank]
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint chunk {tuple(full.shape)} vs parameter {tuple(param.shape)}")
        param.copy_(full)
        consumed.add(name)
    unread = sorted(
        n for n in set(tensors) - consumed if not (expert_parallel and any(n.startswith(p) for p in expert_prefixes))
    )
    if unread:
        raise KeyError(f"checkpoint tensors not loaded: {unread[:8]}{' ...' if len(unread) > 8 else ''}")


def assemble(family: str, *, dtype: torch.dtype, seed: int, layout: Layout = Layout(), rank: int = 0, **overrides):
    """(our model for `rank` of `layout`, the transformers model) with identical weights, both in eval mode."""
    config = tiny_config(family, **overrides)
    reference = hf_model(config, dtype=dtype, seed=seed)
    ours = BUILDERS[family](config, dtype=dtype, layout=layout, rank=rank).eval()
    load_checkpoint(ours, checkpoint_tensors(reference), expert_parallel=layout.ep > 1)
    return ours, reference
