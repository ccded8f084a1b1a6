"""The shared experts contract: class identity, meta-device construction, validated all-or-nothing
loading, and MoE TP / EP slicing (the shards of a layer sum to the whole layer).

Tolerances (relative, see helpers_experts.assert_rel_close), fp32 hidden: VANILLA shards 1e-5 (fp32
summation order); TORCH shards RMS 5e-3 / max 1e-2, because each shard rounds its bf16 GEMM output.
"""
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from runtime.experts.base import (DictExpertSource, ExpertParallel, MoeShape, WeightLoadError,
                                  canonical_tensors)
from runtime.experts.torch_grouped import TorchGroupedMmBf16Experts
from runtime.experts.vanilla import (TorchEagerBf16Experts, TorchEagerFp8BlockScalesExperts,
                                     TorchEagerW4a16Mxfp4Experts)
from runtime.formats import RUN_FORMATS

from .helpers_experts import assert_rel_close, make_expert_tensors, random_hidden, random_routing, registry_classes

ALL_EXPERTS = registry_classes()
VANILLA_EXPERTS, TORCH_EXPERTS = registry_classes("VANILLA"), registry_classes("TORCH")
VANILLA = {cls.FORMAT: cls for cls in VANILLA_EXPERTS}
TORCH = {cls.FORMAT: cls for cls in TORCH_EXPERTS}


def _camel(segment):
    return "".join(part.capitalize() for part in segment.split("_"))


