"""Model declaration files: validated, every error at file:line and field (ARCHITECTURE "Declarations").

Bad files are written into temporary folders and loaded the way every command loads them
(`load_declaration`, `load_models(models_dir)` for a user's `--models DIR`).
"""

from __future__ import annotations

import math

import pytest

from families import FAMILIES, RUNTIME_FAMILIES
from registry.declarations import MODELS_DIR, find_model, load_declaration, load_models
from registry.errors import DeclarationError
from tests.registry.helpers import GOOD, project_models, write


def load_error(tmp_path, text: str, name: str = "mymodel") -> str:
    path = write(tmp_path / f"{name}.toml", text)
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    return str(info.value).replace(str(path), "FILE")


# --- the project's declarations ----------------------------------------------------------------------


def test_every_project_declaration_loads_and_covers_the_scenarios():
    # RULES TG1, TG2: the scenarios of issue 2 are declared.
    models = project_models()
    assert {
        "kimi_k3", "glm_5_2", "minimax_m3", "deepseek_r1_nvfp4", "qwen3_next", "nemotron_h", "deepseek_v4_flash",
        "qwen3_8_flash", "gpt_oss_120b", "deepseek_v3", "qwen3_30b_a3b", "mixtral_8x7b", "tiny_deepseek_v3",
        "tiny_qwen3_moe", "tiny_mixtral", "tiny_gpt_oss", "tiny_glm4_moe", "tiny_minimax_m2", "tiny_kimi_k3",
    } <= set(models)   # a new model is one more file (ARCHITECTURE "What a change costs")
    assert {p.stem for p in MODELS_DIR.glob("*.toml")} == set(models)
    for name in (f"tiny_{family}" for family in RUNTIME_FAMILIES):
        assert any(t.sm == 90 and t.parallel == "tp1" for t in models[name].targets), name


def test_the_real_shapes_come_from_the_public_configs():
    # RULES TG1: a target's shapes are the checkpoint's (issue 2 item 6)
    # scenario shapes: Kimi K3 93 layers (1 dense + 92 MoE), hidden 7168, 896 experts; DeepSeek-V3 58 MoE layers.
    kimi = project_models()["kimi_k3"]
    assert (kimi.config["num_hidden_layers"], kimi.config["hidden_size"], kimi.config["n_routed_experts"]) == (93, 7168, 896)
    assert len(project_models()["deepseek_v3"].facts().sites) == 58
    assert len(project_models()["gpt_oss_120b"].facts().sites) == 36


def test_a_good_user_declaration_loads(tmp_path):
    # RULES TG1
    decl = load_declaration(write(tmp_path / "mymodel.toml", GOOD))
    assert decl.model.name == "mymodel" and decl.targets[0].name == "mymodel_bf16__sm_90__tp1"


# --- file:line errors ------------------------------------------------------------------------------------


def test_a_wrong_type_is_reported_at_its_line(tmp_path):
    # RULES TG1, TG2: declarations validate with file, line and field
    assert load_error(tmp_path, GOOD.replace("sm = 90", 'sm = "ninety"')) == (
        "FILE:19: targets[0].sm: Input should be a valid integer, unable to parse string as an integer"
    )


def test_an_unknown_key_is_reported_at_its_line_with_a_fix(tmp_path):
    # RULES TG1, TG2: declarations validate with file, line and field
    assert load_error(tmp_path, GOOD.replace('parallel = "tp1"', 'parallel = "tp1"\nhonored = ["x"]')) == (
        "FILE:21: targets[0].honored: Extra inputs are not permitted; remove it or fix its spelling"
    )


def test_a_missing_key_is_reported_at_its_table(tmp_path):
    # RULES TG1, TG2: declarations validate with file, line and field
    assert load_error(tmp_path, GOOD.replace("sm = 90\n", "")) == "FILE:17: targets[0].sm: Field required; add it"


