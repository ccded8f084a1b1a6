"""Expert formats per layer from checkpoint quant metadata (RULES FN1) and MXFP4 run formats (FN2).

The metadata layouts are the real ones (ModelOpt `hf_quant_config.json`, DeepSeek / gpt-oss / ModelOpt
`config.json` `quantization_config`, as ../shared/research/formats_configs.md §1.3-§1.5 quotes them),
written into temporary checkpoint folders and read back through `registry.quant_meta`.
"""

from __future__ import annotations

import json

import pytest

from registry.errors import DeclarationError, ResolutionError
from families import FAMILIES
from registry.formats import CheckpointQuant, LayerFormat, expert_format, mxfp4_run_format, run_format
from registry.model_resolve import resolve_model
from registry.quant_meta import quant_from_hf_quant_config, quant_from_quantization_config, read_checkpoint_quant
from registry.resolve import moe_impl_request
from registry.selection import Selection
from tests.registry.helpers import cupy_registry, project_models, real_registry

DSV3 = FAMILIES["deepseek_v3"]
GPT_OSS = FAMILIES["gpt_oss"]
R = real_registry()


def fmt_of(quant: CheckpointQuant, layer: int, family=DSV3, default: str | None = None) -> LayerFormat:
    return expert_format(quant, family.experts_module(layer), family.expert_members, default)


def write_json(folder, name, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data), encoding="utf-8")


# --- FN1: precedence ---------------------------------------------------------------------------------


def test_the_global_algorithm_gives_every_layer_its_format():
    # RULES FN1
    assert fmt_of(CheckpointQuant("NVFP4"), 3) == LayerFormat("nvfp4", "checkpoint quant_algo NVFP4", excluded=False)
    assert fmt_of(CheckpointQuant("FP8_BLOCK_SCALES"), 3).format == "fp8_block_scales"
    assert fmt_of(CheckpointQuant("W4A16_NVFP4"), 3).format == "w4a16_nvfp4"
    assert fmt_of(CheckpointQuant("MXFP4"), 3).format == "mxfp4"


def test_an_exclusion_wildcard_leaves_the_experts_bf16():
    # RULES FN1
    quant = CheckpointQuant("NVFP4", ("lm_head", "model.layers.*.mlp.gate", "model.layers.61*"))
    assert fmt_of(quant, 61) == LayerFormat("bf16", "excluded from quantization by 'model.layers.61*'", excluded=True)
    assert fmt_of(quant, 60).format == "nvfp4"  # 'model.layers.*.mlp.gate' names the router, not the experts


def test_an_exclusion_may_name_the_per_expert_modules_instead_of_the_prefix():
    # RULES FN1
    quant = CheckpointQuant("NVFP4", ("model.layers.5.mlp.experts.0.gate_proj",))
    assert fmt_of(quant, 5).format == "bf16"


def test_exclusions_are_applied_before_per_layer_entries():
    # RULES FN1: a module both excluded and named by an entry is built unquantized.
    quant = CheckpointQuant(
        "MIXED_PRECISION",
        exclude_modules=("mtp*",),
        quantized_layers=(("mtp.layers.*.mlp.experts.*", "NVFP4"),),
    )
    mtp = expert_format(quant, "mtp.layers.0.mlp.experts", DSV3.expert_members)
    assert mtp == LayerFormat("bf16", "excluded from quantization by 'mtp*'", excluded=True)


def test_a_per_layer_entry_overrides_the_global_algorithm():
    # RULES FN1
    quant = CheckpointQuant("NVFP4", quantized_layers=(("model.layers.7.mlp.experts.*", "FP8_BLOCK_SCALES"),))
    assert fmt_of(quant, 7) == LayerFormat(
        "fp8_block_scales", "per-layer entry 'model.layers.7.mlp.experts.*': FP8_BLOCK_SCALES", excluded=False
    )
    assert fmt_of(quant, 8).format == "nvfp4"


