"""`load_model(..., num_layers=N)` builds the first N decoder layers of a model's layer plan and reads only their tensors.

Oracle: transformers' own model with `num_hidden_layers=N` (its per-layer lists cut alike) loaded from
the same checkpoint, which holds every layer of the tiny model (N is one fewer: a real cut; DeepSeek-V3's
keeps its dense layer and one MoE layer). Both run in fp32, ours the generic build bound to VANILLA
experts: relative L2 error of the logits <= 1e-5, as tests/generated/test_transformers_parity.py asks of
the whole model. The draft of a cut build still reads its own tensors where they are (the embedded MTP
layer at the full model's index), and its speculative greedy output is the cut target's own greedy output.
"""
from __future__ import annotations

import functools

import torch
import pytest

from generated import load_model, run
from runtime.checkpoint import CheckpointError
from tests.generated import builds

FAMILIES = sorted(builds.TINY)


def _layer_count(model: str) -> int:
    return builds.load(f"generated.{model}.generic.modeling").NUM_TARGET_LAYERS


def _transformers_cut(folder, count: int):
    """transformers' model of `folder` built with its first `count` layers (fp32, reference paths)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = count
    for key in ("layer_types", "layers_block_type"):
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:count])
    return AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cut_build_computes_transformers_logits_of_the_same_cut_in_fp32(family):
    model = builds.TINY[family]
    folder, count = builds.transformers_checkpoint(model), _layer_count(model) - 1
    ours = load_model(model, 90, checkpoint=str(folder), checkpoint_name=builds.bf16_target(model)["checkpoint"],
                      mode="off", moe_config={"backend": "VANILLA"}, dtype=torch.float32, num_layers=count).eval()
    reference = _transformers_cut(folder, count)
    assert len(ours.model.layers) == len(reference.model.layers) == count
    ids = builds.token_ids(builds.facts(model).CONFIG["vocab_size"], batch=2, length=16)
    with torch.no_grad():
        out, expected = ours(ids), reference(ids, use_cache=False).logits
    assert builds.rel_err(out, expected) <= 1e-5


def test_a_cut_build_holds_its_first_layers_and_reads_none_of_the_others():
    target = builds.bf16_target("tiny_deepseek_v3")
    module = builds.load("generated" + target["module"])
    folder = builds.mtp_checkpoint("tiny_deepseek_v3")  # layers 0-2 (0 dense) and the MTP layer 3
    built = module.MODEL_CLASS(num_layers=2)
    report = built.load_checkpoint(folder)
    tensors = builds.read_tensors(folder)
    assert len(built.model.layers) == 2
    assert built.model.layers[0].mlp.__class__ is not built.model.layers[1].mlp.__class__  # dense, then MoE
    assert set(report.ignored) == {n for n in tensors if n.startswith(("model.layers.2.", "model.layers.3."))}
    assert not any(n.startswith("model.layers.2.") for n in built.state_dict())
    assert torch.equal(built.model.layers[1].self_attn.o_proj.weight, tensors["model.layers.1.self_attn.o_proj.weight"])


@pytest.mark.parametrize("mode", ["auto", "off"])
@pytest.mark.parametrize("num_layers, error, message", [
    (0, ValueError, "num_layers takes a number of decoder layers from 1 to 3 ({target} has 3), got 0"),
    (4, ValueError, "num_layers takes a number of decoder layers from 1 to 3 ({target} has 3), got 4"),
    (True, TypeError, "num_layers takes a whole number of decoder layers from 1 to 3, got True"),
    ("2", TypeError, "num_layers takes a whole number of decoder layers from 1 to 3, got '2'"),
    (2.0, TypeError, "num_layers takes a whole number of decoder layers from 1 to 3, got 2.0"),
])
def test_a_bad_layer_count_is_refused_naming_the_range(mode, num_layers, error, message):
    target = "tiny_deepseek_v3_bf16__sm_90__tp1" if mode == "auto" else "tiny_deepseek_v3/generic"
    with pytest.raises(error) as e:
        load_model("tiny_deepseek_v3", 90, checkpoint_name="tiny_deepseek_v3_bf16", mode=mode,
                   moe_config={"backend": "TORCH"}, num_layers=num_layers)
    assert str(e.value) == message.format(target=target)


def test_a_checkpoint_of_fewer_layers_is_refused_naming_the_count_to_pass():
    from transformers import AutoModelForCausalLM

    folder = builds.tmp_folder("num-layers-one-layer")
    hf = AutoModelForCausalLM.from_config(builds.hf_config("tiny_deepseek_v3", num_hidden_layers=1), dtype=torch.bfloat16)
    builds.randomize(hf, seed=3)
    hf.save_pretrained(folder)
    for num_layers, wanted in ((2, 2), (None, 3)):
        with pytest.raises(CheckpointError) as e:
            load_model("tiny_deepseek_v3", 90, checkpoint=str(folder), checkpoint_name="tiny_deepseek_v3_bf16",
                       num_layers=num_layers)
        assert str(e.value) == (f"{folder} holds 1 decoder layer (model.layers.0) but this build has {wanted}: "
                                f"load it with num_layers=1 (or fewer), or a checkpoint of at least {wanted} layers")
    assert len(load_model("tiny_deepseek_v3", 90, checkpoint=str(folder), checkpoint_name="tiny_deepseek_v3_bf16",
                          num_layers=1).model.layers) == 1
    # A build on the meta device checks the folder the same way, from its headers (check_checkpoint).
    build = builds.load("generated.tiny_deepseek_v3.tiny_deepseek_v3_bf16__sm_90__tp1.modeling").MODEL_CLASS
    with pytest.raises(CheckpointError) as e:
        build(device="meta").check_checkpoint(folder)
    assert str(e.value) == (f"{folder} holds 1 decoder layer (model.layers.0) but this build has 3: "
                            "load it with num_layers=1 (or fewer), or a checkpoint of at least 3 layers")
    assert build(device="meta", num_layers=1).check_checkpoint(folder) is None


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_the_embedded_mtp_draft_of_a_cut_build_reads_its_layer_where_it_lives(mode):
    folder = builds.mtp_checkpoint("tiny_deepseek_v3")
    tensors = builds.read_tensors(folder)
    model = load_model("tiny_deepseek_v3", 90, checkpoint=str(folder), checkpoint_name="tiny_deepseek_v3_bf16", mode=mode,
                       moe_config={"backend": "TORCH"}, speculative_config={"mode": "mtp"}, num_layers=2,
                       dtype=torch.float32).eval()
    assert len(model.model.layers) == 2 and model.draft is not None
    block = model.draft.model.layers["3"]
    assert torch.equal(block.eh_proj.weight, tensors["model.layers.3.eh_proj.weight"])
    assert torch.equal(block.shared_head.head.weight, tensors["model.layers.3.shared_head.head.weight"])
    prompt = builds.token_ids(builds.facts("tiny_deepseek_v3").CONFIG["vocab_size"], batch=1, length=5)
    expected = builds.greedy_reference(model, prompt, 8)
    builds.assert_greedy_equal_up_to_ties(model, model.generate(prompt, 8, speculative=3).tokens, expected)


EAGLE3_CUT = ("the eagle3 draft of tiny_qwen3_moe reads the outputs of target layers 0, 0, 1; "
              "num_layers=1 keeps layers 0 to 0: pass num_layers=2 or more")


def test_an_eagle3_draft_reading_a_layer_the_cut_drops_is_refused():
    from registry.errors import SelectionError

    with pytest.raises(SelectionError) as e:
        load_model("tiny_qwen3_moe", 120, speculative_config={"mode": "eagle3"}, num_layers=1)
    assert str(e.value) == EAGLE3_CUT


def test_check_draft_refuses_such_a_draft_from_its_class_without_building_it(monkeypatch, tmp_path):
    from families import FAMILIES
    from registry.errors import SelectionError
    from runtime.checkpoint.writer import random_tensors, save_checkpoint
    from serving.load import Builds

    def built(*args, **kwargs):
        raise AssertionError("the draft was built")

    head = builds.load("generated.tiny_qwen3_moe.tiny_qwen3_moe_bf16__sm_120__tp1.draft").DRAFT_CLASS
    folder = save_checkpoint(random_tensors(head(device="meta").weights(), FAMILIES["qwen3_moe"].experts_storage), tmp_path)
    check = functools.partial(Builds("generated").check_draft, "tiny_qwen3_moe", 120, speculative_config={"mode": "eagle3"},
                              draft_checkpoint=str(folder))
    with monkeypatch.context() as patched:
        patched.setattr(head, "__init__", built)
        with pytest.raises(SelectionError) as e:
            check(num_layers=1)
    assert str(e.value) == EAGLE3_CUT
    # 0 and 3 are out of range: refused by the count's own check (the launcher's --num-layers, the target build's), not
    # here. A count it keeps goes on to the head's folder, checked against the head built on the meta device.
    for num_layers in (None, 2, 0, 3):
        assert check(num_layers=num_layers) is None


@pytest.mark.parametrize("draft_folder", [True, False])
def test_the_launcher_refuses_an_eagle3_draft_reading_a_layer_the_cut_drops_before_any_rank_starts(
        capsys, tmp_path, no_ranks, draft_folder):
    # Without a draft folder too: the ranks would refuse the cut before the missing folder, and so does the launcher.
    own = ["--draft-checkpoint", str(tmp_path)] if draft_folder else []
    args = ["--model", "tiny_qwen3_moe", "--sm", "120", "--tiny", "--generate", "4", "--spec-mode", "eagle3", *own]
    assert run.main([*args, "--num-layers", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"python -m generated.run: error: {EAGLE3_CUT}"


def test_the_launcher_runs_a_cut_build_and_refuses_a_bad_count(capsys, tmp_path):
    args = ["--model", "tiny_deepseek_v3", "--sm", "90", "--checkpoint-name", "tiny_deepseek_v3_bf16", "--tiny"]
    assert run.main([*args, "--num-layers", "4"]) == 2
    assert capsys.readouterr().err.strip() == ("python -m generated.run: error: --num-layers takes a number of decoder "
                                               "layers from 1 to 3 (tiny_deepseek_v3_bf16__sm_90__tp1 has 3), got 4")
    out = tmp_path / "logits.pt"
    assert run.main([*args, "--tiny-dir", str(tmp_path / "ckpt"), "--tokens", "5,6,7,8", "--num-layers", "2",
                     "--logits-out", str(out)]) == 0
    model = load_model("tiny_deepseek_v3", 90, checkpoint=str(tmp_path / "ckpt"), checkpoint_name="tiny_deepseek_v3_bf16",
                       num_layers=2).eval()
    with torch.no_grad():
        expected = model(torch.tensor([[5, 6, 7, 8]])).float()
    assert torch.equal(torch.load(out)["logits"], expected)
