"""Eagle3 draft head: the target's low/mid/high hidden states fused by `fc`, one decoder layer over concat(embedding, fused hidden), its own norm and lm_head over a draft vocabulary, and the draft-to-target id map.

Tensor names are those of published Eagle3 checkpoints as vLLM's `llama_eagle3.py` loads them: `fc.weight
[H, 3 H_target]`, `midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]`, `midlayer.self_attn.o_proj.weight [H, heads x head_dim]`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight [V_draft, H]`, `embed_tokens.weight`
(or none: `share_embedding`), `d2t [V_draft]` (int64 offsets: target id = d + d2t[d]) and `t2d [V]` (bool: the target ids the draft
vocabulary covers). The layer (vLLM `LlamaDecoderLayer`, layer 0, norm after residual):
`r = fused; x = cat(input_layernorm(embed(ids)), hidden_norm(fused)); h = o_proj(attn(x)) + r;
out = mlp(post_attention_layernorm(h)) + h`; logits = lm_head(norm(out)); `out` feeds the next draft step.
Replicated under tensor parallel (the head is small), as vLLM's ReplicatedLinear `fc`.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.ops.embedding import LMHead, VocabEmbedding
from runtime.ops.gqa import GQAttention
from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear
from runtime.ops.mlp import MLP
from runtime.ops.norms import RMSNorm


class Eagle3Layer(nn.Module):
    """`midlayer`: `forward(embeds, fused, positions, cos, sin, cache) -> out [B, S, H]`."""

    def __init__(self, *, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, rms_norm_eps, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        # q, k and v read the 2H concatenation; o_proj returns to H (GQAttention's o_proj maps back to its
        # input width, so it is replaced).
        self.self_attn = GQAttention(
            hidden_size=2 * hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rms_norm_eps=rms_norm_eps, dtype=dtype,
        )
        self.self_attn.o_proj = RowParallelLinear(in_features=num_heads * head_dim, out_features=hidden_size, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        self.mlp = MLP(hidden_size=hidden_size, intermediate_size=intermediate_size, dtype=dtype)

    def forward(self, embeds, fused, positions, cos, sin, cache=None):
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(fused)), dim=-1)
        hidden = fused + self.self_attn(x, positions, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """`forward(ids [B, S], hidden [B, S, 3 H_target] at step 0 | [B, S, H] after, positions, cos, sin, cache, step)
    -> (logits [B, S, V_draft], out [B, S, H])`; `to_target_ids` maps draft ids through `d2t`."""

    def __init__(
        self, *, vocab_size, draft_vocab_size, hidden_size, target_hidden_size, intermediate_size, num_heads,
        num_kv_heads, head_dim, rms_norm_eps, dtype=None,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size=vocab_size, hidden_size=hidden_size, dtype=dtype)
        self.fc = ColumnParallelLinear(in_features=3 * target_hidden_size, out_features=hidden_size, dtype=dtype)
        self.midlayer = Eagle3Layer(
            hidden_size=hidden_size, intermediate_size=intermediate_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, rms_norm_eps=rms_norm_eps, dtype=dtype,
        )
        self.norm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        self.lm_head = LMHead(hidden_size=hidden_size, vocab_size=draft_vocab_size, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self._shared_embedding = None

    def share_embedding(self, embedding: nn.Module) -> None:
        """Embed with the target's `embed_tokens` instead of an own copy: published heads that ship no
        `embed_tokens.weight` read the target's, as vLLM does. The own copy is dropped, so a checkpoint
        load no longer expects it; the target's stays outside this module (loaded with the target)."""
        del self.embed_tokens
        self._shared_embedding = (embedding,)

    def forward(self, ids, hidden, positions, cos, sin, cache=None, step=0):
        # Step 0 reads the target's concatenated low/mid/high states; later steps the head's own output.
        fused = self.fc(hidden) if step == 0 else hidden
        embed = self.embed_tokens if self._shared_embedding is None else self._shared_embedding[0]
        out = self.midlayer(embed(ids), fused, positions, cos, sin, cache)
        return self.lm_head(self.norm(out)), out

    def to_target_ids(self, ids):
        return ids + self.d2t[ids]
