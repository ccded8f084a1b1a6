"""`load_model(checkpoint=...)` refuses a checkpoint whose config.json describes another model than the build's (a fine-tune's rope_theta, norm epsilon or expert count), naming the key and both values, before any weight is read; the forms that build the same model load (transformers' spelled-out defaults, reduced-layer checkpoints, Nemotron-H's `time_step_limit` [0, inf]). An external drafter's own folder (`draft_checkpoint=`) is compared with the drafter's declared config the same way; an Eagle3 head's is not (its config is no family's)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import generated
from generated import run
from runtime.checkpoint import CheckpointConfigError, CheckpointError
from runtime.checkpoint.writer import save_checkpoint
from tests.generated import builds

ADVICE = "declare a model for this checkpoint (python -m codegen import-checkpoint {folder} --name NAME) and generate its builds"


def _transformers_checkpoint(name: str, model: str, **overrides):
    """A bf16 checkpoint of `model` with `overrides` in its config, saved by transformers (`save_pretrained`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(builds.hf_config(model, **overrides), dtype=torch.bfloat16)
    builds.randomize(hf, 0)
    folder = builds.tmp_folder(name)
    hf.save_pretrained(folder)
    return folder


def _tiny_checkpoint(name: str, model: str, checkpoint: str, config: dict):
    """The builds' own seeded random tensors of `model` (`generated.run --tiny`), saved by the project's writer
    beside `config` as config.json."""
    tiny = builds.tmp_folder(f"{name}-tiny")
    run.write_tiny(model, 90, checkpoint, tiny, 0)
    return save_checkpoint(builds.read_tensors(tiny), builds.tmp_folder(name), config)


def _refusal(folder, said: str) -> str:
    return (f"{folder}/config.json describes another model than the one tiny_qwen3_moe's builds were generated from: "
            f"{said}. Loaded, it would compute another model's logits: " + ADVICE.format(folder=folder))


def test_a_finetune_with_another_rope_theta_is_refused_naming_the_key_and_both_values():
    folder = _transformers_checkpoint("cfg-rope-theta", "tiny_qwen3_moe", rope_theta=500000.0)
    with pytest.raises(CheckpointConfigError) as refused:
        generated.load_model("tiny_qwen3_moe", 90, checkpoint=str(folder))
    assert str(refused.value) == _refusal(folder, "config.rope_theta is 500000.0 in the checkpoint, 1000000.0 in the build")


def test_a_checkpoint_with_another_norm_epsilon_is_refused_and_the_error_is_a_checkpoint_error():
    facts = builds.facts("tiny_qwen3_moe")
    folder = _tiny_checkpoint("cfg-eps", "tiny_qwen3_moe", "tiny_qwen3_moe_bf16", facts.CONFIG | {"rms_norm_eps": 1e-5})
    with pytest.raises(CheckpointError) as refused:
        generated.load_model("tiny_qwen3_moe", 90, checkpoint=str(folder))
    assert str(refused.value) == _refusal(folder, "config.rms_norm_eps is 1e-05 in the checkpoint, 1e-06 in the build")


def test_a_checkpoint_with_more_experts_is_refused_by_its_config_not_by_a_tensor_shape():
    folder = _transformers_checkpoint("cfg-experts", "tiny_qwen3_moe", num_experts=16)
    with pytest.raises(CheckpointConfigError) as refused:
        generated.load_model("tiny_qwen3_moe", 90, checkpoint=str(folder))
    assert str(refused.value) == _refusal(folder, "config.num_experts is 16 in the checkpoint, 8 in the build")


def test_the_launcher_refuses_such_a_checkpoint_before_any_rank_starts(capsys):
    folder = _transformers_checkpoint("cfg-rope-theta-cli", "tiny_qwen3_moe", rope_theta=500000.0)
    capsys.readouterr()  # transformers' progress bar while saving
    code = run.main(["--model", "tiny_qwen3_moe", "--sm", "90", "--checkpoint", str(folder)])
    assert code == 2
    assert capsys.readouterr().err.strip() == "python -m generated.run: error: " + _refusal(
        folder, "config.rope_theta is 500000.0 in the checkpoint, 1000000.0 in the build")


def test_a_mamba_step_bound_the_build_does_not_run_is_refused():
    facts = builds.facts("tiny_nemotron_h")
    name = builds.bf16_target("tiny_nemotron_h")["checkpoint"]
    folder = _tiny_checkpoint("cfg-bounded", "tiny_nemotron_h", name, facts.CONFIG | {"time_step_limit": [0.0, 0.1]})
    with pytest.raises(CheckpointConfigError) as refused:
        generated.load_model("tiny_nemotron_h", 90, checkpoint=str(folder), checkpoint_name=name)
    assert str(refused.value) == (
        f"{folder}/config.json describes another model than the one tiny_nemotron_h's builds were generated from: "
        "config.time_step_limit is [0.0, 0.1] in the checkpoint, [0, inf] in the build. Loaded, it would compute another "
        "model's logits: " + ADVICE.format(folder=folder))


@pytest.mark.parametrize("limit", [None, [0, {"__float__": "Infinity"}], [0.0, float("inf")]])
def test_a_nemotron_h_step_limit_absent_or_spelled_unbounded_loads(limit):
    facts = builds.facts("tiny_nemotron_h")
    name = builds.bf16_target("tiny_nemotron_h")["checkpoint"]
    config = {k: v for k, v in facts.CONFIG.items() if k != "time_step_limit"} | ({} if limit is None else {"time_step_limit": limit})
    folder = _tiny_checkpoint(f"cfg-unbounded-{len(str(limit))}", "tiny_nemotron_h", name, config)
    generated.load_model("tiny_nemotron_h", 90, checkpoint=str(folder), checkpoint_name=name)


@pytest.mark.parametrize("model", ["tiny_deepseek_v3", "tiny_qwen3_next"])
def test_defaults_transformers_spells_out_that_the_build_does_not_read_load(model):
    # transformers writes DeepSeek-V3's head_dim and Qwen3-Next's dense intermediate_size, which neither build reads.
    folder = builds.transformers_checkpoint(model)
    written = json.loads((folder / "config.json").read_text())
    assert "head_dim" in written if model == "tiny_deepseek_v3" else "intermediate_size" in written
    generated.load_model(model, 90, checkpoint=str(folder))


def _first_layers(model: str, count: int) -> dict:
    """The config overrides of `model` cut to its first `count` decoder layers, per-layer lists alike."""
    config = builds.facts(model).CONFIG
    cut = {k: v[:count] for k, v in config.items() if isinstance(v, (list, str)) and len(v) == config["num_hidden_layers"]}
    return cut | {"num_hidden_layers": count}


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_gpt_oss", "tiny_nemotron_h"])
def test_a_checkpoint_of_the_first_layers_loads_into_as_many_layers(model):
    # As bench/build.py saves a large model's first layers: config.json and its per-layer lists say that many.
    count = builds.load(f"generated.{model}.generic.modeling").NUM_TARGET_LAYERS - 1
    folder = _transformers_checkpoint(f"cfg-first-layers-{model}", model, **_first_layers(model, count))
    built = generated.load_model(model, 90, checkpoint=str(folder), checkpoint_name=builds.bf16_target(model)["checkpoint"],
                                 mode="off", moe_config={"backend": "VANILLA"}, num_layers=count)
    assert len(built.model.layers) == count


def test_a_checkpoint_of_a_deeper_model_is_refused():
    deeper = _transformers_checkpoint("cfg-three-layers", "tiny_qwen3_moe", num_hidden_layers=3)
    with pytest.raises(CheckpointConfigError) as refused:
        generated.load_model("tiny_qwen3_moe", 90, checkpoint=str(deeper), num_layers=1)
    assert str(refused.value) == _refusal(deeper, "config.num_hidden_layers is 3 in the checkpoint, 2 in the build")


# -- an external drafter's own folder (`draft_checkpoint=`), compared with the drafter's declared config -------------

DRAFTER = "tiny_kimi_k3_drafter"
DRAFT_ADVICE = ("pass a checkpoint of the declared drafter (draft_checkpoint=DIR, --draft-checkpoint DIR), or declare this "
                f"folder's config as the config of tiny_kimi_k3's [[drafts]] entry {DRAFTER} and generate its builds")


@pytest.fixture(scope="module")
def kimi_target():
    """tiny_kimi_k3's sm_90 target (the build that holds its external Qwen3-MoE drafter) with seeded random tensors."""
    return run.write_tiny("tiny_kimi_k3", 90, "tiny_kimi_k3_mxfp4", builds.tmp_folder("cfg-kimi-target"), 0)


def _drafter_checkpoint(name: str, **overrides):
    """tiny_kimi_k3's drafter as declared, `overrides` in its config, saved by transformers (`save_pretrained`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    drafter = next(d for d in builds.declarations()["tiny_kimi_k3"].drafts if d.name == DRAFTER)
    config = {k: v for k, v in drafter.config.items() if k != "architectures"} | overrides
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **config), dtype=torch.bfloat16)
    builds.randomize(hf, 0)
    folder = builds.tmp_folder(name)
    hf.save_pretrained(folder)
    return folder


def _load_with_drafter(target, drafter):
    return generated.load_model("tiny_kimi_k3", 90, checkpoint=str(target), checkpoint_name="tiny_kimi_k3_mxfp4",
                                speculative_config={"mode": "draft_target"}, draft_checkpoint=str(drafter), dtype=torch.float32)


@pytest.mark.parametrize("overrides, said", [
    ({"rope_theta": 500000.0}, "config.rope_theta is 500000.0 in the checkpoint, 1000000.0 in the build"),
    ({"num_experts": 16}, "config.num_experts is 16 in the checkpoint, 8 in the build"),
    ({"num_hidden_layers": 3}, "config.num_hidden_layers is 3 in the checkpoint, 2 in the build"),
])
def test_a_drafter_folder_of_another_model_is_refused_naming_the_draft(kimi_target, overrides, said):
    # rope_theta: the same tensor shapes, so nothing else would notice; the experts and the layers: refused by the
    # config, not by a tensor shape or a layer count.
    folder = _drafter_checkpoint(f"cfg-drafter-{next(iter(overrides))}", **overrides)
    with pytest.raises(CheckpointConfigError) as refused:
        _load_with_drafter(kimi_target, folder)
    assert str(refused.value) == (
        f"{folder}/config.json describes another model than the draft {DRAFTER} of tiny_kimi_k3: {said}. Loaded, it "
        "would compute another model's logits: " + DRAFT_ADVICE)


def test_the_declared_drafters_folder_loads_and_so_does_one_without_config_json(kimi_target):
    folder = _drafter_checkpoint("cfg-drafter-same")
    bare = builds.tmp_folder("cfg-drafter-bare")
    bare.mkdir()
    for file in folder.glob("*.safetensors"):
        shutil.copy(file, bare)
    for drafter in (folder, bare):
        built = _load_with_drafter(kimi_target, drafter)
        # The draft holds the folder's tensors (not random ones).
        assert torch.equal(built.draft.model.lm_head.weight, builds.read_tensors(folder)["lm_head.weight"].float())


def test_an_eagle3_heads_folder_is_not_compared():
    # Its config.json is the head's own (a Llama layer and two vocabularies), no family's: nothing to compare it with.
    from runtime.checkpoint.writer import random_tensors

    module = builds.load("generated.tiny_qwen3_moe.tiny_qwen3_moe_bf16__sm_120__tp1.draft")
    config = {"architectures": ["LlamaForCausalLMEagle3"]} | builds.facts("tiny_qwen3_moe").DRAFT_CONFIGS["tiny_qwen3_moe_eagle3"]
    tensors = random_tensors(module.DRAFT_CLASS(device="meta").weights(), "gate_up_down", 0)
    folder = save_checkpoint(tensors, builds.tmp_folder("cfg-eagle3-head"), config)
    built = generated.load_model("tiny_qwen3_moe", 120, speculative_config={"mode": "eagle3"}, draft_checkpoint=str(folder),
                                 dtype=torch.float32)
    assert type(built.draft) is module.DRAFT_CLASS
    assert torch.equal(built.draft.weights().lm_head.weight, tensors["lm_head.weight"].float())
