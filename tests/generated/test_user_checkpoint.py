"""A user's own checkpoint goes the documented way end to end: `import-checkpoint`, a target added by hand, `generate --models DIR --out OUT`, then `load_model` from OUT computes transformers' logits (issue 4 item 9, issue 3 item 7).

The checkpoint is written by transformers 5 (`rope_parameters`, `num_local_experts`: not the hub
files' spellings), with a dense layer and attention biases, so every translation the import and the
templates make is exercised. Tolerance as in test_transformers_parity (TORCH experts in fp32).
"""
from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from codegen.import_checkpoint import import_checkpoint
from families import RUNTIME_FAMILIES
from registry.declarations import load_declaration
from registry.errors import DeclarationError
from tests.generated import builds

TARGET = """
[[targets]]
checkpoint = "m"
sm = 90
parallel = "tp1"
moe_impls_honored = "*"
"""


@pytest.fixture(scope="module")
def user_checkpoint():
    """A Qwen3-MoE saved by transformers, layer 1 dense (mlp_only_layers), biased attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=True, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    builds.randomize(model, seed=5)
    folder = builds.tmp_folder("My-Qwen3-MoE")
    model.save_pretrained(folder)
    return folder


def test_a_users_checkpoint_is_imported_generated_and_loaded_with_transformers_logits(user_checkpoint):
    work = Path(tempfile.mkdtemp(dir=builds.tmp_folder("")))
    declaration = work / "models" / "m.toml"
    assert builds.codegen_cli("import-checkpoint", str(user_checkpoint), "--out", str(declaration)) == (
        f"wrote {declaration}: layers 0, 2: bf16\n")
    declaration.write_text(declaration.read_text() + TARGET)
    out = work / "out" / "userbuilds"
    builds.codegen_cli("generate", "--models", str(declaration.parent), "--model", "m", "--sm", "90", "--parallel", "tp1", "--out", str(out))

    sys.path.insert(0, str(out.parent))
    try:
        package = importlib.import_module("userbuilds")
        specialized = importlib.import_module("userbuilds.m.m__sm_90__tp1.modeling")
        # "*" lets AUTO bind sm_90's preferred kernel, which may be GPU-only; on this CPU host the TORCH
        # backend is asked for: the specialized build serves it when it binds TORCH, else the generic one.
        on_cpu = set(specialized.IMPLEMENTATIONS) <= set(specialized.CPU_IMPLS)
        ours = package.load_model("m", 90, checkpoint=user_checkpoint, moe_config={"backend": "TORCH"}, dtype=torch.float32)
        expected = "userbuilds.m.m__sm_90__tp1.modeling" if on_cpu else "userbuilds.m.generic.modeling"
        assert type(ours).__module__ == expected
        reference = builds.transformers_model(user_checkpoint, torch.float32)
        ids = builds.token_ids(96, batch=4, length=16)
        with torch.no_grad():
            ours_out, ref = ours(ids).double(), reference(ids).logits.double()
        errors = (ours_out - ref).norm(dim=-1).flatten() / ref.norm(dim=-1).flatten()
        assert errors.median() <= 8e-3, errors.median()
        assert (errors <= 1e-2).float().mean() >= 0.9, errors
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == "userbuilds" or m.startswith("userbuilds.")]:
            del sys.modules[name]


def _config_only(name: str, architecture: str) -> Path:
    folder = builds.tmp_folder(name)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(f'{{"architectures": ["{architecture}"], "hidden_size": 64}}')
    return folder


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "DbrxForCausalLM"])
def test_import_refuses_an_architecture_the_runtime_does_not_build_listing_the_families(architecture):
    folder = _config_only(f"unsupported-{architecture}", architecture)
    with pytest.raises(DeclarationError) as refused:
        import_checkpoint(folder, None, None)
    assert str(refused.value) == (
        f"{folder}: architecture {architecture} is not supported; the runtime builds the families "
        + ", ".join(RUNTIME_FAMILIES)   # one folder each under families/, with a template
    )
    assert RUNTIME_FAMILIES[:4] == ("deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2") and "nemotron_h" in RUNTIME_FAMILIES


def test_the_command_line_refusal_is_a_message_and_exit_code_2():
    folder = _config_only("unsupported-cli", "LlamaForCausalLM")
    done = builds.codegen_run("import-checkpoint", folder)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {folder}: architecture LlamaForCausalLM is not supported; ")
    assert "Traceback" not in done.stderr


def _imported(folder: Path, name: str):
    text, summary = import_checkpoint(folder, name, None)
    path = Path(tempfile.mkdtemp(dir=builds.tmp_folder(""))) / f"{name}.toml"
    path.write_text(text)
    decl = load_declaration(path)
    facts = decl.facts(decl.checkpoints[0].name)
    return summary, [(s.layer, s.format.format) for s in facts.sites], [[(s.layer, s.format.format) for s in d.sites] for d in facts.drafts]


def test_quantized_checkpoints_import_with_each_layer_s_format():
    # Checkpoints in the producers' layouts, written with our codecs (tests/runtime/fixtures_checkpoints).
    from tests.runtime import fixtures_checkpoints as fixtures

    # DeepSeek FP8 blocks (quantization_config, config.json): MoE layer 1, MTP layer 2 after the last layer.
    assert _imported(fixtures.deepseek_fp8(mtp=True).path, "ds_fp8") == (
        "layers 1: fp8_block_scales; draft layers 2: fp8_block_scales", [(1, "fp8_block_scales")], [[(2, "fp8_block_scales")]])
    # gpt-oss MXFP4 (quant_method mxfp4, modules_to_not_convert): both layers' experts.
    assert _imported(fixtures.gpt_oss_mxfp4().path, "oss_mxfp4") == ("layers 0-1: mxfp4", [(0, "mxfp4"), (1, "mxfp4")], [])
    # ModelOpt NVFP4 (hf_quant_config.json wins over config.json): both layers' experts.
    assert _imported(fixtures.qwen3_moe_nvfp4().path, "q3_nvfp4") == ("layers 0-1: nvfp4", [(0, "nvfp4"), (1, "nvfp4")], [])