def test_under_mixed_precision_a_layer_not_listed_is_unquantized():
    # RULES FN1
    quant = CheckpointQuant("MIXED_PRECISION", quantized_layers=(("model.layers.3.mlp.experts.0.gate_proj", "NVFP4"),))
    assert fmt_of(quant, 3).format == "nvfp4"
    assert fmt_of(quant, 4) == LayerFormat("bf16", "not listed under MIXED_PRECISION: unquantized", excluded=True)


def test_an_unquantized_checkpoint_is_bf16_and_has_nothing_excluded():
    # RULES FN1
    assert fmt_of(CheckpointQuant(), 3) == LayerFormat("bf16", "unquantized checkpoint", excluded=False)
    assert fmt_of(CheckpointQuant(None, ("model.layers.3*",)), 3).excluded is False


def test_the_model_default_routed_format_applies_to_routed_experts_without_an_entry():
    # RULES FN1
    assert fmt_of(CheckpointQuant(), 5, default="MXFP4") == LayerFormat("mxfp4", "model default routed format MXFP4", excluded=False)
    entry = CheckpointQuant(quantized_layers=(("model.layers.5.mlp.experts.*", "NVFP4"),))
    assert fmt_of(entry, 5, default="MXFP4").format == "nvfp4"
    assert fmt_of(entry, 6, default="MXFP4").format == "mxfp4"
    assert fmt_of(CheckpointQuant(None, ("model.layers.6*",)), 6, default="MXFP4").format == "bf16"


def test_kimi_k3_routed_experts_take_the_default_routed_format():
    # RULES FN1 (scenario kimi_k3): 93 layers, 1 dense, 92 MoE, MXFP4 by the model's default.
    facts = project_models()["kimi_k3"].facts()
    assert [s.layer for s in facts.sites] == list(range(1, 93))
    assert {s.format for s in facts.sites} == {LayerFormat("mxfp4", "model default routed format MXFP4", excluded=False)}
    assert facts.shape.hidden_size == 7168 and facts.shape.num_experts == 896


def test_an_unknown_algorithm_keeps_its_name_and_no_implementation_serves_it():
    # RULES FN1: it fails at resolution with what exists, not silently as something else.
    assert fmt_of(CheckpointQuant("W4A8_AWQ"), 3).format == "w4a8_awq"


# --- FN1 on the real metadata layouts ----------------------------------------------------------------


def test_hf_quant_config_with_one_algorithm_and_exclude_wildcards(tmp_path):
    # RULES FN1: ModelOpt hf_quant_config.json, single-format form.
    write_json(tmp_path, "hf_quant_config.json", {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate", "model.layers.61*"],
        },
    })
    write_json(tmp_path, "config.json", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    quant, source = read_checkpoint_quant(tmp_path)
    assert source == "hf_quant_config.json"  # it wins over config.json
    assert quant.quant_algo == "NVFP4"
    assert fmt_of(quant, 3).format == "nvfp4"
    assert fmt_of(quant, 61).format == "bf16" and fmt_of(quant, 61).excluded


def test_hf_quant_config_mixed_precision_with_quantized_layers(tmp_path):
    # RULES FN1: ModelOpt MIXED_PRECISION: per-layer entries, any layer not listed is unquantized.
    write_json(tmp_path, "hf_quant_config.json", {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8",
            "quantized_layers": {
                "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
                "model.layers.3.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
                "model.layers.3.mlp.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 16},
                "model.layers.4.mlp.experts.0.down_proj": {"quant_algo": "w4a16_nvfp4", "group_size": 16},
            },
        },
    })
    quant, _ = read_checkpoint_quant(tmp_path)
    assert quant.quant_algo == "MIXED_PRECISION"
    assert fmt_of(quant, 3).format == "nvfp4"
    assert fmt_of(quant, 4).format == "w4a16_nvfp4"  # algorithms are upper-cased on read
    assert fmt_of(quant, 5) == LayerFormat("bf16", "not listed under MIXED_PRECISION: unquantized", excluded=True)