def test_a_bad_parallel_name_is_reported_at_its_line(tmp_path):
    # RULES TG1: the parallel layout is part of the target
    assert load_error(tmp_path, GOOD.replace('"tp1"', '"tp4_moetp3ep1"')) == (
        "FILE:20: targets[0].parallel: parallel layout 'tp4_moetp3ep1': moetp3 x ep1 = 3 ranks, but tp4 has 4; "
        "the MoE split must cover the same ranks as attention"
    )
    assert load_error(tmp_path, GOOD.replace('"tp1"', '"fast"')) == (
        "FILE:20: targets[0].parallel: parallel layout 'fast' is not tp<N>, tp<N>_moetp<X>ep<Y>, dep<N> or a "
        "declared profile (this model's profiles: none declared)"
    )
    assert load_error(tmp_path, GOOD.replace('"tp1"', '"Fast-1"')) == (
        "FILE:20: targets[0].parallel: String should match pattern '^[a-z][a-z0-9_]*$'"
    )


def test_an_unknown_checkpoint_reference_lists_the_declared_ones(tmp_path):
    # RULES TG1: the checkpoint is part of the target
    assert load_error(tmp_path, GOOD.replace('checkpoint = "mymodel_bf16"', 'checkpoint = "mymodel_fp8"')) == (
        "FILE:18: targets[0].checkpoint: checkpoint 'mymodel_fp8' is not declared; declared: mymodel_bf16"
    )


def test_a_config_lacking_a_key_its_family_needs_is_reported_at_the_config_table(tmp_path):
    # RULES TG1, FN1: the layers come from [config]
    assert load_error(tmp_path, GOOD.replace("num_local_experts = 4\n", "")) == (
        "FILE:6: config: [config] lacks num_local_experts, which family mixtral needs; add it"
    )


# --- [config] is typed and range-checked where it loads (RULES GN4) -------------------------------------

# A config value that is code: were it pasted into a docstring, importing the build would run it.
INJECTED = '"4 \\"\\"\\"\\nimport os; os.system(\'touch pwned\')\\n\\"\\"\\""'


def config_error(tmp_path, extra: str, replace: str | None = None) -> str:
    """The error of GOOD with `extra` lines added to [config] (line 13 is the first added line)."""
    text = GOOD.replace(replace, "") if replace else GOOD
    return load_error(tmp_path, text.replace("num_experts_per_tok = 2\n", "num_experts_per_tok = 2\n" + extra, 1))


def test_a_string_where_a_number_belongs_is_refused_at_its_line_showing_the_value_on_one_line(tmp_path):
    assert config_error(tmp_path, f"num_attention_heads = {INJECTED}\n") == (
        "FILE:13: config.num_attention_heads: Input should be a valid integer, not a string "
        "'4 \"\"\"\\nimport os; os.system(\\'touch ..."
    )


@pytest.mark.parametrize("line, error", [
    ("hidden_size = 64.0", "FILE:8: config.hidden_size: Input should be a valid integer, not a number 64.0"),
    ("hidden_size = true", "FILE:8: config.hidden_size: Input should be a valid integer, not a boolean True"),
    ("hidden_size = 0", "FILE:8: config.hidden_size: Input should be greater than or equal to 1"),
    ("hidden_size = -64", "FILE:8: config.hidden_size: Input should be greater than or equal to 1"),
    ("hidden_size = 99999999999999", "FILE:8: config.hidden_size: Input should be less than or equal to 2147483647"),
    ("hidden_size = [64]", "FILE:8: config.hidden_size: Input should be a valid integer, not a list"),
    ("hidden_size = { a = 1 }", "FILE:8: config.hidden_size: Input should be a valid integer, not a table"),
])
def test_an_integer_key_takes_a_positive_int_and_nothing_else(tmp_path, line, error):
    assert load_error(tmp_path, GOOD.replace("hidden_size = 64", line)) == error


def test_a_model_of_absurdly_many_layers_is_refused_before_anything_is_planned(tmp_path):
    assert load_error(tmp_path, GOOD.replace("num_hidden_layers = 2", "num_hidden_layers = 100000000")) == (
        "FILE:10: config.num_hidden_layers: Input should be less than or equal to 1024"
    )


