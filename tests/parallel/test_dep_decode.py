"""A dep<N> decode step moves fixed blocks of its bucket's rows (runtime/ops/moe.py), so it can be captured:
on gloo ranks it reads nothing back to the host (nor do the tp2 and tp2_moetp1ep2 steps), its steps
reproduce the one-process logits, and more tokens than its capacity, or ranks that chose different
buckets, are refused with one message.

"Reads nothing back" is checked by making every Python-level host read of a tensor (`.item()`,
`.tolist()`, `.cpu()`, `.numpy()`, `bool()`, `int()`, `float()`) raise while the steps run: the
variable exchange that prefill uses reads its counts with `.tolist()`, so a step that took it fails.
On a GPU the same step is captured in a CUDA graph (tests/gpu/test_dep_decode_graph.py).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import generated
from generated import run
from runtime import parallel
from runtime.ops import MoEBlock
from runtime.parallel import CapacityError, Layout
from runtime.processes import launch
from tests.parallel import common
from tests.parallel.test_ep_all_to_all import COUNTS, H, _block, _tokens

MODEL = "tiny_qwen3_moe"
TOKENS = torch.randint(0, 512, (4, 10), generator=torch.Generator().manual_seed(7))
PREFILL = 6          # prompt tokens each row prefills; the remaining 4 are decode steps
# The dep2 step is the one that used to read counts back; the two TP layouts are checked alongside.
LAYOUTS = ("tp2", "tp2_moetp1ep2", "dep2")
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def no_host_reads():
    """Every Python-level read of a tensor's values into the host raises inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a tensor back to the host inside a decode step")
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _build(parallel_name: str, fp32: bool, checkpoint: str, rank: int, device: str):
    load = common.load_fp32_reference if fp32 else generated.load_model
    mode = "off" if fp32 else "require"
    return load(MODEL, common.SM[MODEL], parallel_name, checkpoint=checkpoint,
                checkpoint_name=common.CHECKPOINT[MODEL], device=device, mode=mode, rank=rank).eval()


def _decode_rank(rank: int, world: int, device: str, checkpoint: str) -> dict:
    """Each replica prefills its rows, then decodes the rest one step at a time with no host read."""
    out = {}
    for name in LAYOUTS:
        for fp32 in (True, False):
            model = _build(name, fp32, checkpoint, rank, device)
            rows = TOKENS.chunk(model.layout.dp)[model.layout.dp_rank(rank)]
            decoder = model.decoder(rows.shape[0], TOKENS.shape[1])
            decoder.prefill(rows[:, :PREFILL])
            steps = []
            with no_host_reads():
                for t in range(PREFILL, TOKENS.shape[1]):
                    steps.append(decoder.step(rows[:, t]).clone())
            out[name, fp32] = parallel.all_gather(torch.stack(steps, dim=1), dim=0, group=parallel.DP).float()
    # The last build is dep2's specialized one. Rank 0 asks for a bucket of 2 rows, rank 1 of 1: both must
    # refuse (and neither hang).
    try:
        model.decoder(2 if rank == 0 else 1, TOKENS.shape[1])
        out["mismatch"] = None
    except CapacityError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.slow
def test_decode_steps_of_every_two_rank_layout_read_nothing_back_and_reproduce_the_one_process_logits(checkpoints):
    results = launch(_decode_rank, 2, (checkpoints[MODEL],), timeout_s=60, job_timeout_s=400, preload=run.PRELOAD)
    build = "TinyQwen3MoeBf16Sm90Dep2ForCausalLM"
    for rank, result in enumerate(results):
        assert result["mismatch"] == (
            f"{build}: the ranks decode batch buckets of 2, 1 rows (in rank order); the MoE exchange moves "
            "fixed blocks of one bucket's rows per rank, so every data-parallel replica must decode the same "
            "bucket: give each replica the same number of rows"), rank
    problems = []
    for fp32 in (False, True):
        ref = common.reference_logits(MODEL, checkpoints[MODEL], fp32, tokens=TOKENS)[:, PREFILL:]
        for name in LAYOUTS:
            for rank, result in enumerate(results):
                got = result[name, fp32]
                assert got.shape == ref.shape, (name, fp32, rank)
                errors = common.position_errors(got, ref)
                what = f"{name} {'fp32 VANILLA' if fp32 else 'bf16'} rank {rank}"
                if fp32 and not errors.max() < common.FP32_TOL:
                    problems.append(f"{what}: max relative error {errors.max():.3g}")
                within = float((errors < common.BF16_TOL).float().mean())
                if not fp32 and (within < common.BF16_WITHIN or not errors.max() < common.BF16_FLIP_TOL):
                    problems.append(f"{what}: {within:.0%} within {common.BF16_TOL}, max {errors.max():.3g}")
    assert not problems, "\n".join(problems)


def _fixed_rank(rank: int, world: int, device: str) -> torch.Tensor:
    """The MoE block alone under a capacity of 5 tokens: rank 0 holds 3 of them (padded), rank 1 all 5."""
    layout = Layout(tp=1, moe_tp=1, ep=world, dp=world)
    start = sum(COUNTS[:rank])
    block = _block(layout, rank)
    with torch.no_grad(), parallel.token_capacity(max(COUNTS)), no_host_reads():
        return block(_tokens()[start:start + COUNTS[rank]])


@pytest.mark.slow
def test_the_fixed_exchange_pads_a_rank_below_capacity_and_reproduces_the_single_process_layer():
    with torch.no_grad():
        whole = _block(Layout(), 0)(_tokens())
    got = torch.cat(launch(_fixed_rank, 2, device="cpu", timeout_s=60))
    assert got.shape == whole.shape
    assert torch.allclose(got, whole, rtol=1e-5, atol=1e-6)


def test_more_tokens_than_the_capacity_are_refused_before_any_collective():
    # No torch.distributed here: the refusal must come from the shape, before the exchange starts.
    block: MoEBlock = _block(Layout(tp=1, moe_tp=1, ep=2, dp=2), 0)
    with torch.no_grad(), parallel.token_capacity(2), pytest.raises(CapacityError) as refused:
        block(torch.randn(3, H))
    assert str(refused.value) == (
        "MoE exchange: 3 tokens on this rank exceed the capacity of 2 tokens per rank of this decode step "
        "(its batch bucket); decode them in a bucket of at least 3 rows")


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_capacity_is_a_positive_int(bad):
    with pytest.raises(ValueError) as refused, parallel.token_capacity(bad):
        pass
    assert str(refused.value) == f"a token capacity is a positive int, got {bad!r}"
