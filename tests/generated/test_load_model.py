"""`generated.load_model` routes a deployment to the build that serves it: the specialized build when its target claims the selection and is bound to what the selection resolves to, else the generic build under `auto` (saying why), an error naming the criterion under `require`, the generic build always under `off` (RULES TG5, TG6); a checkpoint folder is matched to a declared checkpoint by its quant metadata."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import generated
from registry.errors import NotHonoredError, SelectionError
from tests.generated import builds

QWEN_TARGET = "tiny_qwen3_moe_bf16__sm_90__tp1"
QWEN_GENERIC = "generated.tiny_qwen3_moe.generic.modeling"


def _module(model) -> str:
    return type(model).__module__


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moegen" and r.levelno >= logging.WARNING]


def test_the_specialized_build_serves_a_selection_its_target_claims(caplog):
    caplog.set_level(logging.INFO, logger="moegen")
    folder = builds.transformers_checkpoint("tiny_qwen3_moe")
    model = generated.load_model("tiny_qwen3_moe", 90, checkpoint=folder, dtype=torch.float32)
    assert _module(model) == f"generated.tiny_qwen3_moe.{QWEN_TARGET}.modeling"
    assert next(model.parameters()).dtype == torch.float32
    assert _warnings(caplog) == []


def test_auto_loads_the_generic_build_for_a_tactic_the_target_does_not_honor_and_says_why(caplog):
    caplog.set_level(logging.WARNING, logger="moegen")
    model = generated.load_model("tiny_qwen3_moe", 90, moe_config={"tactic": "eager.loop"})
    assert _module(model) == QWEN_GENERIC
    (warning,) = _warnings(caplog)
    # RULES TG3/TG5: which target refused, what the tactic resolves to, what the target honors, what serves.
    assert warning.startswith(f"{QWEN_TARGET}: moe_config.tactic 'eager.loop' resolves to torch.eager.loop.bf16")
    assert "this target honors only torch.grouped_mm.grouped_gemm.bf16" in warning
    assert warning.endswith(f"; loading the generic build {QWEN_GENERIC}")


def test_auto_loads_the_generic_build_where_no_target_is_declared(caplog):
    caplog.set_level(logging.WARNING, logger="moegen")
    model = generated.load_model("tiny_qwen3_moe", 100)
    assert _module(model) == QWEN_GENERIC
    (warning,) = _warnings(caplog)
    assert warning.startswith("no target of tiny_qwen3_moe is declared for checkpoint tiny_qwen3_moe_bf16 on sm_100 with parallel tp1")


def test_auto_loads_the_generic_build_when_the_target_claims_but_was_built_with_another_draft(caplog):
    # The target's draft honors the VANILLA reference, so it claims this draft backend; but its draft.py
    # is bound to what its declared selection resolved to, not to VANILLA: serving it would run the wrong kernel.
    caplog.set_level(logging.WARNING, logger="moegen")
    model = generated.load_model(
        "tiny_deepseek_v3", 90, checkpoint_name="tiny_deepseek_v3_bf16", moe_config={"backend": "TORCH"},
        speculative_config={"mode": "mtp", "moe_backend": "VANILLA"},
    )
    assert _module(model) == "generated.tiny_deepseek_v3.generic.modeling"
    (warning,) = _warnings(caplog)
    assert warning.startswith("tiny_deepseek_v3_bf16__sm_90__tp1: built with its draft for speculative_config.mode 'mtp'")
    assert "this selection needs mode 'mtp' (torch.eager.loop.bf16 for layers 3)" in warning


def test_require_refuses_naming_the_target_the_tactic_and_what_it_honors():
    with pytest.raises(NotHonoredError) as refused:
        generated.load_model("tiny_qwen3_moe", 90, moe_config={"tactic": "eager.loop"}, mode="require")
    message = str(refused.value)
    assert message.startswith("mode require: no specialized build serves this deployment: ")
    assert f"{QWEN_TARGET}: moe_config.tactic 'eager.loop' resolves to torch.eager.loop.bf16" in message
    assert "this target honors only torch.grouped_mm.grouped_gemm.bf16" in message


def test_require_refuses_an_sm_without_a_target():
    with pytest.raises(NotHonoredError, match="no target of tiny_qwen3_moe is declared for checkpoint tiny_qwen3_moe_bf16 on sm_100"):
        generated.load_model("tiny_qwen3_moe", 100, mode="require")


def test_off_loads_the_generic_build_even_where_a_target_claims(caplog):
    caplog.set_level(logging.INFO, logger="moegen")
    model = generated.load_model("tiny_qwen3_moe", 90, mode="off")
    assert _module(model) == QWEN_GENERIC
    assert _warnings(caplog) == []  # asked for, so said at INFO, not warned
    assert any("mode off" in r.getMessage() for r in caplog.records if r.name == "moegen")


def test_a_checkpoint_folder_selects_the_declared_checkpoint_its_metadata_describes():
    bf16 = generated.load_model("tiny_deepseek_v3", 90, checkpoint=builds.transformers_checkpoint("tiny_deepseek_v3"))
    assert _module(bf16) == "generated.tiny_deepseek_v3.tiny_deepseek_v3_bf16__sm_90__tp1.modeling"
    # DeepSeek's config.json names no excluded modules where the declaration names the router it keeps
    # in bf16: the folder still matches, because every MoE layer gets the same format (RULES FN1).
    fp8 = generated.load_model("tiny_deepseek_v3", 90, checkpoint=builds.deepseek_fp8_checkpoint())
    assert _module(fp8) == "generated.tiny_deepseek_v3.tiny_deepseek_v3_fp8__sm_90__tp1.modeling"


def test_a_checkpoint_folder_whose_metadata_matches_no_declared_checkpoint_is_refused():
    folder = builds.tmp_folder("tiny_deepseek_v3-mxfp4-metadata")
    folder.mkdir(exist_ok=True)
    config = json.loads((builds.transformers_checkpoint("tiny_deepseek_v3") / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SelectionError) as refused:
        generated.load_model("tiny_deepseek_v3", 90, checkpoint=folder)
    assert str(refused.value) == (
        f"the quant metadata of {folder} (config.json) matches none of tiny_deepseek_v3's declared checkpoints "
        "(tiny_deepseek_v3_bf16, tiny_deepseek_v3_fp8); pass checkpoint_name=, or declare it "
        "(python -m codegen import-checkpoint)"
    )
    shutil.rmtree(folder)
