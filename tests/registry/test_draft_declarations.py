"""Draft declarations that cannot build are refused where they are declared, one clear message each (file:line, field): an Eagle3 head's config against its target, and an external drafter's vocabulary and family."""
from __future__ import annotations

from pathlib import Path

import pytest

from codegen.cli import main
from registry.declarations import load_declaration
from registry.errors import DeclarationError

MODELS = Path(__file__).resolve().parents[2] / "registry" / "models"


def _error(tmp_path, source: str, old: str, new: str) -> tuple[str, int]:
    text = (MODELS / f"{source}.toml").read_text(encoding="utf-8")
    assert old in text
    bad = text.replace(old, new, 1)
    path = tmp_path / f"{source}.toml"
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    return str(info.value).replace(str(path), "FILE"), bad


def _line(text: str, fragment: str) -> int:
    return text[: text.index(fragment)].count("\n") + 1


def test_an_eagle3_head_of_another_width_is_refused(tmp_path):
    message, text = _error(tmp_path, "tiny_qwen3_moe", "target_hidden_size = 64", "target_hidden_size = 32")
    assert message == (f"FILE:{_line(text, 'target_hidden_size = 32')}: drafts[0].config.target_hidden_size: the Eagle3 draft "
                       "tiny_qwen3_moe_eagle3 has target_hidden_size 32 and the target hidden_size 64; set it to the target's")


def test_an_eagle3_config_without_a_key_or_with_bad_aux_layers_is_refused(tmp_path):
    message, text = _error(tmp_path, "tiny_qwen3_moe", "draft_vocab_size = 128, ", "")
    assert message == (f"FILE:{_line(text, 'config = { vocab_size = 512, hidden_size')}: drafts[0].config: the Eagle3 config "
                       "needs draft_vocab_size as a positive integer, got None; set it")
    message, text = _error(tmp_path, "tiny_qwen3_moe", "= [1, 1, 2]", "= [1, 1, 9]")
    assert message.endswith(": drafts[0].config: eagle_aux_hidden_state_layer_ids must be three layer indices in [1, 2] "
                            "(vLLM's convention: the state entering that layer), got [1, 1, 9]; fix them")


@pytest.mark.parametrize("new, error", [
    ('rms_norm_eps = "1e-6", rope_theta = 1e4', "rms_norm_eps: Input should be a valid number, not a string '1e-6'"),
    ("rms_norm_eps = nan, rope_theta = 1e4", "rms_norm_eps: Input should be a finite number"),
    ("rms_norm_eps = 1e-6, rope_theta = -5.0", "rope_theta: Input should be greater than 0"),
    ('rope_theta = 1e4, rope_scaling = { rope_type = "longrope" }',
     "rope_scaling.rope_type: Input should be 'default', 'yarn' or 'llama3', not a string 'longrope'"),
    ('rope_theta = 1e4, rope_scaling = { rope_type = "llama3", factor = 8.0 }',
     "rope_scaling: rope type 'llama3' needs original_max_position_embeddings, low_freq_factor, high_freq_factor; add it"),
    # What the head does not build is refused, not dropped: it would run silu, without biases, one layer.
    ('rope_theta = 1e4, hidden_act = "gelu"', "hidden_act: Input should be 'silu', not a string 'gelu'"),
    ("rope_theta = 1e4, attention_bias = true", "attention_bias: Input should be False, not a boolean True"),
    ("rope_theta = 1e4, mlp_bias = true", "mlp_bias: Input should be False, not a boolean True"),
    ("rope_theta = 1e4, num_hidden_layers = 2", "num_hidden_layers: Input should be 1, not an integer 2"),
])
def test_an_eagle3_config_value_the_head_does_not_build_is_refused_at_its_key(tmp_path, new, error):
    # RULES GN4: a draft's config is untrusted input, typed where it loads like a family's [config].
    message, text = _error(tmp_path, "tiny_qwen3_moe", "rms_norm_eps = 1e-6, rope_theta = 10000.0", new)
    assert message == f"FILE:{_line(text, new)}: drafts[0].config.{error}"


