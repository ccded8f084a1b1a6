"""Each rank reads only its own slices of the checkpoint: never a byte that another rank's shard holds, and nothing it does not keep.

The reader is wrapped to record every slice a load asks for (tensor name and index). For
tiny_qwen3_moe's tp4_moetp2ep2 the recorded slices are compared, rank by rank, with an oracle written
here from the layout's rules alone (docs/runtime.md: attention heads chunked by tp rank, two key/value
heads shared by pairs of ranks, experts in contiguous EP blocks, the intermediate dim chunked by MoE-TP
rank). For kimi's tp16_moetp4ep4 on 16 ranks the claims are general: the distinct slices the ranks
read of a tensor partition it (replicas read the same slice, shards disjoint ones), and each rank reads
exactly as many bytes as its build holds. No torch.distributed: loading does not communicate.
"""
from __future__ import annotations

import importlib

import torch

from runtime.checkpoint import CheckpointReader, find_experts_modules
from runtime.parallel import Layout
from tests.parallel import common


class RecordingReader(CheckpointReader):
    """A CheckpointReader that remembers the elements each `read` returned, per tensor, as a boolean mask."""

    def __init__(self, path):
        super().__init__(path)
        self.masks: dict[str, torch.Tensor] = {}
        self.read_bytes = 0

    def read(self, name, index=None):
        value = super().read(name, index)
        mask = self.masks.setdefault(name, torch.zeros(self.info(name).shape, dtype=torch.bool))
        selected = mask[...] if index is None else mask[index]
        assert not selected.any(), f"{name} {index}: read twice"
        if index is None:
            mask[...] = True
        else:
            mask[index] = True
        self.read_bytes += value.numel() * value.element_size()
        return value


def _load_rank(model: str, parallel: str, rank: int, checkpoint: str) -> tuple[RecordingReader, torch.nn.Module]:
    target = f"{common.CHECKPOINT[model]}__sm_{common.SM[model]}__{parallel}"
    module = importlib.import_module(f".{model}.{target}.modeling", "generated")
    build = module.MODEL_CLASS(device="cpu", rank=rank)
    reader = RecordingReader(checkpoint)
    with reader:
        build.load_checkpoint(reader)
    return reader, build


# -- tiny_qwen3_moe tp4_moetp2ep2 against an oracle ---------------------------------------------------

QWEN = Layout(tp=4, moe_tp=2, ep=2)
EXPERTS, INTER, KV_HEADS, HEAD_DIM = 8, 32, 2, 16


def _expected(name: str, shape: tuple[int, ...], rank: int) -> tuple | None:
    """The index rank `rank` must read of tensor `name` under QWEN; None: it must not read it at all."""
    tp, tp_rank = QWEN.tp, QWEN.tp_rank(rank)

    def chunk(n, i, parts):
        return slice(i * n // parts, (i + 1) * n // parts)

    if name.endswith(("embed_tokens.weight", "lm_head.weight", "q_proj.weight")):
        return (chunk(shape[0], tp_rank, tp),)                       # vocabulary rows, query heads
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        # 2 key/value heads on 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
        return (chunk(shape[0], tp_rank // (tp // KV_HEADS), KV_HEADS),)
    if name.endswith("o_proj.weight"):
        return (slice(None), chunk(shape[1], tp_rank, tp))           # input columns of the heads
    if ".mlp.experts." in name:
        expert = int(name.split(".mlp.experts.")[1].split(".")[0])
        ep_rank, moe_tp_rank = QWEN.ep_rank(rank), QWEN.moe_tp_rank(rank)
        if expert // (EXPERTS // QWEN.ep) != ep_rank:
            return None                                              # another EP rank's expert
        inter = chunk(INTER, moe_tp_rank, QWEN.moe_tp)
        return (slice(None), inter) if ".down_proj." in name else (inter,)
    return (slice(None),)                                            # norms, router: every rank, whole


def test_each_rank_reads_exactly_its_own_slices_of_every_tensor(checkpoints):
    path = checkpoints["tiny_qwen3_moe"]
    with CheckpointReader(path) as whole:
        shapes = {name: whole.info(name).shape for name in whole.names()}
    for rank in range(QWEN.world):
        reader, _ = _load_rank("tiny_qwen3_moe", "tp4_moetp2ep2", rank, path)
        for name, shape in shapes.items():
            index = _expected(name, shape, rank)
            got = reader.masks.get(name)
            if index is None:
                assert got is None or not got.any(), f"rank {rank} read {name}, which another EP rank owns"
                continue
            want = torch.zeros(shape, dtype=torch.bool)
            want[index] = True
            assert got is not None, f"rank {rank} never read {name}"
            assert torch.equal(got, want), f"rank {rank} read the wrong slice of {name}: expected {index}"


# -- tiny_kimi_k3 tp16_moetp4ep4: general claims over 16 ranks ----------------------------------------


def _held_bytes(build: torch.nn.Module) -> int:
    """What a rank keeps from the checkpoint: its plain tensors, and its experts' canonical slices."""
    experts = find_experts_modules(build)
    total, seen = 0, set()
    for name, t in list(build.named_parameters()) + list(build.named_buffers()):
        owner, _, local = name.rpartition(".")
        module = build.get_submodule(owner) if owner else build
        if id(t) in seen or any(name.startswith(p + ".") for p in experts) or local in module._non_persistent_buffers_set:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    for module in experts.values():
        per_expert = sum(torch.Size(c.local_shape).numel() * c.dtype.itemsize for c in module.tensors)
        total += per_expert * len(module.expert_ids)
    return total


def test_sixteen_ranks_read_disjoint_or_identical_slices_and_only_what_they_hold(checkpoints):
    path = checkpoints["tiny_kimi_k3"]
    masks = []
    for rank in range(16):
        reader, build = _load_rank("tiny_kimi_k3", "tp16_moetp4ep4", rank, path)
        assert reader.read_bytes == _held_bytes(build), f"rank {rank} read bytes it does not keep"
        masks.append(reader.masks)
    with CheckpointReader(path) as whole:
        names = whole.names()
    for name in names:
        # The distinct slices the ranks read of a tensor must partition it: every element read, and two
        # ranks read either the same slice (replicas) or slices that share no element (shards).
        distinct = {m[name].numpy().tobytes(): m[name] for m in masks if name in m}
        assert distinct, f"no rank read {name}"
        cover = torch.stack(list(distinct.values())).sum(0)
        assert (cover >= 1).all(), f"part of {name} is read by no rank"
        assert (cover <= 1).all(), f"{name}: two ranks read overlapping, different slices"
