"""The MTP block: its formula in float64 (research §4) and its refusal of a layer with tensors of its own.

The generated MTP drafts, which wrap a family's decoder layer in this block, are compared with
transformers' `MtpLayer` in tests/generated/test_mtp_draft.py. Tolerance: float64 formula, fp32 block,
1e-5 relative.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from runtime.ops.mtp import MTPBlock

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