def test_config_json_deepseek_fp8_block_scales(tmp_path):
    # RULES FN1: DeepSeek's quantization_config.
    write_json(tmp_path, "config.json", {
        "architectures": ["DeepseekV3ForCausalLM"],
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    })
    quant, source = read_checkpoint_quant(tmp_path)
    assert (quant, source) == (CheckpointQuant("FP8_BLOCK_SCALES"), "config.json")
    assert fmt_of(quant, 3).format == "fp8_block_scales"


def test_config_json_per_tensor_fp8_is_refused_naming_the_known_formats(tmp_path):
    # RULES FN1
    write_json(tmp_path, "config.json", {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    with pytest.raises(DeclarationError) as info:
        read_checkpoint_quant(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'config.json'}: quantization_config uses per-tensor FP8 (no weight_block_size); the expert "
        "formats moegen knows are FP8 128x128 blocks, MXFP4 and NVFP4"
    )


def test_config_json_gpt_oss_mxfp4_with_modules_to_not_convert(tmp_path):
    # RULES FN1: gpt-oss's converter output.
    write_json(tmp_path, "config.json", {
        "architectures": ["GptOssForCausalLM"],
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        },
    })
    quant, _ = read_checkpoint_quant(tmp_path)
    assert quant.quant_algo == "MXFP4"
    assert "model.layers.*.mlp.router" in quant.exclude_modules
    assert fmt_of(quant, 0, family=GPT_OSS) == LayerFormat("mxfp4", "checkpoint quant_algo MXFP4", excluded=False)


def test_config_json_modelopt_converted_form(tmp_path):
    # RULES FN1: ModelOpt's converted quantization_config ('ignore' instead of exclude_modules).
    write_json(tmp_path, "config.json", {
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "config_groups": {"group_0": {
                "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"],
            }},
            "ignore": ["lm_head", "model.layers.*.block_sparse_moe.gate", "model.layers.0.block_sparse_moe.experts*"],
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "producer": {"name": "modelopt", "version": "0.39.0"},
        }
    })
    quant, _ = read_checkpoint_quant(tmp_path)
    minimax = FAMILIES["minimax_m2"]
    assert fmt_of(quant, 1, family=minimax).format == "nvfp4"
    assert fmt_of(quant, 0, family=minimax).format == "bf16"


def test_config_json_modelopt_converted_mixed_precision_keeps_its_quantized_layers():
    # RULES FN1
    quant = quant_from_quantization_config({
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {"model.layers.3.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"}},
        "ignore": [],
    })
    assert quant == CheckpointQuant("MIXED_PRECISION", (), (("model.layers.3.mlp.experts.0.gate_proj", "NVFP4"),))


def test_a_modelopt_config_without_quant_algo_is_refused_naming_the_field():
    # RULES FN1
    with pytest.raises(DeclarationError) as info:
        quant_from_quantization_config({"quant_method": "modelopt", "ignore": []})
    assert str(info.value) == (
        "config.json: quantization_config (quant_method modelopt) has no quant_algo; re-export the checkpoint "
        "with a ModelOpt that writes it, or provide hf_quant_config.json"
    )


def test_an_unknown_quant_method_is_refused_with_the_known_ones():
    # RULES FN1
    with pytest.raises(DeclarationError) as info:
        quant_from_quantization_config({"quant_method": "gptq"})
    assert str(info.value) == (
        "config.json: quantization_config quant_method 'gptq' is not one moegen reads; known: "
        "fp8 (with weight_block_size), mxfp4, modelopt"
    )


