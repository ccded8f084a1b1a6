"""The MTP block: its formula in float64 (research §4), and a DeepSeek-V3 MTP layer against transformers' `MtpLayer`.

transformers 5.x ships a generic `MtpLayer` (enorm, hnorm, eh_proj over [embedding, hidden], a decoder
layer, a post norm) used for DeepSeek-V3/GLM drafts; its `post_norm` is the checkpoint's
`shared_head.norm` (transformers renames it on load). Tolerances: float64 formula, fp32 block, 1e-5
relative; the transformers layer, fp32, atol 2e-5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from runtime.ops.mtp import MTPBlock
from tests.runtime.assemble import CheckpointExpertSource, build_deepseek_v3, is_experts, tiny_config

H, V = 32, 50


class _ToyLayer(nn.Module):
    """A decoder layer whose maths is obvious: `x + tanh(mix(x)) * scale`; extra args pass through."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(H, H, bias=False)

    def forward(self, x, scale):
        return x + torch.tanh(self.mix(x)) * scale


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def test_mtp_block_computes_the_deepseek_formula():
    torch.manual_seed(0)
    block = MTPBlock(hidden_size=H, vocab_size=V, rms_norm_eps=1e-6, decoder_layer=_ToyLayer())
    for p in block.parameters():
        p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    names = {n for n, _ in block.named_parameters()}
    assert names == {"enorm.weight", "hnorm.weight", "eh_proj.weight", "mix.weight", "shared_head.norm.weight",
                     "shared_head.head.weight"}  # the layer's tensors sit beside enorm/hnorm, as in the checkpoint
    emb, hid = torch.randn(3, 5, H), 4 * torch.randn(3, 5, H)
    hidden = block(emb, hid, 0.5)
    logits = block.shared_head(hidden)

    p = {n: t.double() for n, t in block.named_parameters()}
    e, h = _rms(emb.double(), p["enorm.weight"], 1e-6), _rms(hid.double(), p["hnorm.weight"], 1e-6)
    x = torch.cat([e, h], dim=-1) @ p["eh_proj.weight"].T  # embedding first, hidden second
    y = x + torch.tanh(x @ p["mix.weight"].T) * 0.5
    ref_logits = _rms(y, p["shared_head.norm.weight"], 1e-6) @ p["shared_head.head.weight"].T
    torch.testing.assert_close(hidden.double(), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.double(), ref_logits, rtol=1e-5, atol=1e-5)
    # The order matters: hidden-first would be a different model.
    swapped = torch.cat([h, e], dim=-1) @ p["eh_proj.weight"].T
    assert not torch.allclose(swapped, x, atol=1e-3)


def test_mtp_block_refuses_a_layer_with_its_own_tensors():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match="scale"):
        MTPBlock(hidden_size=H, vocab_size=V, rms_norm_eps=1e-6, decoder_layer=Bad())


@torch.no_grad()
def test_deepseek_v3_mtp_layer_matches_transformers_mtp_layer():
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    config = tiny_config("deepseek_v3", num_hidden_layers=2)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    theirs = MtpLayer(config, m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, layer_idx=1).eval()
    g = torch.Generator().manual_seed(2)
    for name, t in list(theirs.named_parameters()) + list(theirs.named_buffers()):
        fresh = torch.randn(t.shape, generator=g)
        t.copy_(1.0 + 0.2 * fresh if "norm" in name else 0.1 * fresh)
    head = torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.1

    # Our MTP layer: the family's MoE decoder layer (layer 1 of the assembled model) wrapped in the block.
    decoder = build_deepseek_v3(config, dtype=torch.float32).model.layers[1]
    ours = MTPBlock(hidden_size=config.hidden_size, vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
                    decoder_layer=decoder).eval()
    rename = {"post_norm.weight": "shared_head.norm.weight"}
    tensors = {rename.get(n, n.removeprefix("mtp_block.")): t for n, t in theirs.state_dict().items()}
    experts_prefix = next(n for n, mod in ours.named_modules() if is_experts(mod))
    gate_up, down = tensors.pop(f"{experts_prefix}.gate_up_proj"), tensors.pop(f"{experts_prefix}.down_proj")
    per_expert = {}
    for e in range(gate_up.shape[0]):
        per_expert[f"{e}.gate_proj.weight"], per_expert[f"{e}.up_proj.weight"] = gate_up[e].chunk(2, dim=0)
        per_expert[f"{e}.down_proj.weight"] = down[e]
    dict(ours.named_modules())[experts_prefix].load_weights(CheckpointExpertSource(per_expert, ""))
    tensors["shared_head.head.weight"] = head
    params = dict(ours.named_parameters())
    for name, t in tensors.items():
        params[name].copy_(t)
    assert set(params) - set(tensors) == {n for n in params if n.startswith(experts_prefix)}

    seq = 9
    emb = torch.randn(2, seq, config.hidden_size, generator=g)
    hid = 3 * torch.randn(2, seq, config.hidden_size, generator=g)
    positions = torch.arange(seq)
    rope = m.DeepseekV3RotaryEmbedding(config)
    mask = create_causal_mask(config, emb, None, None, position_ids=positions[None])  # (cache positional)
    ref = theirs(emb, hid, rope(emb, positions[None].expand(2, -1)), mask, positions[None], None)
    cos, sin = build_deepseek_v3(config, dtype=torch.float32).model.rotary_emb(positions)
    hidden = ours(emb, hid, positions, cos, sin)
    torch.testing.assert_close(ours.shared_head.norm(hidden), ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.shared_head(hidden), ref @ head.T, rtol=0, atol=2e-5)
