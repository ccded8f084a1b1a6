"""GQA's fused decode path on CUDA (runtime/ops/gqa.py: q/k/v as one GEMM over weights concatenated at
construction or load; runtime/kernels/rotary_cache.py: qk-norm, rotary and the cache write in one launch)
computes what the op computes op by op, for the options of every family that uses it (issue 12 item 4).

Oracles: the same op in float64 on the CPU (its eager path, same weights, same cache contents), and the
op-by-op CUDA path (the kernel switched off) on the same inputs. The caches start with random values in
every slot, so an unwritten or misplaced slot shows.
"""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import rotary_cache
from runtime.ops.gqa import GQAttention
from runtime.ops.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

HIDDEN = 256
# name: (GQAttention options, rotary dims); the families' shapes cut down.
CASES = {
    "qwen3_moe": (dict(num_heads=8, num_kv_heads=2, head_dim=128, qk_norm="head"), 128),
    "qwen3_next_gated": (dict(num_heads=8, num_kv_heads=2, head_dim=128, qk_norm="head", zero_centered_qk_norm=True,
                              output_gate=True), 32),
    "glm4_partial_bias": (dict(num_heads=8, num_kv_heads=4, head_dim=128, qkv_bias=True), 64),
    "gpt_oss_sinks_window": (dict(num_heads=8, num_kv_heads=2, head_dim=64, qkv_bias=True, o_bias=True, sinks=True,
                                  sliding_window=4), 64),
    "nemotron_no_rotary": (dict(num_heads=4, num_kv_heads=2, head_dim=64, rotary=False), 64),
    "mixtral_plain": (dict(num_heads=8, num_kv_heads=8, head_dim=64), 64),
}
FUSED_KERNEL = set(CASES)   # every case above runs the one-launch kernel (MiniMax's projection norm does not)


def _gen(seed=None):
    gen = torch.Generator(device="cuda")
    gen.seed() if seed is None else gen.manual_seed(seed)
    return gen


def _module(options, dtype, device, gen):
    with torch.device(device):
        attn = GQAttention(hidden_size=HIDDEN, dtype=dtype, **options)
    if gen is not None:
        with torch.no_grad():
            for name, p in attn.named_parameters():
                fresh = torch.randn(p.shape, generator=gen, device="cuda")
                p.copy_((1.0 + 0.2 * fresh if "norm" in name else (1.0 if name == "sinks" else 0.1) * fresh).to(dtype))
    return attn


def _cache(attn, batch, length, dtype, device, gen):
    cache = attn.new_cache(batch_size=batch, max_seq_len=length, dtype=dtype, device=device)
    cache.first.copy_(torch.randn(cache.first.shape, generator=gen, device="cuda"))
    cache.second.copy_(torch.randn(cache.second.shape, generator=gen, device="cuda"))
    return cache


