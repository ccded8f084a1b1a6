"""Several chained MTP layers (num_nextn_predict_layers = 2): a generated draft runs MTP layer k at draft step k, each from its own checkpoint tensors.

A user declaration (tiny_deepseek_v3's, with two MTP layers) goes through `generate --models DIR --out OUT`;
the oracle is transformers' `MtpModel` with its two `MtpLayer`s (float64), loaded from the same checkpoint
folder, each layer's own embedding and head copies applied explicitly (as in test_mtp_draft). Tolerance as
there: the draft's TORCH experts round GEMM inputs to bf16, relative L2 error <= 1e-2.
"""
from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.generated import builds

SOURCE = builds.ROOT / "registry" / "models" / "tiny_deepseek_v3.toml"


@pytest.fixture(scope="module")
def case():
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    work = Path(tempfile.mkdtemp(dir=builds.tmp_folder("")))
    text = SOURCE.read_text(encoding="utf-8").replace("tiny_deepseek_v3", "chained").replace(
        "num_nextn_predict_layers = 1", "num_nextn_predict_layers = 2")
    (work / "models").mkdir()
    (work / "models" / "chained.toml").write_text(text, encoding="utf-8")
    out = work / "out" / "chainedbuilds"
    builds.codegen_cli("generate", "--models", str(work / "models"), "--model", "chained",
                           "--sm", "90", "--parallel", "tp1", "--out", str(out))
    folder = builds.with_mtp_layers(builds.transformers_checkpoint("tiny_deepseek_v3"), work / "ckpt", 2, seed=7)
    sys.path.insert(0, str(out.parent))
    try:
        base = "chainedbuilds.chained.chained_bf16__sm_90__tp1"
        target = importlib.import_module(base + ".modeling").MODEL_CLASS(dtype=torch.float32)
        draft_module = importlib.import_module(base + ".draft")
        with pytest.MonkeyPatch.context() as patch:
            if not set(draft_module.IMPLEMENTATIONS) <= set(draft_module.CPU_IMPLS):
                patch.setattr(draft_module, "IMPLEMENTATIONS", {i: builds.cpu_twin(i) for i in draft_module.IMPLEMENTATIONS})
                patch.setattr(draft_module, "CPU_IMPLS", tuple(draft_module.IMPLEMENTATIONS))
            draft = draft_module.DRAFT_CLASS(dtype=torch.float32)
        target.load_checkpoint(folder)
        report = draft.load_checkpoint(folder)
        main = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                    experts_implementation="eager").eval()
        main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.[34]\..*"]
        mtp = MtpModel.from_pretrained(main).eval()
        yield draft_module, target, draft, report, builds.read_tensors(folder), mtp
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == "chainedbuilds" or m.startswith("chainedbuilds.")]:
            del sys.modules[name]


def test_the_draft_binds_and_reads_both_mtp_layers(case):
    module, _, draft, report, tensors, _ = case
    assert [index for index, _ in module.DRAFT_LAYERS] == [3, 4]
    assert report.tensors == len([n for n in tensors if n.startswith(("model.layers.3.", "model.layers.4."))])


def test_draft_step_k_runs_mtp_layer_k(case):
    _, target, draft, _, tensors, mtp = case
    ids, next_ids = builds.token_ids(512, 2, 10), builds.token_ids(512, 2, 10)
    positions = torch.arange(10)[None]
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        outputs = []
        for k in (0, 1):
            logits, _ = draft(next_ids, hidden, step=k)
            prefix = f"model.layers.{3 + k}."
            embeds = tensors[prefix + "embed_tokens.weight"].double()[next_ids]
            normed = mtp.forward_layer(k, hidden.double(), positions, None, inputs_embeds=embeds)
            expected = normed @ tensors[prefix + "shared_head.head.weight"].double().T
            assert builds.rel_err(logits, expected) <= 1e-2, k
            outputs.append(logits)
    # The two layers hold different weights: a draft that ran one layer for both steps would fail above.
    assert builds.rel_err(outputs[0], outputs[1]) > 0.5