@pytest.mark.parametrize("extra, error", [
    ("rms_norm_eps = nan", "FILE:13: config.rms_norm_eps: Input should be a finite number"),
    ("rms_norm_eps = 0.0", "FILE:13: config.rms_norm_eps: Input should be greater than 0"),
    ("rope_theta = -inf", "FILE:13: config.rope_theta: Input should be a finite number"),
    ("rope_theta = \"1e6\"", "FILE:13: config.rope_theta: Input should be a valid number, not a string '1e6'"),
    ("sliding_window = 0", "FILE:13: config.sliding_window: Input should be greater than or equal to 1"),
    ("head_dim = 15", "FILE:13: config.head_dim: head_dim 15 must be even: rotary embedding turns pairs of dimensions"),
    ("hidden_act = \"gelu\"", "FILE:13: config.hidden_act: Input should be 'silu', not a string 'gelu'"),
    ("tie_word_embeddings = true", "FILE:13: config.tie_word_embeddings: Input should be False, not a boolean True"),
    ("architectures = [\"Mixtral; import os\"]",
     "FILE:13: config.architectures[0]: String should match pattern '^[A-Za-z_][A-Za-z0-9_]*$', not a string 'Mixtral; import os'"),
    ("rope_scaling = { type = \"dynamic\", factor = 2.0 }",
     "FILE:13: config.rope_scaling.type: Input should be 'default', 'yarn' or 'llama3', not a string 'dynamic'"),
    ("rope_scaling = { type = \"yarn\", factor = 4.0 }",
     "FILE:13: config.rope_scaling: rope type 'yarn' needs original_max_position_embeddings; add it"),
    ("rope_scaling = { type = \"yarn\", factor = 4.0, original_max_position_embeddings = 64, betafast = 1.0 }",
     "FILE:13: config.rope_scaling.betafast: Extra inputs are not permitted; remove it or fix its spelling"),
])
def test_floats_are_finite_and_in_range_and_names_are_ones_the_runtime_builds(tmp_path, extra, error):
    assert config_error(tmp_path, extra + "\n") == error


def test_top_k_cannot_exceed_the_experts(tmp_path):
    assert load_error(tmp_path, GOOD.replace("num_experts_per_tok = 2", "num_experts_per_tok = 5")) == (
        "FILE:12: config.num_experts_per_tok: num_experts_per_tok 5 exceeds the 4 routed experts; a token picks at most every expert"
    )


def test_key_value_heads_must_divide_the_attention_heads(tmp_path):
    assert config_error(tmp_path, "num_attention_heads = 4\nnum_key_value_heads = 3\n") == (
        "FILE:14: config.num_key_value_heads: num_key_value_heads 3 must divide num_attention_heads 4"
    )


QWEN = """\
[model]
name = "mymodel"
family = "qwen3_moe"
doc = "A user's own model."

[config]
vocab_size = 512
hidden_size = 64
num_hidden_layers = 2
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 32

[[checkpoints]]
name = "mymodel_bf16"
"""


def test_layer_index_lists_must_name_layers_the_model_has(tmp_path):
    text = QWEN.replace("moe_intermediate_size = 32\n", "moe_intermediate_size = 32\nmlp_only_layers = [1, 2]\n")
    assert load_error(tmp_path, text) == (
        "FILE:13: config.mlp_only_layers: mlp_only_layers must list distinct layer indices below num_hidden_layers 2; got [1, 2]"
    )
    text = QWEN.replace("moe_intermediate_size = 32\n", "moe_intermediate_size = 32\nmlp_only_layers = [0, 0]\n")
    assert load_error(tmp_path, text).startswith("FILE:13: config.mlp_only_layers: mlp_only_layers must list distinct")


