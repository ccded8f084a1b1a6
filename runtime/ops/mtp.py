"""The multi-token-prediction (MTP) draft block of DeepSeek-V3 and GLM-4.5: one extra decoder layer fed by the
target's hidden state and the next token's embedding.

Formula (DeepSeek-V3 README_WEIGHTS, vLLM deepseek_mtp; research §4): for position t,
`x = eh_proj(cat([enorm(embed(token_{t+1})), hnorm(h_t)]))` (embedding first, hidden second),
`h' = decoder_layer(x)`, draft logits `= shared_head.head(shared_head.norm(h'))`; `h'` feeds the next
draft step. The checkpoint stores the layer's own tensors *beside* `enorm`/`hnorm`/`eh_proj`/`shared_head`
(`model.layers.61.self_attn.*`, `model.layers.61.enorm.weight`, ...), so the block registers the decoder
layer's children under their own names instead of nesting the layer: loading stays a name lookup.
The token embedding is the caller's (the checkpoint's `embed_tokens` copy equals the main one).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from runtime.ops.embedding import LMHead
from runtime.ops.linear import ColumnParallelLinear
from runtime.ops.norms import RMSNorm


class SharedHead(nn.Module):
    """`shared_head.norm` then `shared_head.head`: hidden -> draft logits."""

    def __init__(
        self, *, hidden_size: int, vocab_size: int, rms_norm_eps: float, tp_rank: int = 0, tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        self.head = LMHead(hidden_size=hidden_size, vocab_size=vocab_size, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class MTPBlock(nn.Module):
    """`forward(inputs_embeds, previous_hidden, *layer_args, **layer_kwargs) -> hidden`; logits via `shared_head`.

    `decoder_layer` is any module whose parameters all live in its children (a generated decoder layer);
    its forward receives the projected input followed by `layer_args`/`layer_kwargs` (positions, cos,
    sin, cache).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        vocab_size: int,
        rms_norm_eps: float,
        decoder_layer: nn.Module,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        own = [n for n, _ in decoder_layer.named_parameters(recurse=False)]
        own += [n for n, _ in decoder_layer.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"the MTP decoder layer must keep its tensors in submodules; it owns {own}")
        self.enorm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(hidden_size=hidden_size, eps=rms_norm_eps, dtype=dtype)
        # [H, 2H], small next to the layer: replicated under TP, as vLLM does.
        self.eh_proj = ColumnParallelLinear(in_features=2 * hidden_size, out_features=hidden_size, dtype=dtype)
        self.shared_head = SharedHead(
            hidden_size=hidden_size, vocab_size=vocab_size, rms_norm_eps=rms_norm_eps, tp_rank=tp_rank,
            tp_size=tp_size, dtype=dtype,
        )
        for name, child in decoder_layer.named_children():
            if hasattr(self, name):
                raise ValueError(f"decoder layer child {name!r} collides with an MTP tensor name")
            self.add_module(name, child)
        # Held in a list so it is not registered a second time (its children already are, above).
        self._decoder_layer = [decoder_layer]

    def forward(self, inputs_embeds: torch.Tensor, previous_hidden: torch.Tensor, *layer_args, **layer_kwargs) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(inputs_embeds), self.hnorm(previous_hidden)), dim=-1))
        return self._decoder_layer[0](x, *layer_args, **layer_kwargs)
