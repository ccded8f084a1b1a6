"""Embedded draft stages (RULES DR7) as runtime draft builds: tiny_deepseek_v4_flash's generated `draft.py` files.

The target's `draft.py` loads its two stages from `model.draft_stages.<k>`, binds and reads their experts in their
own MXFP4 format beside the target's BF16 ones, computes each stage as an MTP layer, and decodes speculatively to the
target's own greedy tokens; the generic build's `draft.py` resolves the same stages at load (their own format, DR7),
computes what the target's draft computes, and decodes the same way.

What a stage is at run time (assumed, codegen.modeling._stages_tree: DeepSeek-V4-Flash's stages are not public):
an MTP-like layer each, laid out and chained like DeepSeek-V3's MTP layers, named `model.draft_stages.<k>`.
The checkpoint is the builds' own seeded random one (runtime.checkpoint.writer, as `python -m generated.run
--tiny` writes it): MXFP4 stage experts as packed E2M1 `weight` + E8M0 `weight_scale`.

Oracle of the stage forward: transformers' DeepSeek-V3 `MtpModel` (float64) over a copy of the checkpoint whose
`model.layers.<3 + k>` hold stage k, its experts dequantized here in float64 from the format definition
(tests/runtime/fixtures_checkpoints.mxfp4_f64, ml_dtypes' code tables). The draft runs in fp32 with its bound
TORCH MXFP4 experts (W4A16: weights exact, GEMM inputs rounded to bf16): relative L2 error <= 2e-3 (observed 1.3e-4).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.generated import builds
from tests.generated import helpers_drafts as drafts

MODEL = "tiny_deepseek_v4_flash"
NEW = 32


def _modules():
    return drafts.build_modules(MODEL, "dspark")


def stages_checkpoint(seed: int = 0):
    """The target's and the draft's seeded random tensors in one folder, as `generated.run --tiny` writes them."""
    from runtime.checkpoint.writer import random_tensors, save_checkpoint

    modeling, draft = _modules()
    tensors = random_tensors(modeling.MODEL_CLASS(device="meta"), "gate_up_down", seed)
    tensors |= random_tensors(draft.DRAFT_CLASS(device="meta"), "gate_up_down", seed + 1)
    return save_checkpoint(tensors, builds.tmp_folder(f"{MODEL}-{seed}"), builds.facts(MODEL).CONFIG)


@pytest.fixture(scope="module")
def case():
    folder = stages_checkpoint()
    return (folder, builds.read_tensors(folder), *drafts.target_and_draft(MODEL, folder, "dspark"))


def test_the_stages_bind_their_own_mxfp4_format_and_the_target_its_bf16_one():
    modeling, draft = _modules()
    assert draft.DRAFT_LAYERS == ((3, "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"), (4, "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"))
    assert {i for _, i in modeling.LAYERS if i} == {"torch.grouped_mm.grouped_gemm.bf16"}
    assert modeling.IGNORED_TENSORS == ("model.draft_stages.0.*", "model.draft_stages.1.*")
    assert draft.STAGES == ("draft_stages", 3)


def test_the_stages_load_from_their_prefix_and_the_target_ignores_them(case):
    _, tensors, _, draft, (target_report, draft_report) = case
    stages = {name for name in tensors if name.startswith("model.draft_stages.")}
    assert {name.split(".")[2] for name in stages} == {"0", "1"}
    assert set(target_report.ignored) == stages and set(draft_report.ignored) == set(tensors) - stages
    assert draft_report.tensors == len(stages)
    assert tensors["model.draft_stages.1.mlp.experts.0.up_proj.weight"].dtype == torch.uint8   # packed E2M1 pairs
    block = draft.model.draft_stages["1"]
    assert torch.equal(block.eh_proj.weight, tensors["model.draft_stages.1.eh_proj.weight"].float())
    assert [type(b.mlp.experts).__name__ for b in draft.blocks] == ["TorchGroupedMmW4a16Mxfp4Experts"] * 2


@pytest.fixture(scope="module")
def transformers_mtp(case):
    """transformers' DeepSeek-V3 and its MtpModel (float64) over the checkpoint with stage k as MTP layer 3 + k,
    its MXFP4 experts dequantized in float64."""
    import json

    from tests.runtime.fixtures_checkpoints import mxfp4_f64
    from transformers.modeling_layers import MtpModel

    folder, tensors, *_ = case
    plain = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale") and ".draft_stages." in name:
            continue
        if name.startswith("model.draft_stages."):
            k = int(name.split(".")[2])
            new = f"model.layers.{3 + k}." + name.split(".", 3)[3]
            scale = name + "_scale"
            t = mxfp4_f64(t, tensors[scale]).float() if scale in tensors else t
            name = new
        plain[name] = t
    config = json.loads((folder / "config.json").read_text()) | {"num_nextn_predict_layers": 2, "model_type": "deepseek_v3"}
    config.pop("quantization_config", None)
    converted = builds.write_checkpoint(builds.tmp_folder(f"{MODEL}-as-mtp"), plain, config)
    main = builds.transformers_model(converted, torch.float64)
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.[34]\..*"]
    return main, MtpModel.from_pretrained(main).eval(), plain


def test_draft_step_k_runs_stage_k_as_an_mtp_layer(case, transformers_mtp):
    _, _, target, draft, _ = case
    main, mtp, plain = transformers_mtp
    ids, next_ids = builds.token_ids(512, 2, 10), builds.token_ids(512, 2, 10)
    positions = torch.arange(10)[None]
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        for k in (0, 1):
            logits, _ = draft(next_ids, hidden, step=k)
            prefix = f"model.layers.{3 + k}."
            embeds = plain[prefix + "embed_tokens.weight"].double()[next_ids]
            normed = mtp.forward_layer(k, hidden.double(), positions, None, inputs_embeds=embeds)
            expected = normed @ plain[prefix + "shared_head.head.weight"].double().T
            assert builds.rel_err(logits, expected) <= 2e-3, k


@pytest.fixture(scope="module")
def speculative_target(case):
    """load_model under speculative_config mode dspark, from the folder holding the stages (fp32)."""
    from generated import load_model

    return load_model(MODEL, 90, checkpoint=str(case[0]), checkpoint_name=f"{MODEL}_mixed",
                      speculative_config={"mode": "dspark"}, dtype=torch.float32, mode="require").eval()


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_the_draft_stages_is_the_target_greedy(speculative_target, k):
    target = speculative_target
    assert type(target.draft).__module__ == _modules()[1].__name__
    out = drafts.assert_speculative_greedy_is_the_target_greedy(target, k, NEW)
    assert out.rounds >= math.ceil((NEW - 1) / (k + 1))


def test_stages_under_a_prefix_the_runtime_cannot_build_are_refused_and_nothing_is_written(tmp_path):
    text = (builds.ROOT / "registry" / "models" / f"{MODEL}.toml").read_text(encoding="utf-8")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "odd_stages.toml").write_text(
        text.replace(f'name = "{MODEL}"', 'name = "odd_stages"').replace("model.draft_stages.{k}.mlp.experts", "model.stages.{k}.experts")
        .replace('"model.draft_stages.*.mlp.experts.*"', '"model.stages.*.experts.*"'), encoding="utf-8")
    done = builds.codegen_run("generate", "--models", tmp_path / "models", "--model", "odd_stages", "--out", tmp_path / "out")
    assert done.returncode == 2
    assert done.stderr == (
        "error: tiny_deepseek_v4_flash_mixed__sm_90__tp1: draft stages tiny_deepseek_v4_flash_stages have experts_prefix "
        "'model.stages.{k}.experts'; the runtime builds stages named 'model.<name>.{k}.mlp.experts' (one MTP-like layer "
        "each, <name> not 'layers')\n")
    assert not (tmp_path / "out").exists()


# --- The generic build constructs the stages too (issue 13), resolved at load through the same MTPDraft -----------------

GENERIC_DRAFT = f"generated.{MODEL}.generic.draft"


def _generic_draft(**selection):
    from registry.selection import Selection

    return builds.load(GENERIC_DRAFT).DRAFT_CLASS(
        checkpoint=f"{MODEL}_mixed", sm=90, selection=Selection(spec_mode="dspark", **selection), dtype=torch.float32)


def test_the_generic_stages_resolve_against_their_own_mxfp4_format_at_load():
    from registry.selection import Selection

    # RULES DR7: under one backend request the stages bind the MXFP4 implementation, the target the BF16 one.
    modeling = builds.load(f"generated.{MODEL}.generic.modeling")
    target = modeling.MODEL_CLASS(checkpoint=f"{MODEL}_mixed", sm=90, selection=Selection(backend="VANILLA", spec_mode="dspark"),
                                  device="meta")
    draft = _generic_draft(draft_backend="VANILLA")
    assert {type(layer.mlp.experts).__name__ for layer in target.model.layers if hasattr(layer.mlp, "experts")} == {"TorchEagerBf16Experts"}
    assert draft.draft_layer_ids() == ((3, "torch.eager.loop.w4a16_mxfp4"), (4, "torch.eager.loop.w4a16_mxfp4"))
    assert [type(b.mlp.experts).__name__ for b in draft.blocks] == ["TorchEagerW4a16Mxfp4Experts"] * 2
    assert builds.load(GENERIC_DRAFT).STAGES == ("draft_stages", 3)
    # The full-size declaration: MXFP4 stages beside NVFP4 target experts on sm_100, tp8 (structure only).
    big = builds.load("generated.deepseek_v4_flash.generic.draft").DRAFT_CLASS(
        checkpoint="deepseek_v4_flash_nvfp4", sm=100, parallel="tp8", selection=Selection(spec_mode="dspark"), device="meta")
    assert big.draft_layer_ids() == ((61, "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"), (62, "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"))
    assert sorted(big.model.draft_stages) == ["0", "1"]


def test_the_generic_stages_load_from_their_prefix_and_compute_what_the_specialized_draft_does(case):
    folder, tensors, target, draft, _ = case
    generic = _generic_draft(draft_backend="TORCH")   # the specialized draft's own binding, resolved at load
    assert generic.draft_layer_ids() == draft.draft_layer_ids()
    report = generic.load_checkpoint(folder)
    stages = {name for name in tensors if name.startswith("model.draft_stages.")}
    assert report.tensors == len(stages) and set(report.ignored) == set(tensors) - stages
    ids, next_ids = builds.token_ids(512, 2, 9), builds.token_ids(512, 2, 9)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        for k in (0, 1):
            ours, ours_hidden = generic(next_ids, hidden, step=k)
            theirs, theirs_hidden = draft(next_ids, hidden, step=k)
            assert torch.equal(ours, theirs) and torch.equal(ours_hidden, theirs_hidden), k


@pytest.fixture(scope="module")
def generic_speculative(case):
    """load_model under mode dspark with the generic build (mode off), from the folder holding the stages (fp32)."""
    from generated import load_model

    return load_model(MODEL, 90, checkpoint=str(case[0]), checkpoint_name=f"{MODEL}_mixed", mode="off",
                      moe_config={"backend": "TORCH"}, speculative_config={"mode": "dspark"}, dtype=torch.float32).eval()


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_the_generic_stages_is_the_target_greedy(generic_speculative, k):
    target = generic_speculative
    assert (type(target).__module__, type(target.draft).__module__) == (f"generated.{MODEL}.generic.modeling", GENERIC_DRAFT)
    out = drafts.assert_speculative_greedy_is_the_target_greedy(target, k, NEW)
    assert out.rounds >= math.ceil((NEW - 1) / (k + 1))


def test_the_generic_stages_refuse_another_mode():
    from generated import load_model
    from registry.errors import SelectionError
    from registry.selection import Selection

    with pytest.raises(SelectionError) as info:
        load_model(MODEL, 90, checkpoint_name=f"{MODEL}_mixed", mode="off", moe_config={"backend": "TORCH"},
                   speculative_config={"mode": "mtp"})
    assert str(info.value) == f"{MODEL} has no draft for speculative_config.mode 'mtp'; its drafts serve: dspark"
    with pytest.raises(ValueError) as info:
        builds.load(GENERIC_DRAFT).DRAFT_CLASS(checkpoint=f"{MODEL}_mixed", sm=90, selection=Selection(backend="TORCH"))
    assert str(info.value) == f"{MODEL}/generic draft serves speculative_config.mode 'dspark'; pass a selection with that mode"


@pytest.mark.parametrize("missing, message", [
    ("model.draft_stages.1.mlp.experts.3.down_proj.weight_scale",
     "model.draft_stages.1.mlp.experts.3.down_proj.weight_scale: missing from the checkpoint (expected shape (128, 4) uint8)"),
    ("model.draft_stages.0.eh_proj.weight", "missing tensor model.draft_stages.0.eh_proj.weight: the build expects shape (128, 256) float32"),
])
def test_a_checkpoint_missing_a_stage_tensor_is_refused(case, missing, message):
    import json

    from generated import load_model
    from runtime.checkpoint.errors import CheckpointError

    folder, tensors, *_ = case
    assert missing in tensors
    broken = builds.write_checkpoint(builds.tmp_folder(f"{MODEL}-without-{missing}"), {n: t for n, t in tensors.items() if n != missing},
                                     json.loads((folder / "config.json").read_text()))
    with pytest.raises(CheckpointError) as info:
        load_model(MODEL, 90, checkpoint=str(broken), checkpoint_name=f"{MODEL}_mixed", mode="off",
                   moe_config={"backend": "TORCH"}, speculative_config={"mode": "dspark"}, dtype=torch.float32)
    assert str(info.value) == message
