"""The router kernels pick the experts torch's router picks, with the same weights, and capture in a CUDA graph
(runtime/kernels/router.py; issue 6: router top-k in kernels): `moe_route` up to 64 tokens, torch's logits and
`moe_topk` above."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import routing
from runtime.kernels import router as router_kernel
from runtime.routing import LinearTopKSoftmaxRouter, SigmoidTopKRouter, SoftmaxTopKRouter

pytestmark = pytest.mark.gpu

# (name, constructor, hidden size): the three rules at real layer shapes, and two group widths.
CASES = {
    "qwen3_softmax": (lambda: SoftmaxTopKRouter(hidden_size=2048, num_experts=128, top_k=8, norm_topk_prob=True, dtype=torch.bfloat16), 2048),
    "deepseek_grouped": (lambda: SigmoidTopKRouter(hidden_size=7168, num_experts=256, top_k=8, n_group=8, topk_group=4,
                                                   routed_scaling_factor=2.5, dtype=torch.bfloat16), 7168),
    # groups wider and narrower than a warp (64 and 4 experts each): the kernel's group scoring by warps
    "grouped_wide": (lambda: SigmoidTopKRouter(hidden_size=1024, num_experts=256, top_k=6, n_group=4, topk_group=2,
                                               dtype=torch.bfloat16), 1024),
    "grouped_narrow": (lambda: SigmoidTopKRouter(hidden_size=512, num_experts=16, top_k=3, n_group=4, topk_group=2,
                                                 dtype=torch.bfloat16), 512),
    "kimi_one_group": (lambda: SigmoidTopKRouter(hidden_size=7168, num_experts=896, top_k=8, routed_scaling_factor=2.827,
                                                 dtype=torch.bfloat16), 7168),
    "minimax_bf16_gemm": (lambda: SigmoidTopKRouter(hidden_size=3072, num_experts=256, top_k=8, fp32_gemm=False,
                                                    dtype=torch.bfloat16), 3072),
    "gpt_oss_logits": (lambda: LinearTopKSoftmaxRouter(hidden_size=2880, num_experts=128, top_k=4, dtype=torch.bfloat16), 2880),
    # a softmax that keeps its probabilities (OLMoE): the one rule that still takes the block-wide softmax
    "olmoe_softmax_plain": (lambda: SoftmaxTopKRouter(hidden_size=2048, num_experts=64, top_k=8, norm_topk_prob=False,
                                                      dtype=torch.bfloat16), 2048),
    # 512 experts, top-10 (Qwen3-Next): four experts a lane in the top-k's first level, ten picks a warp
    "qwen3_next_softmax": (lambda: SoftmaxTopKRouter(hidden_size=2048, num_experts=512, top_k=10, norm_topk_prob=True,
                                                     dtype=torch.bfloat16), 2048),
    # 30 experts over 4 warps: the last warp's share (6) is shorter than the top-k (8)
    "short_share": (lambda: SigmoidTopKRouter(hidden_size=256, num_experts=30, top_k=8, dtype=torch.bfloat16), 256),
}


# The cases whose GEMM rounds the logits to bf16, as torch's bf16 GEMM does.
ROUNDED_LOGITS = ("qwen3_softmax", "gpt_oss_logits", "minimax_bf16_gemm", "olmoe_softmax_plain", "qwen3_next_softmax")


def _router(name: str):
    make, hidden = CASES[name]
    router = make().cuda()
    gen = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32) * 0.05)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=gen, device="cuda") * 0.02)
    return router, hidden


def _torch_path(router, x):
    saved = router_kernel.applies, router_kernel.topk_applies
    router_kernel.applies = router_kernel.topk_applies = lambda *a, **k: False
    try:
        return router(x)
    finally:
        router_kernel.applies, router_kernel.topk_applies = saved


def _handed_to_topk(monkeypatch) -> list:
    """The logits each call of `router_kernel.topk` is handed from now on (the kernel still runs)."""
    logits = []
    topk = router_kernel.topk
    monkeypatch.setattr(router_kernel, "topk", lambda *a, **k: logits.append(a[0]) or topk(*a, **k))
    return logits


def _choice(router, logits):
    """[T, E] fp32: what the router's rule picks by (ungrouped), from its logits."""
    logits = logits.float()
    if isinstance(router, LinearTopKSoftmaxRouter):
        return logits
    if isinstance(router, SoftmaxTopKRouter):
        return torch.softmax(logits, dim=-1)
    bias = router.e_score_correction_bias
    return torch.sigmoid(logits) + (0 if bias is None else bias.float())


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_the_kernel_routes_as_torch_does(name, tokens):
    router, hidden = _router(name)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    assert router_kernel.applies(x, router.weight, router.top_k, getattr(router, "n_group", 1))
    with torch.no_grad():
        ids, weights = router(x)
        ref_ids, ref_weights = _torch_path(router, x)
    same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(ids, ref_ids)]
    # Different summation orders may reorder two experts whose scores tie to within rounding.
    assert sum(same) >= max(1, int(0.95 * tokens))
    # Where torch's GEMM rounds the logits to bf16 (softmax and gpt-oss rules, and MiniMax), a sum that
    # differs in the last fp32 bits can round to the neighbouring bf16 value: one bf16 ulp of a logit
    # below 16 is at most 2^-4, which moves its softmax weight by up to ~6 % (seen on an H200: 2.4 % and
    # 2.9 %, one weight in a few hundred). Where the logits stay fp32 the weights agree to 1e-2.
    rtol = 6.25e-2 if name in ROUNDED_LOGITS else 1e-2
    for row, ok in enumerate(same):
        if ok:
            order, ref_order = ids[row].argsort(), ref_ids[row].argsort()
            torch.testing.assert_close(weights[row][order], ref_weights[row][ref_order], rtol=rtol, atol=1e-5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tokens", [65, 300])
def test_the_topk_kernel_routes_larger_batches_as_torch_does(name, tokens, monkeypatch):
    """Above 64 tokens torch computes the logits and `moe_topk` picks and weighs: from the same logits, the same
    experts but where the k-th and the next tie (then both picks score the same), and the same weights to fp32
    rounding."""
    router, hidden = _router(name)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = _handed_to_topk(monkeypatch)
    with torch.no_grad():
        ids, weights = router(x)
        ref_ids, ref_weights = _torch_path(router, x)
    assert [t.shape for t in logits] == [(tokens, router.weight.shape[0])]
    choice = _choice(router, logits[0])
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, router.top_k)
    same = 0
    for row in range(tokens):
        if set(ids[row].tolist()) == set(ref_ids[row].tolist()):
            same += 1
            order, ref_order = ids[row].argsort(), ref_ids[row].argsort()
            torch.testing.assert_close(weights[row][order], ref_weights[row][ref_order], rtol=1e-4, atol=1e-6)
        else:   # a tie at the k-th pick: both sets score alike (fp32 sigmoid / exp may differ in the last bits)
            torch.testing.assert_close(choice[row][ids[row]].sort().values, choice[row][ref_ids[row]].sort().values,
                                       rtol=1e-5, atol=0)
    assert same >= int(0.9 * tokens)