def _rel(a, b):
    return ((a.double() - b.double().to(a.device)).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seq", [1, 5])
def test_fused_step_matches_the_op_by_op_path_and_float64(case, seq, monkeypatch):
    options, rotary_dim = CASES[case]
    gen = _gen()
    attn = _module(options, torch.bfloat16, "cuda", gen)
    assert attn._qkv() is not None, "the projections were not fused at construction"
    batch, length = 3, 24
    positions = torch.arange(9, 9 + seq, device="cuda")
    rope = RotaryEmbedding(rotary_dim=rotary_dim, base=10000.0)
    cos, sin = rope(positions)
    cos, sin = cos.cuda(), sin.cuda()
    hidden = torch.randn(batch, seq, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    cache = _cache(attn, batch, length, torch.bfloat16, "cuda", gen)
    qkv = torch.nn.functional.linear(hidden, *attn._qkv())
    assert attn._fused_cache_write(qkv, cos, cache) == (case in FUSED_KERNEL)

    op_cache = attn.new_cache(batch_size=batch, max_seq_len=length, dtype=torch.bfloat16, device="cuda")
    op_cache.first.copy_(cache.first)
    op_cache.second.copy_(cache.second)
    ref = attn.new_cache(batch_size=batch, max_seq_len=length, dtype=torch.float64, device="cpu")
    ref.first.copy_(cache.first.cpu())
    ref.second.copy_(cache.second.cpu())
    with torch.no_grad():
        out = attn(hidden, positions, cos, sin, cache)
        with monkeypatch.context() as m:
            m.setattr(rotary_cache, "applies", lambda *a: False)
            op_out = attn(hidden, positions, cos, sin, op_cache)
        cpu = _module(options, torch.float64, "cpu", None)
        cpu.load_state_dict({k: v.double().cpu() for k, v in attn.state_dict().items()})
        ref_out = cpu(hidden.double().cpu(), positions.cpu(), cos.cpu().double(), sin.cpu().double(), ref)

    # The op-by-op CUDA path rounds where the kernel rounds: equal to within one bf16 rounding.
    torch.testing.assert_close(cache.first, op_cache.first, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cache.second, op_cache.second, rtol=0, atol=0)
    assert _rel(out, op_out) < 5e-3
    # Against float64: bf16 operands with fp32 accumulation.
    assert _rel(cache.first, ref.first) < 1e-2 and _rel(cache.second, ref.second) < 1e-2
    assert _rel(out, ref_out) < 2e-2
    # Slots outside `positions` kept their values.
    outside = torch.ones(length, dtype=torch.bool)
    outside[9 : 9 + seq] = False
    assert torch.equal(cache.first[:, :, outside.cuda()].cpu().double(), ref.first[:, :, outside])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_full_forward_takes_the_one_launch_into_fresh_buffers(case, monkeypatch):
    """Without a cache (a whole prompt, positions offset from 0) the kernel writes keys and values into
    fresh [B, H, S, D] buffers: the output equals the op-by-op CUDA path and float64, sliding windows and
    sinks included, and the kernel did run."""
    options, rotary_dim = CASES[case]
    gen = _gen()
    attn = _module(options, torch.bfloat16, "cuda", gen)
    batch, seq = 2, 37
    positions = torch.arange(5, 5 + seq, device="cuda")
    cos, sin = (t.cuda() for t in RotaryEmbedding(rotary_dim=rotary_dim, base=10000.0)(positions))
    hidden = torch.randn(batch, seq, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    launches = []
    real_apply = rotary_cache.apply
    monkeypatch.setattr(rotary_cache, "apply", lambda *a, **k: launches.append(1) or real_apply(*a, **k))
    with torch.no_grad():
        out = attn(hidden, positions, cos, sin)
        assert launches == [1]
        with monkeypatch.context() as m:
            m.setattr(rotary_cache, "applies", lambda *a: False)
            op_out = attn(hidden, positions, cos, sin)
        cpu = _module(options, torch.float64, "cpu", None)
        cpu.load_state_dict({k: v.double().cpu() for k, v in attn.state_dict().items()})
        ref_out = cpu(hidden.double().cpu(), positions.cpu(), cos.cpu().double(), sin.cpu().double())
    assert _rel(out, op_out) < 5e-3
    assert _rel(out, ref_out) < 2e-2


def test_the_fused_step_replays_in_a_cuda_graph():
    options, rotary_dim = CASES["qwen3_next_gated"]
    gen = _gen(3)
    attn = _module(options, torch.bfloat16, "cuda", gen)
    batch, length = 2, 32
    with torch.device("cuda"):   # the table on the device: the capture copies nothing from the host
        rope = RotaryEmbedding(rotary_dim=rotary_dim, base=10000.0)
    position = torch.tensor([5], device="cuda")
    hidden = torch.randn(batch, 1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    cache = _cache(attn, batch, length, torch.bfloat16, "cuda", gen)
    with torch.no_grad():
        attn(hidden, position, *rope(position), cache)   # warm-up (compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(hidden, position, *rope(position), cache)
        position.fill_(11)
        hidden.copy_(torch.randn(hidden.shape, generator=gen, device="cuda"))
        eager = attn.new_cache(batch_size=batch, max_seq_len=length, dtype=torch.bfloat16, device="cuda")
        eager.first.copy_(cache.first)
        eager.second.copy_(cache.second)
        expected = attn(hidden, position, *rope(position), eager)
        graph.replay()
    assert torch.equal(out, expected)
    assert torch.equal(cache.first, eager.first) and torch.equal(cache.second, eager.second)


def test_projections_refuse_after_a_move_and_fuse_again():
    options, rotary_dim = CASES["glm4_partial_bias"]
    gen = _gen()
    attn = _module(options, torch.bfloat16, "cuda", gen)
    names = sorted(attn.state_dict())
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias"} <= set(names)
    fused_weight, fused_bias = attn._qkv()
    assert torch.equal(fused_weight, torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)))
    assert torch.equal(fused_bias, torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)))
    attn.to("cpu").to("cuda")    # new storage for every parameter: the fused copy no longer views them
    assert attn._qkv() is None
    with torch.no_grad():
        attn.k_proj.weight.mul_(-1.0)
    attn.fuse_projections()
    assert torch.equal(attn._qkv()[0][attn.q_proj.weight.shape[0]:][: attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    assert sorted(attn.state_dict()) == names
