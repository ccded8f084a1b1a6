"""A replacement-head MTP draft (RULES DR1, DR2): an MTP layer from its own checkpoint folder with its own quant metadata, here FP8 128x128 blocks beside a BF16 target, resolved for its own format and loaded from its own folder only.

A user declaration (tiny_deepseek_v3's shape, no embedded MTP, a `replacement_mtp` draft whose checkpoint
declares FP8_BLOCK_SCALES) goes through `generate --models DIR --out OUT`. The head's folder holds only the
MTP layer (`model.layers.3.*`, the names the embedded layout uses) in DeepSeek's hub FP8 layout. Oracle:
transformers' `MtpModel` (float64) on the block-dequantized weights. The draft's FP8 experts quantize their
activations (128-wide groups): relative L2 error <= 6e-2 (observed 2.3e-2), the FP8 target's bound in test_quantized_parity.
"""
from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.generated import builds

SOURCE = builds.ROOT / "registry" / "models" / "tiny_deepseek_v3.toml"
DRAFT = '''[[drafts]]
name = "replaced_head"
kind = "replacement_mtp"
modes = ["mtp"]
num_layers = 1
doc = "An MTP head shipped in its own folder, FP8 blocks."
checkpoint = { name = "replaced_head_fp8", quant_algo = "FP8_BLOCK_SCALES", exclude_modules = ["model.layers.*.mlp.gate"] }

[[targets]]
checkpoint = "replaced_bf16"
sm = 90
parallel = "tp1"
moe_impls_honored = ["torch.grouped_mm.grouped_gemm.bf16"]
draft_moe_impls_honored = ["torch.grouped_mm.grouped_gemm.fp8_block_scales", "torch.eager.loop.fp8_block_scales"]
selection = { spec_mode = "mtp" }
'''


def _declaration() -> str:
    text = SOURCE.read_text(encoding="utf-8").replace("tiny_deepseek_v3", "replaced")
    text = text.replace("num_nextn_predict_layers = 1", "num_nextn_predict_layers = 0")
    return text[: text.index("[[checkpoints]]")] + '[[checkpoints]]\nname = "replaced_bf16"\ndoc = "BF16."\n\n' + DRAFT


@pytest.fixture(scope="module")
def case():
    from runtime.formats import fp8
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    work = Path(tempfile.mkdtemp(dir=builds.tmp_folder("")))
    (work / "models").mkdir()
    (work / "models" / "replaced.toml").write_text(_declaration(), encoding="utf-8")
    out = work / "out" / "replacedbuilds"
    builds.codegen_cli("generate", "--models", str(work / "models"), "--model", "replaced",
                           "--sm", "90", "--parallel", "tp1", "--out", str(out))
    full = builds.with_mtp_layers(builds.transformers_checkpoint("tiny_deepseek_v3"), work / "full", 1, seed=5)
    tensors = builds.read_tensors(full)
    head, dequantized = {}, {}
    for name, value in tensors.items():
        if not name.startswith("model.layers.3."):
            continue
        if name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")) and ".mlp.gate." not in name:
            q, scale_inv = fp8.quantize_weight_blocks(value)
            head[name], head[name[: -len("weight")] + "weight_scale_inv"] = q, scale_inv
            dequantized[name] = builds.fp8_block_dequantize(q, scale_inv).to(torch.float32)
        else:
            head[name] = value
            dequantized[name] = value.float()
    config = json.loads((full / "config.json").read_text())
    head_folder = builds.write_checkpoint(work / "head", head, config | {"quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})
    # The oracle's folder: the target's tensors plus the dequantized head, one bf16-free float checkpoint.
    oracle = builds.write_checkpoint(work / "oracle", {k: v.float() for k, v in tensors.items() if not k.startswith("model.layers.3.")}
                                     | dequantized, config)
    sys.path.insert(0, str(out.parent))
    try:
        base = "replacedbuilds.replaced.replaced_bf16__sm_90__tp1"
        target = importlib.import_module(base + ".modeling").MODEL_CLASS(dtype=torch.float32)
        target_report = target.load_checkpoint(builds.transformers_checkpoint("tiny_deepseek_v3"))
        draft_module = importlib.import_module(base + ".draft")
        draft = draft_module.DRAFT_CLASS(dtype=torch.float32)
        report = draft.load_checkpoint(head_folder)
        main = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float64, attn_implementation="eager",
                                                    experts_implementation="eager").eval()
        main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
        yield draft_module, target, target_report, draft, report, head, dequantized, MtpModel.from_pretrained(main).eval()
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == "replacedbuilds" or m.startswith("replacedbuilds.")]:
            del sys.modules[name]


def test_the_head_binds_its_own_format_and_reads_only_its_own_folder(case):
    module, _, target_report, _, report, head, _, _ = case
    assert module.DRAFT_LAYERS == ((3, "torch.grouped_mm.grouped_gemm.fp8_block_scales"),)
    assert module.IGNORED_TENSORS == () and list(report.ignored) == [] and report.dequantized
    assert list(target_report.ignored) == []


def test_the_head_matches_transformers_mtp_layer_on_its_dequantized_weights(case):
    _, target, _, draft, _, _, dequantized, mtp = case
    ids, next_ids = builds.token_ids(512, 2, 10), builds.token_ids(512, 2, 10)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        logits, _ = draft(next_ids, hidden)
        embeds = dequantized["model.layers.3.embed_tokens.weight"].double()[next_ids]
        normed = mtp.forward_layer(0, hidden.double(), torch.arange(10)[None], None, inputs_embeds=embeds)
        expected = normed @ dequantized["model.layers.3.shared_head.head.weight"].double().T
    assert builds.rel_err(logits, expected) <= 6e-2