@pytest.mark.parametrize("tokens", [8, 300])
def test_the_kernel_path_replays_in_a_cuda_graph(tokens):
    router, hidden = _router("deepseek_grouped")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        router(x)  # compile and warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids, weights = router(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager_ids, eager_weights = router(x)
    torch.testing.assert_close(ids, eager_ids)
    torch.testing.assert_close(weights, eager_weights)


@pytest.mark.parametrize("tokens", [1, 64])
def test_the_one_launch_kernel_leaves_its_counters_at_zero_and_repeats_itself(tokens):
    """The last CTA of each token runs the top-k and resets that token's arrival counter: a second call
    (or replay) on other inputs must route as torch does again, and repeated calls agree bit for bit."""
    router, hidden = _router("qwen3_softmax")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            ids, weights = router(x)
            again_ids, again_weights = router(x)
            ref_ids, _ = _torch_path(router, x)
            assert torch.equal(ids, again_ids) and torch.equal(weights, again_weights)
            same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(ids, ref_ids))
            assert same >= max(1, int(0.95 * tokens))
    assert int(router_kernel._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize("tokens", [16, 100])
@pytest.mark.parametrize("name", ["qwen3_softmax", "minimax_bf16_gemm", "qwen3_next_softmax"])
def test_tied_experts_are_picked_lower_index_first(name, tokens):
    """Expert i + E/2 gets expert i's weight row, so their logits tie exactly, and the two sit in different
    warps' shares of the kernels' two-level top-k (`moe_route` at 16 tokens, `moe_topk` at 100). Ties pick the
    lower index first: the picks run in non-increasing weight, equal weights in increasing index, and each upper
    expert picked comes after its lower twin with the same weight. (Rounded bf16 logits also tie between unrelated
    experts, so the twins need not be adjacent.)"""
    router, hidden = _router(name)
    half = router.weight.shape[0] // 2
    with torch.no_grad():
        router.weight[half:] = router.weight[:half]
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:   # a choice bias picks in another order than the weights': none here
            bias.zero_()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ids, weights = router(x)
    uppers = 0
    for row_ids, row_weights in zip(ids.tolist(), weights.tolist()):
        for r in range(len(row_ids) - 1):
            assert row_weights[r] >= row_weights[r + 1], (row_ids, row_weights)
            if row_weights[r] == row_weights[r + 1]:
                assert row_ids[r] < row_ids[r + 1], (row_ids, row_weights)
        for r, e in enumerate(row_ids):
            if e >= half:
                uppers += 1
                twin = row_ids.index(e - half)   # raises if the lower twin was not picked
                assert twin < r and row_weights[twin] == row_weights[r], (row_ids, row_weights)
    assert uppers >= 16   # the twins do get picked: the test sees the cross-share ties


def _sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per logit, 2^-17 of the sum of |products|. fp32 sums of exact products stay far inside it: their error
    follows the partial sums, ~sqrt(K) smaller than that sum (offline, on the CPU at these shapes: 2.6e-8 of it for
    MKL, 8.0e-8 for a sequential sum of 16-product chunks, against 7.6e-6). Logits rounded to bf16 do not: a bf16
    rounding of a logit came to up to 2.8e-4 of that sum here, and 64 % of the logits landed outside."""
    return 2.0 ** -17 * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("tokens", [65, 2048])
def test_bf16_operands_give_fp32_logits_in_one_gemm(tokens):
    """`fp32_logits` of bf16 operands on CUDA (one bf16 GEMM writing fp32) is within fp32 summation error of the
    float64 product, as casting both operands first is; the bound would catch logits rounded to bf16."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 7168, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(256, 7168, generator=gen, device="cuda") * 0.05).bfloat16()
    exact = x.double() @ w.double().t()
    bound = _sum_bound(x, w)
    got = routing.fp32_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, 256)
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((F.linear(x.float(), w.float()).double() - exact).abs() <= bound).all()   # the cast path: same bound
    assert not ((got.bfloat16().double() - exact).abs() <= bound).all()


def test_the_deepseek_router_hands_moe_topk_the_one_gemm_logits(monkeypatch):
    """Above 64 tokens the DeepSeek router (bf16 weight, fp32 logits) computes its logits with `fp32_logits`'s
    one bf16 GEMM, bit for bit what `moe_topk` is handed, and within fp32 summation error of the exact product."""
    router, hidden = _router("deepseek_grouped")
    x = torch.randn(300, hidden, device="cuda", dtype=torch.bfloat16)
    logits = _handed_to_topk(monkeypatch)
    with torch.no_grad():
        router(x)
    assert router.weight.dtype == torch.bfloat16 and len(logits) == 1
    assert torch.equal(logits[0], torch.mm(x, router.weight.t(), out_dtype=torch.float32))
    exact = x.double() @ router.weight.double().t()
    assert ((logits[0].double() - exact).abs() <= _sum_bound(x, router.weight)).all()