def test_per_layer_lists_and_patterns_have_one_entry_of_the_right_alphabet_per_layer(tmp_path):
    gpt = GOOD.replace('family = "mixtral"', 'family = "gpt_oss"')
    assert load_error(tmp_path, gpt.replace("num_experts_per_tok = 2\n", 'num_experts_per_tok = 2\nlayer_types = ["full_attention"]\n')) == (
        "FILE:13: config.layer_types: layer_types has 1 entries; it needs one per layer (num_hidden_layers 2)"
    )
    assert load_error(tmp_path, gpt.replace("num_experts_per_tok = 2\n", 'num_experts_per_tok = 2\nlayer_types = ["full", "full"]\n')) == (
        "FILE:13: config.layer_types[0]: Input should be 'sliding_attention' or 'full_attention', not a string 'full'"
    )
    nemotron = QWEN.replace('"qwen3_moe"', '"nemotron_h"').replace("num_experts = 4", "n_routed_experts = 4")
    assert load_error(tmp_path, nemotron) == (
        "FILE:6: config: [config] lacks hybrid_override_pattern, which family nemotron_h needs; add it"
    )
    bad = nemotron.replace("moe_intermediate_size = 32\n", 'moe_intermediate_size = 32\nhybrid_override_pattern = "EX"\n')
    assert load_error(tmp_path, bad) == (
        "FILE:13: config.hybrid_override_pattern: String should match pattern '^[M*E-]+$', not a string 'EX'"
    )
    short = nemotron.replace("moe_intermediate_size = 32\n", 'moe_intermediate_size = 32\nhybrid_override_pattern = "E"\n')
    assert load_error(tmp_path, short) == (
        "FILE:13: config.hybrid_override_pattern: hybrid_override_pattern has 1 entries; it needs one per layer (num_hidden_layers 2)"
    )


NEMOTRON = QWEN.replace('"qwen3_moe"', '"nemotron_h"').replace("num_experts = 4", "n_routed_experts = 4").replace(
    "moe_intermediate_size = 32\n", 'moe_intermediate_size = 32\nhybrid_override_pattern = "ME"\n')


@pytest.mark.parametrize("limit", ["[0.0, inf]", "[0, inf]", '[0.0, { __float__ = "Infinity" }]'])
def test_a_mamba_step_limit_that_bounds_nothing_is_kept(tmp_path, limit):
    # transformers 5 saves inf as {"__float__": "Infinity"} (import-checkpoint writes that); TOML spells it inf.
    path = write(tmp_path / "mymodel.toml", NEMOTRON.replace("num_experts_per_tok = 2\n", f"num_experts_per_tok = 2\ntime_step_limit = {limit}\n"))
    assert load_declaration(path).config["time_step_limit"][1] in (math.inf, {"__float__": "Infinity"})


@pytest.mark.parametrize("limit", ["[0.0, 0.1]", "[0.001, inf]", "[0.0]", '[0.0, { __float__ = "NaN" }]', "[true, inf]"])
def test_a_mamba_step_limit_that_bounds_dt_is_refused_not_dropped(tmp_path, limit):
    # The scan runs dt unbounded (runtime/ops/mamba.py): a bound the build would silently ignore is refused.
    shown = {'[0.0, { __float__ = "NaN" }]': "[0.0, {'__float__': 'NaN'}]", "[true, inf]": "[True, inf]"}.get(limit, limit)
    text = NEMOTRON.replace("num_experts_per_tok = 2\n", f"num_experts_per_tok = 2\ntime_step_limit = {limit}\n")
    assert load_error(tmp_path, text) == (
        f"FILE:12: config.time_step_limit: time_step_limit {shown} bounds Mamba-2's step dt; moegen's scan runs it "
        "unbounded, (0, inf), as vLLM runs these checkpoints: set [0.0, inf] or remove the key"
    )


def test_deepseek_group_routing_must_be_able_to_pick_top_k(tmp_path):
    ds = QWEN.replace('"qwen3_moe"', '"deepseek_v3"').replace("num_experts = 4", "n_routed_experts = 8\nfirst_k_dense_replace = 0")
    assert load_error(tmp_path, ds.replace("num_experts_per_tok = 2\n", "num_experts_per_tok = 2\nn_group = 3\n")) == (
        "FILE:13: config.n_group: n_group 3 must divide n_routed_experts 8"
    )
    assert load_error(tmp_path, ds.replace("num_experts_per_tok = 2\n", "num_experts_per_tok = 2\nn_group = 2\ntopk_group = 3\n")) == (
        "FILE:14: config.topk_group: topk_group 3 exceeds n_group 2"
    )
    assert load_error(tmp_path, ds.replace("num_experts_per_tok = 2\n", "num_experts_per_tok = 6\nn_group = 4\ntopk_group = 2\n")) == (
        "FILE:12: config.num_experts_per_tok: num_experts_per_tok 6 exceeds the 4 experts of the topk_group 2 groups a token may pick from"
    )
    assert load_error(tmp_path, ds.replace("first_k_dense_replace = 0", "first_k_dense_replace = 3")) == (
        "FILE:11: config.first_k_dense_replace: first_k_dense_replace 3 exceeds num_hidden_layers 2"
    )


