"""The sm_90 specialized builds at real layer shapes decode on the GPU as their full forward does: graph
replay equals the eager step and the decode steps give the full forward's logits (issue 12, "Done when").

Builds: qwen3_30b_a3b (bf16), gpt_oss_120b (MXFP4, sinks, a sliding and a full layer) and deepseek_v3 (FP8
128x128 blocks, MLA, grouped sigmoid router), each its first decoder layers (`num_layers`: 2; deepseek_v3 4,
its 3 dense layers and 1 MoE layer) with a 512-token vocabulary; gpt-oss and deepseek keep 32 of their routed
experts (qwen3 all 128) to bound the checkpoint. Every other shape (hidden, heads, head dims, LoRA ranks,
expert widths) is the model's own.
Weights: transformers' model of that reduced config with random values (std 0.02, as bench/build.py: the
tiny tests' 0.08 would blow up at these widths), saved by `save_pretrained` and, for gpt-oss and deepseek,
converted to the hub's MXFP4 / FP8 layouts (tests/generated/builds.py, runtime.checkpoint.writer); the
build loads it through `load_checkpoint`. Judged as tests/gpu/test_decode_graphs.py judges bf16 builds:
a replayed step equals the eager one exactly; against the full forward, the median of five decode
positions within 2e-2 (FP8 activations, quantized per token block: 5e-2) and every one under 0.5, since
one token and S tokens round differently and at a near-tie that can flip a routing choice.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from runtime.causal_lm import layer_ids
from tests.generated import builds
from tests.gpu.test_decode_graphs import _check_decoding

pytestmark = pytest.mark.gpu

VOCAB = 512
# model -> (its sm_90 tp1 build, decoder layers kept, routed experts kept (None: all), transformers' key, tolerance)
CASES = {
    "qwen3_30b_a3b": ("qwen3_30b_a3b_bf16__sm_90__tp1", 2, None, "num_experts", 2e-2),
    "gpt_oss_120b": ("gpt_oss_120b_mxfp4__sm_90__tp1", 2, 32, "num_local_experts", 2e-2),
    "deepseek_v3": ("deepseek_v3_fp8__sm_90__tp1", 4, 32, "n_routed_experts", 5e-2),
}


def _shrink(mod, monkeypatch, experts):
    """The build module with a VOCAB-id vocabulary and `experts` routed experts (its constants are read when the
    model is constructed; ARCHITECTURE captured the vocabulary when the module loaded): the test's own shapes."""
    monkeypatch.setattr(mod, "ARCHITECTURE", dataclasses.replace(mod.ARCHITECTURE, vocab_size=VOCAB))
    if experts is not None:
        monkeypatch.setattr(mod, "NUM_EXPERTS", experts)
        monkeypatch.setattr(mod, "EXPERTS_SPEC", dataclasses.replace(mod.EXPERTS_SPEC, num_experts=experts))


def _checkpoint(model, layers, experts, key, tmp_path, device="cuda"):
    """transformers' reduced model, random, saved; in the hub's quantized layout where the build reads one."""
    from transformers import AutoModelForCausalLM

    config = {k: v for k, v in builds.facts(model).CONFIG.items() if k != "architectures"}
    overrides = {"num_hidden_layers": layers, "vocab_size": VOCAB}
    if experts is not None:
        overrides[key] = experts
    if "layer_types" in config:
        overrides["layer_types"] = config["layer_types"][:layers]
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(builds.hf_config(model, **overrides), dtype=torch.bfloat16)
    builds.randomize(hf, seed=5, std=0.02, device=device)
    source = tmp_path / "bf16"
    hf.save_pretrained(source)
    del hf
    if model == "gpt_oss_120b":
        return builds.mxfp4_checkpoint(source, tmp_path / "mxfp4", device=device)
    if model == "deepseek_v3":
        return builds.fp8_block_checkpoint(source, tmp_path / "fp8", device=device)
    return source


@pytest.mark.parametrize("model", sorted(CASES))
def test_a_reduced_real_shape_build_replays_its_step_and_decodes_its_full_forward(model, monkeypatch, tmp_path):
    target, layers, experts, key, tolerance = CASES[model]
    mod = importlib.import_module(f"generated.{model}.{target}.modeling")
    _shrink(mod, monkeypatch, experts)
    folder = _checkpoint(model, layers, experts, key, tmp_path)
    built = mod.MODEL_CLASS(device="cuda", num_layers=layers)
    built.load_checkpoint(folder)
    assert len(built.model.layers) == layers and built.lm_head.weight.shape[0] == VOCAB
    moe = [mod.IMPLEMENTATIONS[i][0] for i in layer_ids(mod.LAYERS)[:layers] if i is not None]
    assert moe and [type(m) for m in built.modules() if hasattr(m, "IMPL_ID")] == moe
    _check_decoding(built.eval(), tolerance, every_position=False)