def test_an_eagle3_config_keeps_the_values_the_head_builds(tmp_path):
    text = (MODELS / "tiny_qwen3_moe.toml").read_text(encoding="utf-8").replace(
        "rope_theta = 10000.0", 'rope_theta = 5e5, hidden_act = "silu", attention_bias = false, num_hidden_layers = 1, '
        'rope_scaling = { rope_type = "llama3", factor = 8.0, original_max_position_embeddings = 8192, '
        "low_freq_factor = 1.0, high_freq_factor = 4.0 }, initializer_range = 0.02", 1)
    path = tmp_path / "tiny_qwen3_moe.toml"
    path.write_text(text, encoding="utf-8")
    config = load_declaration(path).drafts[0].config
    assert (config["rope_theta"], config["rope_scaling"]["factor"], config["hidden_act"]) == (5e5, 8.0, "silu")
    assert "initializer_range" not in config and config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 2]


def test_an_eagle3_head_with_another_vocabulary_or_without_a_config_is_refused(tmp_path):
    message, _ = _error(tmp_path, "tiny_qwen3_moe", "config = { vocab_size = 512, draft", "config = { vocab_size = 500, draft")
    assert message.endswith(": drafts[0].config.vocab_size: the Eagle3 draft tiny_qwen3_moe_eagle3 has vocab_size 500 and the "
                            "target 512: vocab_size is the target's (draft_vocab_size is the draft's own)")
    text = (MODELS / "tiny_qwen3_moe.toml").read_text(encoding="utf-8")
    start = text.index("config = { vocab_size = 512, draft")
    path = tmp_path / "tiny_qwen3_moe.toml"
    path.write_text(text[:start] + text[text.index("\n", start) + 1:], encoding="utf-8")
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    assert str(info.value).endswith(
        ": drafts[0]: an Eagle3 draft has its own checkpoint and config: add [drafts.checkpoint] and a config with vocab_size, "
        "draft_vocab_size, hidden_size, target_hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim")


def test_an_external_drafter_of_an_explain_only_family_is_refused_by_generate(tmp_path, capsys, monkeypatch):
    # Every shipped family builds now; a spec-only folder (runtime=False) is what a new family starts as.
    import dataclasses

    from families import FAMILIES
    monkeypatch.setitem(FAMILIES, "nemotron_h", dataclasses.replace(FAMILIES["nemotron_h"], runtime=False))
    text = (MODELS / "tiny_kimi_k3.toml").read_text(encoding="utf-8").replace("tiny_kimi_k3", "mykimi")
    old = 'family = "qwen3_moe"\nconfig = { architectures = ["Qwen3MoeForCausalLM"], vocab_size = 512,'
    assert old in text
    # Its required keys join the drafter's (unknown ones are dropped).
    text = text.replace(old, 'family = "nemotron_h"\nconfig = { architectures = ["NemotronHForCausalLM"], vocab_size = 512, '
                        'n_routed_experts = 8, hybrid_override_pattern = "ME",')
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mykimi.toml").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    code = main(["generate", "--models", str(tmp_path / "models"), "--model", "mykimi", "--sm", "90", "--parallel", "tp1",
                 "--out", str(out)])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err == (
        "error: mykimi_mxfp4__sm_90__tp1: the external drafter mykimi_drafter is of family nemotron_h, which the runtime "
        "does not build; declare a drafter of a runtime family or a selection without this spec_mode\n")


def test_an_embedded_minimax_mtp_draft_is_refused_with_the_reason(tmp_path, capsys):
    # MiniMax-M2's published checkpoints ship no MTP tensors (MiniMax-M2 issue #47, MiniMax-M2.7 issue #16).
    out = tmp_path / "out"
    code = main(["generate", "--model", "minimax_m3", "--sm", "103", "--parallel", "tp4", "--spec-mode", "mtp", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err == (
        "error: minimax_m3_nvfp4__sm_103__tp4: MiniMax-M2 checkpoints as published carry no MTP weights (their config's "
        "num_mtp_modules notwithstanding), so minimax_m3_mtp has nothing to load; declare an eagle3 or external draft for "
        "this model\n")
