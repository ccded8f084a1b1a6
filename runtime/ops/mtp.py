"""The multi-token-prediction (MTP) draft blocks: DeepSeek-V3's and GLM-4.5's (`MTPBlock`), Qwen3-Next's (`FcMTPPredictor`) and Nemotron-H's (`PatternMTPPredictor`), each fed by the target's hidden state and the next token's embedding.

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


class FcMTPPredictor(nn.Module):
    """Qwen3-Next's MTP predictor, its tensors named as its checkpoints store them under `mtp.` (the names of
    vLLM's `qwen3_next_mtp.py`, `Qwen3NextMultiTokenPredictor`, which maps `mtp.*` onto its module one to one):
    `x = fc(cat([pre_fc_norm_embedding(embed(token[t+1])), pre_fc_norm_hidden(h[t])]))`, then the decoder layer
    `layers[step % n]` (full attention with the MoE block), then `norm`. One `fc` and its two norms serve every
    step. The result, after `norm`, is what the head reads and what the next draft step reads (as vLLM chains it).

    `forward(inputs_embeds, previous_hidden, step, *layer_args) -> hidden`; `layers` are modules with a `self_attn`
    whose `new_cache(**sizes)` is the step's cache; `make_norm()` builds one of the family's norms.
    """

    def __init__(self, *, hidden_size: int, layers, make_norm, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(in_features=2 * hidden_size, out_features=hidden_size, dtype=dtype)
        self.pre_fc_norm_embedding = make_norm()
        self.pre_fc_norm_hidden = make_norm()
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm()

    def new_caches(self, **sizes) -> list:
        return [layer.self_attn.new_cache(**sizes) for layer in self.layers]

    def forward(self, inputs_embeds: torch.Tensor, previous_hidden: torch.Tensor, step: int, *layer_args) -> torch.Tensor:
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(inputs_embeds), self.pre_fc_norm_hidden(previous_hidden)), dim=-1))
        return self.norm(self.layers[step % len(self.layers)](x, *layer_args))


class PatternMTPPredictor(nn.Module):
    """Nemotron-H's MTP predictor, named as its checkpoints store it (vLLM's `nemotron_h_mtp.py`,
    `NemotronHMultiTokenPredictor`): `mtp.layers.<i>` for each letter of `mtp_hybrid_override_pattern` (`*E`:
    an attention layer, then an MoE layer), each the family's `norm` + `mixer` residual layer; the first also
    holds `enorm`, `hnorm` and `eh_proj` (`x = eh_proj(cat([enorm(embed(token[t+1])), hnorm(h[t])]))`), the last
    `final_layernorm`, applied after its residual. The result, after `final_layernorm`, is what the head reads
    and what the next draft step reads. vLLM builds exactly one such step (it asserts num_nextn_predict_layers
    == 1), so every draft step runs the same layers.

    `forward(inputs_embeds, previous_hidden, step, positions, cos, sin, cache) -> hidden`: `cache` is the list
    of `new_caches()[0]`, one entry per layer (None for a layer without one).
    """

    def __init__(self, *, hidden_size: int, layers, make_norm, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        first, last = layers[0], layers[-1]
        for name in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            if hasattr(first, name) or hasattr(last, name):
                raise ValueError(f"MTP layer child {name!r} collides with an MTP tensor name")
        first.add_module("enorm", make_norm())
        first.add_module("hnorm", make_norm())
        first.add_module("eh_proj", ColumnParallelLinear(in_features=2 * hidden_size, out_features=hidden_size, dtype=dtype))
        last.add_module("final_layernorm", make_norm())
        self._first, self._last = [first], [last]   # in lists: registered once, under `layers`

    def new_caches(self, **sizes) -> list:
        return [[layer.new_cache(**sizes) for layer in self.layers.values()]]

    def forward(self, inputs_embeds, previous_hidden, step, positions, cos, sin, cache=None) -> torch.Tensor:
        first = self._first[0]
        x = first.eh_proj(torch.cat((first.enorm(inputs_embeds), first.hnorm(previous_hidden)), dim=-1))
        caches = cache if cache is not None else [None] * len(self.layers)
        for layer, layer_cache in zip(self.layers.values(), caches):
            x = layer(x, positions, cos, sin, layer_cache)
        return self._last[0].final_layernorm(x)
