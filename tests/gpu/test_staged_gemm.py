"""The staged decode GEMM of the W4A16 CUPY classes (moe_kernels.cu `moe_gemm_staged_impl`: a producer warp copies
weights, scales and token rows into shared-memory stages ahead of four consumer warps) on an sm_90 GPU.

It runs the register GEMM's chunk math in the same K order, so on the same tile its output is the register
kernel's bit for bit (the register path forced to the same warp tile without split K), and both are VANILLA's
within the bf16-activation bounds of test_cupy_experts (RMS 4e-3, max 2^-6). Every run draws fresh random weights,
inputs and routing and poisons workspaces and output with NaN. K of 320 and 192 (5 and 3 chunks) and 2880 (45)
leave a partial last stage for every compiled stage size; 37 and 80 tokens give experts several token tiles;
every token on three experts gives hot experts and empty ones; EP ranks skip other ranks' experts.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from runtime import kernels as K
from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from tests.gpu.helpers_graphs import assert_graph_replay_matches_eager
from tests.runtime.helpers_experts import (assert_rel_close, make_expert_tensors, random_hidden, random_routing,
                                          registry_classes)

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

STAGED = [cls for cls in registry_classes("CUPY") if cls.FORMAT in K.STAGED]
VANILLA = {cls.FORMAT: cls for cls in registry_classes("VANILLA")}
CONFIGS = sorted({cfg for configs in K.STAGED.values() for cfg in configs})


def _module(cls, spec, tensors, parallel=ExpertParallel()):
    module = cls(spec, parallel, device="meta").to_empty(device="cuda")
    module.load_weights(DictExpertSource({k: v for k, v in tensors.items() if k[0] in module.expert_ids}))
    module.debug_poison = True
    return module


def _staged_and_register(module, hidden, ids, weights, nt, kc, st):
    """The call on the staged GEMMs of tile (1, nt) with (kc, st) stages, and on the register GEMMs of that tile."""
    args = (hidden.cuda(), ids.cuda(), weights.cuda())
    staged = module(*args, path="staged", tile=(1, nt), staging=(kc, st))
    epi1 = K.EPI_GATED if module.spec.gated else K.EPI_RELU2
    assert module.last_gemm_kernels == {"gemm1": K.gemm_name(module.FORMAT, epi1, (1, nt), staging=(kc, st)),
                                        "gemm2": K.gemm_name(module.FORMAT, K.EPI_DOWN, (1, nt), staging=(kc, st))}
    register = module(*args, path="kernels", tile=(1, nt, 1))
    torch.cuda.synchronize()
    return staged, register


def test_every_w4a16_format_has_staged_kernels():
    assert {cls.FORMAT for cls in STAGED} == {"w4a16_mxfp4", "w4a16_nvfp4"}


@pytest.mark.parametrize("nt, kc, st", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("activation", ["silu_glu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("cls", STAGED, ids=lambda c: c.FORMAT)
def test_staged_gemm_gives_the_register_kernels_bits_and_vanillas_values(cls, activation, nt, kc, st):
    bias = activation == "swiglu_oai"
    spec = MoeShape(320, 192, 8, 3, activation, expert_bias=bias)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=zlib.crc32(f"{cls.FORMAT}{activation}{nt}{kc}{st}".encode()) % 997,
                                  weight_std=3.0 if bias else 1.0)
    module = _module(cls, spec, tensors)
    vanilla = VANILLA[cls.FORMAT].from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))
    for tokens, experts in ((2, None), (5, None), (37, None), (80, None), (40, [1, 4, 6])):
        seed = 11 * tokens + kc + st
        ids, weights = random_routing(tokens, spec, seed=seed, experts=experts)
        hidden = random_hidden(tokens, spec, seed=seed + 1)
        staged, register = _staged_and_register(module, hidden, ids, weights, nt, kc, st)
        case = f"{cls.FORMAT} {activation} tokens={tokens} experts={experts} staging={(nt, kc, st)}"
        assert not staged.isnan().any(), case
        assert torch.equal(staged.view(torch.int16), register.view(torch.int16)), case
        try:
            assert_rel_close(staged.cpu(), vanilla(hidden, ids, weights), 4e-3, 2.0 ** -6)
        except AssertionError as err:
            raise AssertionError(f"{case}: {err}") from None


@pytest.mark.parametrize("cls", STAGED, ids=lambda c: c.FORMAT)
def test_staged_gemm_at_gpt_oss_shapes_and_on_ep_ranks(cls):
    """K = 2880 (45 chunks) with gpt-oss's activation and biases, fewer experts; then each of two EP ranks (the
    other rank's experts skipped in the sort) against the register kernel."""
    spec = MoeShape(2880, 2880, 8, 4, "swiglu_oai", expert_bias=True)
    tensors = make_expert_tensors(spec, cls.FORMAT, seed=31, weight_std=3.0)
    vanilla = VANILLA[cls.FORMAT].from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))
    whole = _module(cls, spec, tensors)
    for tokens in (8, 70):
        ids, weights = random_routing(tokens, spec, seed=32 + tokens)
        hidden = random_hidden(tokens, spec, seed=33 + tokens)
        for nt, kc, st in K.STAGED[cls.FORMAT]:
            staged, register = _staged_and_register(whole, hidden, ids, weights, nt, kc, st)
            assert torch.equal(staged.view(torch.int16), register.view(torch.int16)), (tokens, nt, kc, st)
        assert_rel_close(staged.cpu(), vanilla(hidden, ids, weights), 4e-3, 2.0 ** -6)
        for rank in range(2):
            part = _module(cls, spec, tensors, ExpertParallel(ep_size=2, ep_rank=rank))
            staged, register = _staged_and_register(part, hidden, ids, weights, *K.STAGED[cls.FORMAT][0])
            assert torch.equal(staged.view(torch.int16), register.view(torch.int16)), (tokens, rank)


@pytest.mark.parametrize("cls", STAGED, ids=lambda c: c.FORMAT)
def test_staged_gemm_replays_in_a_cuda_graph(cls):
    spec = MoeShape(320, 192, 8, 2, "swiglu_oai", expert_bias=True)
    module = _module(cls, spec, make_expert_tensors(spec, cls.FORMAT, seed=41, weight_std=3.0))
    nt, kc, st = K.STAGED[cls.FORMAT][0]
    assert_graph_replay_matches_eager(module, spec, 16, path="staged", tile=(1, nt), staging=(kc, st))

