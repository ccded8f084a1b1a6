"""A Qwen3-Next build with several DeltaNet layers and a dense layer, made by the CLI from a checkpoint transformers
saved, loaded by `load_model`: its logits are transformers' (fp32), and decoding through its caches (KV caches and
the DeltaNet's recurrent states) gives the full forward's logits.

Tolerances (fp32, VANILLA experts): relative L2 error of the logits <= 1e-5 over the whole tensor, and at every
position the largest logit difference within 2e-5 of the largest logit, as the other families' parity tests. The
decoded logits get 1e-4: a decode step runs each layer on one token where the full forward runs all 16 at once,
so its matmuls and attention sum in fp32 in another order; over 800 fresh draws of token ids they differed from the
full forward's by at most 6.1e-5 of the largest logit (2e-5 failed in 4 of them). transformers' own cached
decode drifts from its full forward alike (worst of 150 draws: 1.2e-5, ours 0.9e-5).
"""
from __future__ import annotations

import torch

from tests.generated import builds

# Layers 0 and 2 DeltaNet, 1 and 3 gated attention (full_attention_interval 2); 0 and 2 dense MLPs, 1 and 3 MoE.
OVERRIDES = dict(num_hidden_layers=4, decoder_sparse_step=2, intermediate_size=96)
DECODE_TOL = 1e-4   # the decoded logits against the full forward's (module docstring)


def test_a_four_layer_build_by_the_cli_computes_transformers_logits_and_decodes_to_them():
    package, folder = builds.variant_build("qwen3_next_four_layers", "tiny_qwen3_next", **OVERRIDES)
    ours = package.load_model("qwen3_next_four_layers", 90, checkpoint=folder, moe_config={"backend": "VANILLA"},
                              dtype=torch.float32)
    assert [type(layer).__name__ for layer in ours.model.layers] == [
        "LinearAttentionLayer", "DecoderLayer", "LinearAttentionLayer", "DecoderLayer"]
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["MLP", "MoEBlock", "MLP", "MoEBlock"]
    reference = builds.transformers_model(folder, torch.float32)
    ids = builds.token_ids(builds.facts("tiny_qwen3_next").CONFIG["vocab_size"], batch=2, length=16)
    prefill = 9
    with torch.no_grad():
        full, expected = ours(ids), reference(ids).logits
        decoder = ours.decoder(2, 16)
        decoder.prefill(ids[:, :3])    # a shorter prompt first: the next prefill must start from empty states
        steps = [decoder.prefill(ids[:, :prefill])] + [decoder.step(ids[:, t]) for t in range(prefill, 16)]
    assert builds.rel_err(full, expected) <= 1e-5
    assert builds.largest_diff(full, expected).max() < 2e-5
    decoded = torch.stack(steps, dim=1)   # the logits of positions prefill-1 .. 15
    assert builds.largest_diff(decoded, full[:, prefill - 1:]).max() < DECODE_TOL
    assert builds.largest_diff(decoded, expected[:, prefill - 1:]).max() < DECODE_TOL
