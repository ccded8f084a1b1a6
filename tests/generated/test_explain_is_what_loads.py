"""Whatever `explain` says serves is what `generated.load_model` loads (RULES TG6, SD3).

Each case asks `python -m codegen explain --json` (its main()) and then loads the same deployment with
`load_model(device="meta")` (the build's structure, nothing allocated): the build that loads, the
experts classes its MoE layers hold and, when the selection needs a draft, the draft its package
holds must be the ones explain names. The cases cover each criterion of the decision, passing and
failing, on shipped models of several sizes.
"""

from __future__ import annotations

import importlib
import json
import logging

import pytest

import generated
from codegen.cli import main
from registry.impls import load_registry
from runtime.experts.base import ExpertsBase

REGISTRY = load_registry()

# (model, sm, parallel, checkpoint, explain flags, what explain must say loads)
CASES = [
    ("qwen3_30b_a3b", 90, "tp1", "qwen3_30b_a3b_bf16", [], "qwen3_30b_a3b_bf16__sm_90__tp1"),
    # claims (TORCH is honored) but the build binds CUPY: the generic build binds TORCH
    ("qwen3_30b_a3b", 90, "tp1", "qwen3_30b_a3b_bf16", ["--backend", "TORCH"], "qwen3_30b_a3b/generic"),
    ("tiny_qwen3_moe", 90, "tp1", "tiny_qwen3_moe_bf16", ["--tactic", "eager.loop"], "tiny_qwen3_moe/generic"),
    ("tiny_qwen3_moe", 100, "tp1", "tiny_qwen3_moe_bf16", [], "tiny_qwen3_moe/generic"),
    ("tiny_deepseek_v3", 90, "tp1", "tiny_deepseek_v3_bf16", ["--spec-mode", "mtp"], "tiny_deepseek_v3_bf16__sm_90__tp1"),
    ("tiny_deepseek_v3", 90, "tp1", "tiny_deepseek_v3_fp8", [], "tiny_deepseek_v3_fp8__sm_90__tp1"),
    # the draft honors VANILLA, but draft.py binds the grouped GEMM
    ("tiny_deepseek_v3", 90, "tp1", "tiny_deepseek_v3_bf16", ["--spec-mode", "mtp", "--draft-backend", "VANILLA"], "tiny_deepseek_v3/generic"),
    # honors any draft id, but its build has no draft
    ("kimi_k3", 100, "tp16_moetp4ep4", "kimi_k3_mxfp4", ["--spec-mode", "dspark"], "kimi_k3/generic"),
    ("kimi_k3", 100, "tp16_moetp16ep1", "kimi_k3_mxfp4", [], "kimi_k3_mxfp4__sm_100__tp16_moetp16ep1"),
    ("minimax_m3", 107, "tp4", "minimax_m3_nvfp4", ["--spec-mode", "mtp"], "minimax_m3/generic"),
    ("minimax_m3", 107, "tp4", "minimax_m3_nvfp4", ["--spec-mode", "ngram"], "minimax_m3_nvfp4__sm_107__tp4"),
    ("gpt_oss_120b", 90, "tp1", "gpt_oss_120b_mxfp4", [], "gpt_oss_120b_mxfp4__sm_90__tp1"),
    ("gpt_oss_120b", 100, "tp1", "gpt_oss_120b_mxfp4", ["--tactic", "eager"], "gpt_oss_120b/generic"),
]


def _explain(capsys, model, sm, parallel, checkpoint, flags) -> dict:
    code = main(["explain", "--model", model, "--sm", str(sm), "--parallel", parallel, "--checkpoint", checkpoint, "--json", *flags])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    (site,) = json.loads(out)["sites"]
    return site