def test_every_class_has_a_unique_id_naming_its_format_and_class():
    ids = [cls.IMPL_ID for cls in ALL_EXPERTS]
    assert len(set(ids)) == len(ids)
    for cls in ALL_EXPERTS:
        provider, technique, kernel, quant = cls.IMPL_ID.split(".")
        assert cls.FORMAT == quant and quant in RUN_FORMATS
        assert all(re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", s) for s in (provider, technique, kernel, quant))
        assert cls.__name__ == f"{_camel(provider)}{_camel(technique)}{_camel(quant)}Experts"
    # VANILLA is the reference of every run format, one class each.
    assert sorted(cls.FORMAT for cls in VANILLA_EXPERTS) == sorted(RUN_FORMATS)
    # TORCH publishes the formats whose activations it computes faithfully (bf16, or FP8 1x128 groups
    # quantized-dequantized), never a W4A8 or W4A4 run format, one class each.
    assert sorted(cls.FORMAT for cls in TORCH_EXPERTS) == sorted(f for f in RUN_FORMATS if not f.startswith("w4a8") and f != "nvfp4")


# --- meta device -------------------------------------------------------------------------------------

class _NonMetaOps(TorchDispatchMode):
    """Records every op that produces a tensor off the meta device."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in tree_leaves(out)):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("cls", ALL_EXPERTS, ids=lambda c: c.IMPL_ID)
def test_meta_construction_allocates_and_computes_nothing(cls):
    # DeepSeek-V3-sized layer: tens of GB if anything were materialized
    spec = MoeShape(7168, 2048, 256, 8, "silu_glu")
    with _NonMetaOps() as record:
        module = cls(spec, ExpertParallel(moe_tp_size=2, moe_tp_rank=1, ep_size=2, ep_rank=0), device="meta")
    assert record.ops == []
    buffers = list(module.buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers)
    with pytest.raises(RuntimeError, match="lives on the meta device"):
        module.load_weights(DictExpertSource({}))


@pytest.mark.parametrize("cls", [TorchEagerFp8BlockScalesExperts, TorchGroupedMmBf16Experts],
                         ids=lambda c: c.IMPL_ID)
def test_meta_then_materialize_then_load_equals_direct_build(cls):
    spec = MoeShape(200 if cls.FORMAT != "bf16" else 40, 136 if cls.FORMAT != "bf16" else 24, 4, 2, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=61)
    module = cls(spec, device="meta").to_empty(device="cpu")
    module.load_weights(DictExpertSource(tensors))
    direct = cls.from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))
    ids, weights = random_routing(10, spec, seed=62)
    hidden = random_hidden(10, spec, seed=63)
    assert torch.equal(module(hidden, ids, weights), direct(hidden, ids, weights))


# --- loading ----------------------------------------------------------------------------------------

LOAD_SPEC = MoeShape(256, 136, 4, 2, "silu_glu")
PREFIX = "model.layers.3.mlp.experts"


def _snapshot(module):
    return {name: buf.clone() for name, buf in module.named_buffers()}


@pytest.mark.parametrize("cls", [TorchEagerFp8BlockScalesExperts, TorchGroupedMmBf16Experts],
                         ids=lambda c: c.IMPL_ID)
def test_failed_load_names_the_tensor_and_changes_nothing(cls):
    spec = LOAD_SPEC
    module = cls.from_checkpoint(spec, ExpertParallel(), DictExpertSource(make_expert_tensors(spec, cls.FORMAT, 71)))
    before = _snapshot(module)
    # a different, otherwise valid checkpoint whose LAST tensor is bad: a loader that copies as it
    # goes would have overwritten everything before it
    fresh = make_expert_tensors(spec, cls.FORMAT, 72)
    last = (3, "down", "weight")
    good = fresh[last]
    weight_dtype = str(good.dtype).removeprefix("torch.")
    cases = [
        (good[:, :100], f"{PREFIX}.3.down_proj.weight: expected shape (256, 136) {weight_dtype}, "
                        f"found (256, 100) {weight_dtype}"),
        (torch.ones(good.shape, dtype=torch.int16), f"{PREFIX}.3.down_proj.weight: expected shape (256, 136) "
                                                    f"{weight_dtype}, found (256, 136) int16"),
        (None, f"{PREFIX}.3.down_proj.weight: missing from the checkpoint (expected shape (256, 136) "
               f"{weight_dtype})"),
    ]
    for bad, message in cases:
        tensors = dict(fresh)
        if bad is None:
            del tensors[last]
        else:
            tensors[last] = bad
        with pytest.raises(WeightLoadError) as err:
            module.load_weights(DictExpertSource(tensors, prefix=PREFIX))
        assert str(err.value) == message
        assert isinstance(err.value, ValueError)
        after = _snapshot(module)
        assert all(torch.equal(after[name], before[name]) for name in before)
    module.load_weights(DictExpertSource(fresh, prefix=PREFIX))
    assert not all(torch.equal(buf, before[name]) for name, buf in module.named_buffers())


def test_load_error_lists_every_bad_tensor():
    spec = LOAD_SPEC
    tensors = make_expert_tensors(spec, "fp8_block_scales", 73)
    tensors[0, "gate", "weight_scale_inv"] = tensors[0, "gate", "weight_scale_inv"].double()
    del tensors[2, "up", "weight"]
    module = TorchEagerFp8BlockScalesExperts(spec)
    with pytest.raises(WeightLoadError) as err:
        module.load_weights(DictExpertSource(tensors, prefix=PREFIX))
    assert str(err.value) == (
        f"{PREFIX}.0.gate_proj.weight_scale_inv: expected shape (2, 2) float32, found (2, 2) float64\n"
        f"{PREFIX}.2.up_proj.weight: missing from the checkpoint (expected shape (136, 256) float8_e4m3fn)")


def test_canonical_tensor_table_of_each_format():
    spec = MoeShape(64, 96, 2, 1, "swiglu_oai", expert_bias=True)
    table = lambda fmt: {(t.proj, t.kind): (t.shape, t.dtype) for t in canonical_tensors(spec, fmt)}   # noqa
    assert table("w4a8_mxfp4_mxfp8") == {
        ("gate", "weight"): ((96, 32), torch.uint8), ("gate", "weight_scale"): ((96, 2), torch.uint8),
        ("gate", "bias"): ((96,), torch.bfloat16),
        ("up", "weight"): ((96, 32), torch.uint8), ("up", "weight_scale"): ((96, 2), torch.uint8),
        ("up", "bias"): ((96,), torch.bfloat16),
        ("down", "weight"): ((64, 48), torch.uint8), ("down", "weight_scale"): ((64, 3), torch.uint8),
        ("down", "bias"): ((64,), torch.bfloat16)}
    nv = table("nvfp4")
    assert nv["down", "weight_scale"] == ((64, 6), torch.float8_e4m3fn)
    assert nv["up", "weight_scale_2"] == ((), torch.float32) and nv["up", "input_scale"] == ((), torch.float32)
    assert ("up", "input_scale") not in table("w4a16_nvfp4")
    assert table("fp8_block_scales")["down", "weight_scale_inv"] == ((1, 1), torch.float32)
    relu = MoeShape(64, 96, 2, 1, "relu2")
    assert {t.proj for t in canonical_tensors(relu, "bf16")} == {"up", "down"}


def test_size_and_parallel_validation_messages():
    with pytest.raises(ValueError) as err:
        TorchEagerW4a16Mxfp4Experts(MoeShape(48, 64, 4, 2, "silu_glu"), device="meta")
    assert str(err.value) == ("torch.eager.loop.w4a16_mxfp4: hidden_size 48 is not a multiple of 32 "
                              "(w4a16_mxfp4 scale or kernel layout)")
    with pytest.raises(ValueError) as err:
        TorchEagerFp8BlockScalesExperts(MoeShape(256, 384, 4, 2, "silu_glu"),
                                        ExpertParallel(moe_tp_size=2), device="meta")
    assert str(err.value) == ("torch.eager.loop.fp8_block_scales: the MoE-TP shard of 192 intermediate "
                              "channels is not a multiple of 128 (fp8_block_scales scale or kernel layout)")
    with pytest.raises(ValueError) as err:
        ExpertParallel(ep_size=2, ep_rank=2)
    assert str(err.value) == "ExpertParallel: ep_rank=2 must lie in 0..1 (ep_size=2)"
    with pytest.raises(ValueError) as err:
        TorchEagerBf16Experts(MoeShape(32, 16, 5, 2, "silu_glu"), ExpertParallel(ep_size=2), device="meta")
    assert str(err.value) == ("5 experts do not split into 2 equal contiguous blocks; "
                              "give ExpertParallel.expert_owner")
    with pytest.raises(ValueError) as err:
        MoeShape(32, 16, 4, 2, "gelu")
    assert str(err.value) == "unknown expert activation 'gelu'; known: silu_glu, swiglu_oai, relu2"


# --- MoE TP and EP ----------------------------------------------------------------------------------

TP_CASES = [
    (VANILLA["bf16"], MoeShape(40, 48, 5, 2, "swiglu_oai", expert_bias=True), 2),   # down bias added once
    (VANILLA["fp8_block_scales"], MoeShape(200, 256, 4, 2, "silu_glu"), 2),
    (VANILLA["w4a8_mxfp4_mxfp8"], MoeShape(64, 128, 4, 2, "relu2"), 4),
    (VANILLA["nvfp4"], MoeShape(48, 64, 4, 2, "silu_glu"), 4),
    (TORCH["bf16"], MoeShape(40, 48, 5, 2, "swiglu_oai", expert_bias=True), 2),
    (TORCH["w4a16_mxfp4"], MoeShape(64, 128, 4, 2, "silu_glu"), 2),
]


@pytest.mark.parametrize("cls,spec,tp", TP_CASES, ids=lambda v: getattr(v, "IMPL_ID", None))
def test_moe_tp_shards_sum_to_the_whole(cls, spec, tp):
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=81)
    ids, weights = random_routing(21, spec, seed=82)
    hidden = random_hidden(21, spec, seed=83, dtype=torch.float32)
    whole = cls.from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))(hidden, ids, weights)
    shards = [cls.from_checkpoint(spec, ExpertParallel(moe_tp_size=tp, moe_tp_rank=r), DictExpertSource(tensors))
              for r in range(tp)]
    assert all(s.inter_size == spec.intermediate_size // tp for s in shards)
    total = sum(s(hidden, ids, weights) for s in shards)
    if cls in TORCH_EXPERTS:
        assert_rel_close(total, whole, 5e-3, 1e-2)
    else:
        assert_rel_close(total, whole, 1e-5, 1e-5)


EP_CASES = [
    (ExpertParallel(ep_size=2, ep_rank=0), ExpertParallel(ep_size=2, ep_rank=1)),
    # an uneven owner map in which rank 1 owns no expert at all
    tuple(ExpertParallel(ep_size=3, ep_rank=r, expert_owner=(0, 0, 2, 2, 0, 2)) for r in range(3)),
]


@pytest.mark.parametrize("cls", [VANILLA["w4a16_nvfp4"], TORCH["w4a16_nvfp4"], VANILLA["bf16"], TORCH["bf16"]],
                         ids=lambda c: c.IMPL_ID)
@pytest.mark.parametrize("ranks", EP_CASES, ids=["contiguous", "owner_map"])
def test_ep_ranks_sum_to_the_whole(cls, ranks):
    spec = MoeShape(48, 32, 6, 3, "silu_glu")
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=91)
    ids, weights = random_routing(25, spec, seed=92)
    hidden = random_hidden(25, spec, seed=93, dtype=torch.float32)
    whole = cls.from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))(hidden, ids, weights)
    # each rank reads only its own experts
    parts = []
    for parallel in ranks:
        owned = parallel.local_experts(spec.num_experts)
        mine = {k: v for k, v in tensors.items() if k[0] in owned}
        module = cls.from_checkpoint(spec, parallel, DictExpertSource(mine))
        assert module.expert_ids == owned
        parts.append(module(hidden, ids, weights))
    assert_rel_close(sum(parts), whole, 1e-6, 1e-6)
    if len(ranks) == 3:
        assert torch.equal(parts[1], torch.zeros_like(parts[1]))