def test_a_checkpoint_without_quant_metadata_is_unquantized(tmp_path):
    # RULES FN1
    write_json(tmp_path, "config.json", {"architectures": ["MixtralForCausalLM"]})
    assert read_checkpoint_quant(tmp_path) == (CheckpointQuant(), "none")
    assert quant_from_hf_quant_config({"quantization": {"quant_algo": None}}) == CheckpointQuant()


def test_a_nested_text_config_quantization_config_is_read(tmp_path):
    # RULES FN1
    write_json(tmp_path, "config.json", {"text_config": {"quantization_config": {"quant_method": "mxfp4"}}})
    assert read_checkpoint_quant(tmp_path)[0].quant_algo == "MXFP4"


def test_a_folder_without_config_json_or_with_bad_json_is_a_clear_error(tmp_path):
    # RULES FN1
    with pytest.raises(DeclarationError) as info:
        read_checkpoint_quant(tmp_path)
    assert str(info.value) == f"{tmp_path / 'config.json'}: missing; a checkpoint folder has a config.json"
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(DeclarationError) as info:
        read_checkpoint_quant(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: not valid JSON: ")


# --- FN2: the MXFP4 run format -----------------------------------------------------------------------


def run_fmt(backend_or_tactic: str, sm: int, registry=R, field="moe_config.backend") -> str:
    request = moe_impl_request(backend_or_tactic, registry=registry, field=field)
    return mxfp4_run_format(request.candidates, sm, registry, request.asked)


@pytest.mark.parametrize(
    "sm, expected",
    [(80, "w4a16_mxfp4"), (90, "w4a16_mxfp4"), (100, "w4a8_mxfp4_mxfp8"), (103, "w4a8_mxfp4_mxfp8"), (120, "w4a8_mxfp4_mxfp8")],
)
def test_vanilla_alone_runs_the_sms_most_preferred_mxfp4_run_format(sm, expected):
    # RULES FN2: the per-SM preference table orders the run formats.
    assert run_fmt("VANILLA", sm) == expected
    assert R.mxfp4_preference(sm)[0] == expected


@pytest.mark.parametrize("sm", [90, 100, 103, 107, 120])
def test_auto_runs_what_torch_publishes_because_vanilla_never_picks_the_run_format(sm):
    # RULES FN2: VANILLA (an emulation) counts only when the request holds nothing else: it publishes
    # w4a8 formats on every SM, yet AUTO runs w4a16_mxfp4 (sm_90's first preference, and the only MXFP4
    # format TORCH publishes elsewhere).
    assert run_fmt("AUTO", sm) == "w4a16_mxfp4"
    assert run_fmt("TORCH", sm) == "w4a16_mxfp4"


def test_a_tactic_still_reaches_the_sms_second_preference():
    # RULES FN2: on sm_90 the CUPY W4A8 kernel is second to W4A16; a tactic naming it runs it.
    assert run_fmt("w4a8_mxfp4_fp8", 90, field="moe_config.tactic") == "w4a8_mxfp4_fp8"


def test_vanilla_counts_when_nothing_else_in_the_request_runs_on_the_sm():
    # RULES FN2: on sm_80 no TORCH implementation runs, so AUTO holds nothing else there.
    assert run_fmt("AUTO", 80) == "w4a16_mxfp4"
    assert run_fmt("w4a16_mxfp4", 80, field="moe_config.tactic") == "w4a16_mxfp4"


def test_a_backend_that_publishes_the_sms_first_choice_gets_it():
    # RULES FN2
    C = cupy_registry()
    assert run_fmt("AUTO", 100, C) == "w4a8_mxfp4_mxfp8"
    assert run_fmt("CUPY", 100, C) == "w4a8_mxfp4_mxfp8"
    assert run_fmt("AUTO", 90, C) == "w4a16_mxfp4"  # the CUPY kernel does not run on sm_90


def test_a_tactic_of_vanilla_alone_counts_vanilla():
    # RULES FN2
    assert run_fmt("eager", 100, field="moe_config.tactic") == "w4a8_mxfp4_mxfp8"
    assert run_fmt("w4a8_mxfp4_fp8", 100, field="moe_config.tactic") == "w4a8_mxfp4_fp8"


def run_note(backend_or_tactic: str, sm: int, field="moe_config.backend") -> tuple[str, str]:
    request = moe_impl_request(backend_or_tactic, registry=R, field=field)
    return run_format("mxfp4", request.candidates, sm, R, request.asked)


def test_the_run_format_note_says_why_the_sms_earlier_preferences_did_not_win():
    # RULES FN2, as `explain` shows it: what came first and why it was passed over.
    assert run_note("AUTO", 90) == ("w4a16_mxfp4", "MXFP4 checkpoint, sm_90 preference")
    assert run_note("AUTO", 100) == ("w4a16_mxfp4", (
        "MXFP4 checkpoint, sm_100 preference: w4a8_mxfp4_mxfp8, w4a8_mxfp4_fp8 come first, but on sm_100 only "
        "VANILLA runs them, and a reference counts only alone (RULES FN2)"))
    assert run_note("TORCH", 100) == ("w4a16_mxfp4", (
        "MXFP4 checkpoint, sm_100 preference: w4a8_mxfp4_mxfp8, w4a8_mxfp4_fp8 come first, but no implementation "
        "of the request runs them on sm_100 (RULES FN2)"))
    assert run_note("w4a8_mxfp4_fp8", 100, field="moe_config.tactic") == ("w4a8_mxfp4_fp8", (
        "MXFP4 checkpoint, sm_100 preference: w4a8_mxfp4_mxfp8 comes first, but no implementation of the request "
        "runs it on sm_100 (RULES FN2)"))


def test_a_tactic_naming_no_mxfp4_run_format_of_the_sm_is_refused_naming_the_formats():
    # RULES FN2
    with pytest.raises(ResolutionError) as info:
        run_fmt("w4a8_mxfp4_mxfp8", 90, field="moe_config.tactic")
    assert str(info.value) == (
        "moe_config.tactic 'w4a8_mxfp4_mxfp8' names no MXFP4 run format that runs on sm_90: the MXFP4 experts "
        "need one of w4a16_mxfp4, w4a8_mxfp4_fp8 (RULES FN2)"
    )
    with pytest.raises(ResolutionError) as info:
        run_fmt("grouped_mm.bf16", 100, field="speculative_config.moe_tactic")
    assert str(info.value) == (
        "speculative_config.moe_tactic 'grouped_mm.bf16' names no MXFP4 run format that runs on sm_100: the MXFP4 "
        "experts need one of w4a8_mxfp4_mxfp8, w4a8_mxfp4_fp8, w4a16_mxfp4 (RULES FN2)"
    )


def test_an_sm_without_a_preference_row_is_refused_naming_the_table():
    # RULES FN2
    with pytest.raises(ResolutionError) as info:
        run_fmt("AUTO", 75)
    assert str(info.value) == (
        "no MXFP4 run formats are declared for sm_75; add sm 75 to [mxfp4_run_formats] in registry/impls.toml (RULES FN2)"
    )


def test_gpt_oss_layers_report_the_run_format_and_why():
    # RULES FN2, LR5: the report keeps the checkpoint format and the run format apart.
    facts = project_models()["gpt_oss_120b"].facts()
    report = resolve_model(facts, Selection(backend="VANILLA"), sm=90).reports[0]
    assert (report.checkpoint_format, report.run_format, report.run_format_source) == (
        "mxfp4",
        "w4a16_mxfp4",
        "MXFP4 checkpoint, sm_90 preference",
    )
    assert report.winner == "torch.eager.loop.w4a16_mxfp4"
    bf16 = resolve_model(project_models()["mixtral_8x7b"].facts(), Selection(), sm=90).reports[0]
    assert (bf16.run_format, bf16.run_format_source) == ("bf16", "checkpoint format")