def _selection(flags) -> tuple[dict, dict | None]:
    given = dict(zip(flags[::2], flags[1::2]))
    moe = {k: given[f] for k, f in (("backend", "--backend"), ("tactic", "--tactic")) if f in given}
    spec = {k: given[f] for k, f in (("mode", "--spec-mode"), ("moe_backend", "--draft-backend")) if f in given}
    return moe, spec or None


def _experts_ids(model) -> set[str]:
    classes = {f"{type(m).__module__}:{type(m).__name__}" for m in model.modules() if isinstance(m, ExpertsBase)}
    return {str(i.id) for i in REGISTRY.impls if i.class_path in classes}


@pytest.mark.parametrize("model, sm, parallel, checkpoint, flags, expected", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{'_'.join(c[4]) or 'declared'}" for c in CASES])
def test_explain_names_the_build_load_model_loads(capsys, caplog, model, sm, parallel, checkpoint, flags, expected):
    site = _explain(capsys, model, sm, parallel, checkpoint, flags)
    assert site["loads"] == expected
    assert site["serves"] == (expected != f"{model}/generic" or not site["target"])
    caplog.set_level(logging.WARNING, logger="moegen")
    moe, spec = _selection(flags)
    built = generated.load_model(model, sm, parallel, moe_config=moe, speculative_config=spec, checkpoint_name=checkpoint, device="meta")
    package = type(built).__module__.removesuffix(".modeling")
    assert package == f"generated.{model}.{expected.removeprefix(model + '/')}"
    logged = {r.getMessage().split("; loading the generic build")[0] for r in caplog.records if r.name == "moegen"}
    if site["target"]:
        # Every reason the build index logged is a criterion explain reported failing, word for word.
        assert logged == {f"{site['name']}: {c['text']}" for c in site["criteria"] if c["ok"] is False}
    else:
        assert [m.split(" (declared")[0] for m in logged] == [
            f"no target of {model} is declared for checkpoint {checkpoint} on sm_{sm} with parallel {parallel}"
        ]
    # The loaded build binds what explain says it binds, and holds the draft it says it holds.
    target_ids = {l["impl"] for l in site["loaded"] if l["role"] != "draft"}
    assert _experts_ids(built) == target_ids
    draft = {(layer, l["impl"]) for l in site["loaded"] if l["role"] == "draft" for layer in l["layers"]}
    held = getattr(built, "draft", None)   # what load_model attached (a generic build's MTP draft too)
    if held is not None:
        assert set(held._layers) == draft != set()
    else:
        assert draft == set()
    if spec and spec["mode"] == "mtp" and site["serves"]:
        assert set(importlib.import_module(f"{package}.draft").DRAFT_LAYERS) == draft != set()


def test_what_generate_require_accepts_is_what_the_written_package_loads(capsys, tmp_path, monkeypatch):
    # RULES TG6: `generate --mode require` decides like the build index, on the build it writes; the package
    # it writes then loads that build, draft included, for the same selection.
    out = tmp_path / "explored"
    flags = ["--spec-mode", "mtp", "--draft-backend", "VANILLA"]
    code = main(["generate", "--model", "tiny_deepseek_v3", "--sm", "90", "--parallel", "tp1", *flags, "--mode", "require", "--out", str(out)])
    written, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "tiny_deepseek_v3_bf16__sm_90__tp1: written to " in written
    monkeypatch.syspath_prepend(str(tmp_path))
    package = importlib.import_module("explored")
    built = package.load_model("tiny_deepseek_v3", 90, checkpoint_name="tiny_deepseek_v3_bf16", device="meta",
                               speculative_config={"mode": "mtp", "moe_backend": "VANILLA"}, mode="require")
    assert type(built).__module__ == "explored.tiny_deepseek_v3.tiny_deepseek_v3_bf16__sm_90__tp1.modeling"
    draft = importlib.import_module("explored.tiny_deepseek_v3.tiny_deepseek_v3_bf16__sm_90__tp1.draft")
    assert draft.DRAFT_LAYERS == ((3, "torch.eager.loop.bf16"),)
