"""The deployment selection: `moe_config`, `speculative_config`, EPLB, from dicts, files and flags
(RULES TA1, TA2, TA4, RQ1, RQ4)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from registry.deploy import DeployConfig, MoeConfig, SpeculativeConfig, from_flags, load_deploy, parse_deploy
from registry.errors import SelectionError, TacticError
from registry.selection import Selection, check_selection
from tests.registry.helpers import write

TA4_TARGET = (
    "moe_config.tactic 'bf16' is set next to moe_config.backend 'TORCH': a tactic is accepted only next to backend "
    "AUTO; set moe_config.backend to AUTO or drop the tactic (RULES TA4)"
)
TA4_DRAFT = (
    "speculative_config.moe_tactic 'bf16' is set next to speculative_config.moe_backend 'TORCH': a draft tactic is "
    "accepted only next to a speculative_config.moe_backend that is unset or AUTO; unset "
    "speculative_config.moe_backend or drop the tactic (RULES TA4)"
)


# --- stored forms ----------------------------------------------------------------------------------------


def test_a_tactic_is_stored_stripped_and_lowercased_and_a_literal_stripped():
    # RULES TA1
    assert MoeConfig(tactic=" Grouped_MM.BF16 ").tactic == "grouped_mm.bf16"
    assert MoeConfig(backend=" TORCH ").backend == "TORCH"
    spec = SpeculativeConfig(mode="mtp", moe_backend=" AUTO ", moe_tactic=" EAGER ")
    assert (spec.moe_backend, spec.moe_tactic) == ("AUTO", "eager")


def test_the_defaults_are_auto_without_tactic_or_eplb():
    # RULES RQ3
    assert DeployConfig().selection() == Selection()


# --- TA4: a tactic only next to AUTO; the value is read, not whether it was set ----------------------


def test_a_tactic_next_to_a_concrete_backend_is_refused_naming_both_fields():
    # RULES TA4
    with pytest.raises(TacticError) as info:
        MoeConfig(backend="TORCH", tactic="bf16")
    assert str(info.value) == TA4_TARGET


def test_an_explicit_auto_next_to_a_tactic_is_accepted():
    # RULES TA4: the check reads the value; AUTO set explicitly is AUTO.
    assert MoeConfig(backend="AUTO", tactic="bf16").tactic == "bf16"
    assert DeployConfig.model_validate({"moe_config": {"backend": "AUTO", "tactic": "bf16"}}).moe_config.tactic == "bf16"


def test_a_draft_tactic_next_to_a_concrete_draft_backend_is_refused_naming_both_fields():
    # RULES TA4
    with pytest.raises(TacticError) as info:
        SpeculativeConfig(mode="mtp", moe_backend="TORCH", moe_tactic="bf16")
    assert str(info.value) == TA4_DRAFT


def test_a_draft_tactic_next_to_an_unset_or_auto_draft_backend_is_accepted():
    # RULES TA4
    assert SpeculativeConfig(mode="mtp", moe_tactic="bf16").moe_tactic == "bf16"
    assert SpeculativeConfig(mode="mtp", moe_backend="AUTO", moe_tactic="bf16").moe_tactic == "bf16"


def test_a_draft_tactic_is_independent_of_the_target_backend():
    # RULES TA4, DR1: a concrete moe_config.backend does not refuse a draft tactic.
    config = parse_deploy({"moe_config": {"backend": "TORCH"}, "speculative_config": {"mode": "mtp", "moe_tactic": "eager"}})
    assert config.selection() == Selection(backend="TORCH", spec_mode="mtp", draft_tactic="eager")


def test_a_model_dump_round_trips():
    # RULES TA4: a rebuild from a full dump (AUTO written out) still accepts the tactic.
    config = parse_deploy({"moe_config": {"tactic": "Eager"}, "speculative_config": {"mode": "mtp", "moe_tactic": "BF16"}})
    assert DeployConfig.model_validate(config.model_dump()) == config
    assert DeployConfig.model_validate_json(config.model_dump_json()) == config


# --- refusals when parsed: TA2, RQ1, RQ4 ------------------------------------------------------------------


def test_a_bad_tactic_is_refused_when_the_config_is_parsed():
    # RULES TA2
    with pytest.raises(TacticError) as info:
        MoeConfig(tactic="grouped_mn")
    assert str(info.value) == (
        "moe_config.tactic 'grouped_mn': unknown segment 'grouped_mn'; did you mean 'grouped_mm' or 'grouped_gemm'? (RULES TA2)"
    )
    with pytest.raises(TacticError) as info:
        MoeConfig(tactic="")
    assert str(info.value).startswith("moe_config.tactic is empty: ")


def test_an_unknown_backend_is_refused_when_the_config_is_parsed():
    # RULES RQ1
    with pytest.raises(SelectionError) as info:
        MoeConfig(backend="CUTLASS")
    assert str(info.value) == (
        "moe_config.backend 'CUTLASS' is not a backend literal; literals: AUTO, CUPY, TORCH, TRITON, VANILLA (a tactic goes in "
        "the tactic field, in lower case) (RULES RQ1)"
    )


def test_dynamic_eplb_refuses_a_tactic_or_literal_without_plan_consumers_when_parsed():
    # RULES RQ4
    with pytest.raises(TacticError) as info:
        MoeConfig(tactic="eager.bf16", eplb=True)
    assert str(info.value) == (
        "moe_config.tactic 'eager.bf16' under dynamic EPLB names no implementation that consumes EPLB plans; it "
        "matches torch.eager.loop.bf16 (RULES RQ4)"
    )
    with pytest.raises(SelectionError):
        MoeConfig(backend="VANILLA", eplb=True)
    assert MoeConfig(tactic="bf16", eplb=True).eplb  # matches a consumer (TORCH): accepted


def test_draft_fields_without_a_speculative_mode_are_refused():
    # RULES DR1
    with pytest.raises(SelectionError) as info:
        check_selection(Selection(draft_tactic="bf16"))
    assert str(info.value) == (
        "speculative_config.moe_backend/speculative_config.moe_tactic are set but speculative_config.mode is not: "
        "set the speculative mode whose draft they select"
    )


# --- from dicts and files ----------------------------------------------------------------------------------


def test_errors_from_a_dict_name_the_source_and_field():
    # RULES TA4
    with pytest.raises(TacticError) as info:
        parse_deploy({"moe_config": {"backend": "TORCH", "tactic": "bf16"}}, "deploy.toml")
    assert str(info.value) == f"deploy.toml: {TA4_TARGET}"
    with pytest.raises(SelectionError) as info:
        parse_deploy({"moe_config": {"backnd": "TORCH"}}, "deploy.toml")
    assert str(info.value) == "deploy.toml: moe_config.backnd: Extra inputs are not permitted"
    with pytest.raises(SelectionError) as info:
        parse_deploy({"speculative_config": {"mode": "medusa"}}, "deploy.toml")
    assert str(info.value) == (
        "deploy.toml: speculative_config.mode: Input should be 'mtp', 'eagle3', 'draft_target', 'dspark', 'ngram' or "
        "'prompt_lookup'"
    )
    with pytest.raises(SelectionError) as info:
        parse_deploy({"speculative_config": {"moe_tactic": "bf16"}}, "deploy.toml")
    assert str(info.value) == "deploy.toml: speculative_config.mode: Field required"


def test_a_toml_file_loads(tmp_path):
    # RULES TA1, TA4 (issue 2 item 5: loadable from a TOML file)
    path = write(tmp_path / "deploy.toml", (
        "[moe_config]\nbackend = \"AUTO\"\ntactic = \" Grouped_MM \"\neplb = true\n\n"
        "[speculative_config]\nmode = \"mtp\"\nmoe_tactic = \"Grouped_MM.FP8_Block_Scales\"\n"
    ))
    assert load_deploy(path).selection() == Selection(
        backend="AUTO", tactic="grouped_mm", eplb=True, spec_mode="mtp", draft_tactic="grouped_mm.fp8_block_scales"
    )


def test_a_json_file_loads(tmp_path):
    # RULES TA4 (issue 2 item 5: loadable from a JSON file)
    path = write(tmp_path / "deploy.json", json.dumps({"moe_config": {"backend": "VANILLA"}, "speculative_config": {"mode": "ngram"}}))
    assert load_deploy(path).selection() == Selection(backend="VANILLA", spec_mode="ngram")


def test_a_file_with_a_refused_selection_names_the_file(tmp_path):
    # RULES TA4
    path = write(tmp_path / "deploy.toml", '[moe_config]\nbackend = "TORCH"\ntactic = "bf16"\n')
    with pytest.raises(TacticError) as info:
        load_deploy(path)
    assert str(info.value) == f"{path}: {TA4_TARGET}"


def test_unreadable_or_invalid_files_are_selection_errors(tmp_path):
    # RULES TA2: refused when parsed, with a message, never a traceback
    with pytest.raises(SelectionError) as info:
        load_deploy(tmp_path / "missing.toml")
    assert str(info.value) == f"--config {tmp_path / 'missing.toml'}: no such file"
    path = write(tmp_path / "bad.json", "{x")
    with pytest.raises(SelectionError) as info:
        load_deploy(path)
    assert str(info.value) == f"--config {path}: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    path = write(tmp_path / "bad.toml", "[x")
    with pytest.raises(SelectionError) as info:
        load_deploy(path)
    assert str(info.value) == f"--config {path}: not valid TOML: Expected ']' at the end of a table declaration (at end of document)"


# --- from CLI flags ----------------------------------------------------------------------------------------


def test_flags_build_a_selection():
    # RULES TA1
    config = from_flags(tactic=" Eager ", spec_mode="mtp", draft_tactic=" BF16 ")
    assert config.selection() == Selection(tactic="eager", spec_mode="mtp", draft_tactic="bf16")


def test_a_flag_replaces_the_files_field_and_the_result_is_checked_again(tmp_path):
    # RULES TA4: a file's concrete backend and a --tactic flag are refused together.
    base = load_deploy(write(tmp_path / "d.toml", '[moe_config]\nbackend = "TORCH"\n[speculative_config]\nmode = "mtp"\nmoe_backend = "VANILLA"\n'))
    with pytest.raises(TacticError) as info:
        from_flags(tactic="bf16", base=base)
    assert str(info.value) == TA4_TARGET
    config = from_flags(backend="AUTO", tactic="bf16", draft_backend="AUTO", draft_tactic="eager", base=base)
    assert config.selection() == Selection(tactic="bf16", spec_mode="mtp", draft_backend="AUTO", draft_tactic="eager")


def test_draft_flags_need_a_speculative_mode():
    # RULES DR1
    with pytest.raises(SelectionError) as info:
        from_flags(draft_tactic="bf16")
    assert str(info.value) == "--draft-backend/--draft-tactic need --spec-mode: the draft they select belongs to a speculative mode"


def test_a_config_is_frozen_and_forbids_unknown_fields():
    # RULES TA4: the stored value is the one checked
    with pytest.raises(ValidationError):
        MoeConfig(tactic="bf16", backnd="AUTO")
    config = MoeConfig()
    with pytest.raises(ValidationError):
        config.tactic = "bf16"


def test_equivalent_spellings_of_a_selection_have_one_canonical_form():
    # RULES TA1 (GN2 fingerprints read this form)
    a = Selection(tactic="bf16.eager", spec_mode="mtp", draft_tactic="Grouped_MM")
    b = Selection(tactic=" *.EAGER.*.bf16 ", spec_mode="mtp", draft_tactic="grouped_mm.*")
    assert a.canonical() == b.canonical() == {
        "backend": "AUTO",
        "tactic": "*.eager.*.bf16",
        "eplb": False,
        "spec_mode": "mtp",
        "draft_backend": None,
        "draft_tactic": "*.grouped_mm.*.*",
    }
    assert Selection(tactic="eager").canonical() != Selection(tactic="eager.bf16").canonical()