def test_keys_the_family_does_not_read_are_accepted_and_dropped(tmp_path):
    # HF configs carry many keys (initializer_range, bos_token_id...): accepted, never passed on.
    path = write(tmp_path / "mymodel.toml", GOOD.replace("num_experts_per_tok = 2\n", f"num_experts_per_tok = 2\nbos_token_id = {INJECTED}\nrouter = {{ x = [1, {{ y = 2 }}] }}\n"))
    decl = load_declaration(path)
    assert decl.config == {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_local_experts": 4, "num_experts_per_tok": 2}


def test_a_drafter_config_is_typed_by_the_drafters_family(tmp_path):
    bad = EXTERNAL.replace("num_experts_per_tok = 2 }", "num_experts_per_tok = 2, moe_intermediate_size = 32, n_routed_experts = 8, first_k_dense_replace = \"1\" }")
    assert load_error(tmp_path, GOOD.replace("[[targets]]", bad)) == (
        "FILE:22: drafts[0].config.first_k_dense_replace: Input should be a valid integer, not a string '1'"
    )


def test_a_checkpoint_declared_twice_is_reported_at_the_second(tmp_path):
    # RULES TG1
    text = GOOD.replace("[[targets]]", '[[checkpoints]]\nname = "mymodel_bf16"\n\n[[targets]]')
    assert load_error(tmp_path, text) == "FILE:18: checkpoints[1].name: checkpoint 'mymodel_bf16' is declared twice; rename one"


def test_a_target_declared_twice_is_refused(tmp_path):
    # RULES TG1: one target per (checkpoint, SM, layout)
    text = GOOD + '\n[[targets]]\ncheckpoint = "mymodel_bf16"\nsm = 90\nparallel = "tp1"\n'
    assert load_error(tmp_path, text) == "FILE:23: targets[1]: target mymodel_bf16__sm_90__tp1 is declared twice"


def test_an_unknown_family_lists_the_families(tmp_path):
    # RULES TG1
    assert load_error(tmp_path, GOOD.replace('family = "mixtral"', 'family = "mixtrall"')) == (
        "FILE:3: model.family: unknown family 'mixtrall'; families: " + ", ".join(FAMILIES)   # the folders of families/
    )
    assert list(FAMILIES) == sorted(FAMILIES) and {"mixtral", "nemotron_h", "qwen3_next"} <= set(FAMILIES)


def test_the_model_name_must_equal_the_file_name(tmp_path):
    # RULES TG1
    assert load_error(tmp_path, GOOD.replace('name = "mymodel"', 'name = "other"')) == (
        "FILE:2: model.name: 'other' must equal the file name 'mymodel'"
    )


def test_a_draft_missing_what_its_kind_needs_is_refused(tmp_path):
    # RULES DR1, DR2: each draft kind brings what it resolves against
    text = GOOD.replace("[[targets]]", '[[drafts]]\nname = "d"\nkind = "external"\nmodes = ["draft_target"]\n\n[[targets]]')
    assert load_error(tmp_path, text) == (
        "FILE:17: drafts[0]: an external draft has its own checkpoint: add [drafts.checkpoint] with its quant metadata"
    )
    text = GOOD.replace("[[targets]]", '[[drafts]]\nname = "d"\nkind = "embedded_mtp"\nmodes = ["medusa"]\n\n[[targets]]')
    assert load_error(tmp_path, text) == (
        "FILE:20: drafts[0].modes: unknown speculative modes ['medusa']; modes: mtp, eagle3, draft_target, dspark, "
        "ngram, prompt_lookup"
    )


def test_a_parallel_profile_must_cover_the_same_ranks(tmp_path):
    # RULES TG1
    text = GOOD.replace("[[targets]]", "[parallel_profiles.fast]\ntp = 2\nmoe_tp = 1\nep = 1\n\n[[targets]]")
    assert load_error(tmp_path, text) == "FILE:17: parallel_profiles.fast: moe_tp x ep = 1 must equal tp x dp = 2"


@pytest.mark.parametrize("name", ["tp2", "tp4_moetp2ep2", "dep2"])
def test_a_parallel_profile_named_like_a_layout_is_refused(tmp_path, name):
    # issue 10 §4: `tp2` meaning 4 ranks would make one name stand for two layouts
    text = GOOD.replace("[[targets]]", f"[parallel_profiles.{name}]\ntp = 4\nmoe_tp = 4\nep = 1\n\n[[targets]]")
    assert load_error(tmp_path, text) == (
        f"FILE:17: parallel_profiles.{name}: profile {name!r} is named like a parallel layout (tp<N>, tp<N>_moetp<X>ep<Y>, "
        "dep<N>), which means something of its own; this profile declares 4 ranks (tp 4, moe_tp 4, ep 1, dp 1): "
        "rename it (e.g. low_latency)"
    )


def test_a_profile_named_like_a_layout_is_refused_by_the_cli_in_a_models_folder(tmp_path, capsys):
    from codegen.cli import main

    folder = tmp_path / "mine"
    folder.mkdir()
    text = GOOD.replace("[[targets]]", "[parallel_profiles.tp2]\ntp = 4\nmoe_tp = 4\nep = 1\n\n[[targets]]")
    write(folder / "mymodel.toml", text)
    assert main(["list", "--models", str(folder)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {folder / 'mymodel.toml'}:17: parallel_profiles.tp2: profile 'tp2' is named like")


def test_a_declared_selection_is_checked_when_the_file_loads(tmp_path):
    # RULES TA2, TA4 at file:line
    text = GOOD + 'selection = { backend = "TORCH", tactic = "bf16" }\n'
    assert load_error(tmp_path, text) == (
        "FILE:22: targets[0].selection: moe_config.tactic 'bf16' is set next to moe_config.backend 'TORCH': a tactic "
        "is accepted only next to backend AUTO; set moe_config.backend to AUTO or drop the tactic (RULES TA4)"
    )
    text = GOOD + '\n[targets.selection]\ntactic = "grouped_mn"\n'
    assert load_error(tmp_path, text) == (
        "FILE:23: targets[0].selection: moe_config.tactic 'grouped_mn': unknown segment 'grouped_mn'; did you mean "
        "'grouped_mm' or 'grouped_gemm'? (RULES TA2)"
    )


def test_invalid_toml_is_a_declaration_error(tmp_path):
    # RULES TG2: invalid declarations are errors, never tracebacks
    assert load_error(tmp_path, GOOD + "\n[[[\n") == (
        "FILE: not valid TOML: Invalid initial character for a key part (at line 23, column 3)"
    )


# --- a user's --models DIR ----------------------------------------------------------------------------


def test_a_user_models_folder_adds_its_own_model_to_the_projects(tmp_path):
    # RULES TG1 (issue 2 item 9: --models DIR)
    write(tmp_path / "mymodel.toml", GOOD)
    models = load_models(tmp_path)
    assert set(models) == set(project_models()) | {"mymodel"}
    assert find_model("mymodel", models).targets[0].name == "mymodel_bf16__sm_90__tp1"


def test_a_user_model_is_validated_the_same_way_and_named_by_its_path(tmp_path):
    # RULES TG1, TG2 (issue 2 item 9)
    path = write(tmp_path / "mymodel.toml", GOOD.replace("sm = 90", "sm = 9000"))
    with pytest.raises(DeclarationError) as info:
        load_models(tmp_path)
    assert str(info.value) == f"{path}:19: targets[0].sm: Input should be less than or equal to 999"


def test_a_user_model_named_like_a_project_model_is_refused(tmp_path):
    # RULES TG6: a model name routes to one declaration
    path = write(tmp_path / "kimi_k3.toml", GOOD.replace("mymodel", "kimi_k3"))
    with pytest.raises(DeclarationError) as info:
        load_models(tmp_path)
    assert str(info.value) == f"{path}: model 'kimi_k3' is already declared by the project; rename it"


def test_a_models_path_that_is_not_a_folder_is_refused(tmp_path):
    # RULES TG6 (issue 2 item 9)
    with pytest.raises(DeclarationError) as info:
        load_models(tmp_path / "nope")
    assert str(info.value) == f"--models {tmp_path / 'nope'}: not a folder of declaration files"


def test_an_unknown_model_name_gets_a_suggestion():
    # RULES TG6
    with pytest.raises(DeclarationError) as info:
        find_model("kimi", project_models())
    assert str(info.value).startswith("unknown model 'kimi'; did you mean 'kimi_k3'? models: deepseek_r1_nvfp4, ")


# --- drafts and checkpoints named in a declaration ----------------------------------------------------

EXTERNAL = """\
[[drafts]]
name = "d"
kind = "external"
modes = ["draft_target"]
family = "deepseek_v3"
config = { vocab_size = 512, hidden_size = 64, num_hidden_layers = 2, num_experts_per_tok = 2 }
checkpoint = { name = "d_bf16" }

[[targets]]"""


def test_a_drafter_config_lacking_its_family_keys_is_reported_at_the_draft_config(tmp_path):
    # RULES DR2: an external drafter resolves against its own config
    assert load_error(tmp_path, GOOD.replace("[[targets]]", EXTERNAL)) == (
        "FILE:22: drafts[0].config: the drafter's config lacks moe_intermediate_size, n_routed_experts, "
        "first_k_dense_replace, which family deepseek_v3 needs; add it"
    )


def test_a_draft_experts_prefix_with_an_unknown_placeholder_is_refused(tmp_path):
    # RULES DR7: draft stages are located by their prefix
    stages = '[[drafts]]\nname = "d"\nkind = "draft_stages"\nmodes = ["dspark"]\nnum_layers = 2\nexperts_prefix = "model.stages.{stage}.experts"\n\n[[targets]]'
    assert load_error(tmp_path, GOOD.replace("[[targets]]", stages)) == (
        "FILE:17: drafts[0]: experts_prefix 'model.stages.{stage}.experts' may use only {k} (the draft layer number) "
        "and {layer} (the absolute layer index)"
    )


def test_asking_a_model_for_a_checkpoint_it_does_not_declare_is_a_declaration_error():
    # RULES TG1
    with pytest.raises(DeclarationError) as info:
        project_models()["kimi_k3"].facts("kimi_k3_nvfp4")
    assert str(info.value) == "model kimi_k3 has no checkpoint 'kimi_k3_nvfp4'; its checkpoints: kimi_k3_mxfp4"


def test_an_unknown_default_routed_format_is_refused_at_its_line(tmp_path):
    # RULES FN1: the model's default routed format is a format moegen knows.
    text = GOOD.replace("[[checkpoints]]", '[policies]\ndefault_routed_format = "MXFP5"\n\n[[checkpoints]]')
    assert load_error(tmp_path, text) == (
        "FILE:15: policies.default_routed_format: unknown expert format 'MXFP5'; known: FP8_BLOCK_SCALES, NVFP4, "
        "W4A16_NVFP4, MXFP4, W4A16_MXFP4"
    )


def test_a_misspelt_key_holding_a_line_break_is_named_quoted_on_one_line(tmp_path):
    # (Found by tests/codegen/test_declaration_property.py: the key was echoed with its line break.)
    error = config_error(tmp_path, 'rope_scaling = { "x\\n\\"\\"\\"" = 0 }\n')
    assert error == "FILE:13: config.rope_scaling.'x\\n\"\"\"': Extra inputs are not permitted; remove it or fix its spelling"
