"""MoE layer benchmark on one GPU (PERFORMANCE.md §1): the CUPY experts against the peers and the roofline.

Run on the GPU machine from the repo root: `python3 bench/moe_layer.py --out DIR` writes
`moe_layer.json` (every measurement) and `moe_layer.md` (the table for BENCHMARKS.md).

Scope timed, for ours and every peer alike: router top-k (softmax, top-k, renormalize) and the routed
experts, under a CUDA graph. Ours routes as a build does (the fused router kernel up to 64 tokens, torch's
linear and the top-k kernel beyond), and is timed with torch's router too, the one the peers and the vLLM
figures use; three weight copies (and three graphs) rotated so the L2
holds none of them; the median over batches of 5 replays, at least 120 replays. Random data, never
zeros; uniform routing (random logits) and skewed routing (a fixed Zipf-like bias giving the hottest
8 experts ~30 % of the pairs). Weights are random bytes in each format's layout (valid codes and
scales), filled straight on the GPU.

Peers, in the same process: `torch_pipeline` (sort-based permutation, torch._grouped_mm for both
GEMMs, fp32 activation and combine: the TORCH backend made capturable), transformers' own
`grouped_mm` and `batched_mm` experts functions, an eager per-expert loop (T <= 64, host syncs
included) and, for the FP8 formats, a `torch._scaled_grouped_mm` pipeline with rowwise scales. The
bf16 peers stand for every format: the TORCH backend dequantizes at load and runs exactly that.

Ceilings, re-measured here: a 2 GiB device-to-device copy (bytes read + written) and 8192^3 bf16 and
FP8 matrix products. T_lb = max(weight bytes of the active experts / copy bandwidth, useful FLOPs /
the peak of the format's tensor-core type), with E(1 - (1 - k/E)^T) active experts under uniform
routing and the counted ones under skewed routing.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.experts.base import MoeShape  # noqa: E402
from runtime import kernels as K  # noqa: E402
from runtime.graphs import capture  # noqa: E402
from runtime.kernels import router as router_kernel  # noqa: E402
from tests.runtime.helpers_experts import registry_classes  # noqa: E402

SHAPES = {   # hidden, moe_intermediate, experts, top_k
    "Q": (2048, 768, 128, 8), "D": (7168, 2048, 256, 8), "G": (2880, 2880, 128, 4), "tiny": (256, 64, 8, 2)}
TOKENS = (1, 8, 64, 256, 2048, 8192)
# registry/impls.toml is the one list of the classes (as for the GPU tests)
CUPY_CLASSES = {cls.FORMAT: cls for cls in registry_classes("CUPY")}
# --impl triton: the TRITON classes where one exists (they run the CUPY path for small calls)
TRITON_CLASSES = {cls.FORMAT: cls for cls in registry_classes("TRITON")}
CLASSES = dict(CUPY_CLASSES)
# vLLM's Triton fused MoE on an H200, uniform routing, microseconds, same timing method
# (../shared/research/peer_vllm_triton_h200.md, measured 2026-12-01): R_peer is read against these, on that GPU
# type only (another GPU's time against an H200's is no ratio of the kernels).
VLLM_GPU = "H200"
VLLM_TRITON_US = {
    ("Q", "bf16"): (57, 160, 335, 371, 563, 1690),
    ("Q", "fp8_block_scales"): (57, 120, 206, 249, 537, 1680),
    ("D", "bf16"): (214, 1292, 4464, 5389, 6440, 15049),
    ("D", "fp8_block_scales"): (146, 707, 2410, 3057, 4547, 12336),
    ("G", "bf16"): (86, 406, 1335, 1587, 1899, 4238),
}
# Triton GEMM configurations the sweep times: (gemm1, gemm2), each (BM, BN, BK, warps, stages)
TRITON_SWEEP = {
    "fp8_block_scales": [
        ((64, 128, 128, 8, 3, 8), (64, 128, 128, 4, 4, 8)),
        ((64, 128, 128, 8, 4, 8), (64, 128, 128, 4, 4, 8)),
        ((64, 128, 128, 8, 3, 16), (64, 128, 128, 4, 4, 16)),
        ((64, 128, 128, 8, 3, 8), (64, 128, 128, 4, 6, 8)),
        ((64, 128, 128, 8, 4, 8), (64, 256, 128, 8, 4, 8)),
        # token tiles for 4-32 rows per expert (the 64-256-token cells, where the CUPY tiles trail vLLM's
        # Triton kernel): Triton lowers BM < 64 to mma.sync; no spills with Triton 3.9 offline (ptxas, sm_90a)
        ((16, 128, 128, 4, 4, 8), (16, 128, 128, 4, 4, 8)),
        ((32, 128, 128, 8, 3, 8), (32, 128, 128, 4, 4, 8)),
        # the warp-specialized Gluon kernels (an eighth element True: runtime/kernels/gluon_fp8.py; a TMA warp and an
        # MMA warpgroup each 64 token rows, promoting apart), w2 blocks of 128 and 256 columns, the one-warpgroup 64-row
        # tile, and the Gluon gemm1 with the Triton gemm2 at 128 rows
        ((128, 128, 128, 8, 4, 8, False, True), (128, 128, 128, 8, 4, 8, False, True)),
        ((128, 128, 128, 8, 3, 8, False, True), (128, 256, 128, 8, 3, 8, False, True)),
        ((64, 128, 128, 4, 4, 8, False, True), (64, 128, 128, 4, 4, 8, False, True)),
        ((128, 128, 128, 8, 4, 8, False, True), (128, 128, 128, 8, 3, 8)),
    ],
    "bf16": [
        ((128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8)),
        ((128, 128, 64, 8, 4, 8), (128, 256, 64, 8, 4, 8)),
        ((128, 128, 64, 8, 3, 16), (128, 256, 64, 8, 3, 16)),
        ((128, 64, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8)),
        ((16, 128, 64, 4, 4, 8), (16, 128, 64, 4, 4, 8)),
        ((32, 128, 64, 4, 4, 8), (32, 128, 64, 4, 4, 8)),
        ((64, 128, 64, 4, 4, 8), (64, 128, 64, 4, 4, 8)),
    ],
    # FP4 words decoded in registers as the dot's first operand: GEMM1 with BN 128 (256 weight rows) is 5-10 %
    # slower than 64 channels (128 rows) (no spills with the launch's divisibility: 255 registers, Triton 3.6,
    # sm_90a); BK is 64, one column of the 16 x 64 FP4 row tiles a TMA block
    "w4a16_mxfp4": [
        ((128, 64, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8)),
        ((128, 64, 64, 8, 4, 8), (128, 128, 64, 8, 4, 8)),
        ((128, 64, 64, 8, 3, 8), (128, 64, 64, 8, 3, 8)),
        ((64, 64, 64, 4, 3, 8), (64, 128, 64, 4, 3, 8)),
        ((128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8)),
        # the packed decode (a seventh element True: fp4_blocks.fp4_pair_packed, two fma.rn.bf16x2 a pair):
        # 398 -> 334 PTX instructions in GEMM1's K loop offline (Triton 3.6, sm_90a), the same bits; 3-7 % faster
        # at Q and G, 2048 and 8192 tokens (H100, 2026-12-05), so the plan runs it
        ((128, 64, 64, 8, 3, 8, True), (128, 128, 64, 8, 3, 8, True)),
        ((128, 64, 64, 8, 4, 8, True), (128, 128, 64, 8, 4, 8, True)),
        # the overlapped kernel (an eighth element True: runtime/kernels/gluon_w4.py, the decode of K step k + 1
        # while step k's wgmma runs): 229-240 / 199 registers at 128 rows (one CTA an SM: 3-13 % slower than the packed
        # tile), 121-127 at 64 rows (two: 2 % faster at Q 2048 and G 8192, 12 % faster than CUPY at G 2048; H100, 2026-12-06)
        ((128, 64, 64, 8, 3, 8, True, True), (128, 128, 64, 8, 3, 8, True, True)),
        ((128, 64, 64, 8, 4, 8, True, True), (128, 128, 64, 8, 4, 8, True, True)),
        ((64, 64, 64, 8, 4, 8, True, True), (64, 128, 64, 8, 4, 8, True, True)),
    ],
    # the packed MXFP4 tiles with NVFP4's scales, or W4A8's E4M3 activations (no overlapped kernel: it decodes the
    # E8M0 scales of the BF16_WORD layout only)
    "w4a16_nvfp4": [
        ((128, 64, 64, 8, 3, 8, True), (128, 128, 64, 8, 3, 8, True)),
        ((128, 64, 64, 8, 4, 8, True), (128, 128, 64, 8, 4, 8, True)),
        ((64, 64, 64, 8, 4, 8, True), (64, 128, 64, 8, 4, 8, True)),
        ((64, 64, 64, 4, 3, 8, True), (64, 128, 64, 4, 3, 8, True)),
    ],
}
TRITON_SWEEP["w4a8_mxfp4_fp8"] = TRITON_SWEEP["w4a16_nvfp4"]   # the same packed decode and bf16 dot
BYTES_PER_PARAM = {"bf16": 2.0, "fp8_block_scales": 1 + 4 / 128 ** 2, "w4a16_mxfp4": 0.5 + 1 / 32,
                   "w4a8_mxfp4_fp8": 0.5 + 1 / 32, "w4a16_nvfp4": 0.5 + 1 / 16}
FP8_PEAK_FORMATS = {"fp8_block_scales", "w4a8_mxfp4_fp8"}
COPIES = 3
BATCH = 5
SAMPLES = 24


def log(*args):
    print(*args, flush=True)


# --- timing -------------------------------------------------------------------------------------
def time_graphs(fns, samples=SAMPLES, batch=BATCH):
    """Median microseconds of one call, each fn captured in its own graph and replayed in rotation."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    n = 0
    for s in range(samples):
        starts[s].record()
        for _ in range(batch):
            graphs[n % len(graphs)].replay()
            n += 1
        ends[s].record()
    torch.cuda.synchronize()
    times = sorted(starts[s].elapsed_time(ends[s]) * 1000 / batch for s in range(samples))
    del graphs
    return times[len(times) // 2]


def replay_matches_eager(fn):
    """Whether `fn`'s CUDA-graph replay gives its eager output bit for bit: a replay that overlapped its
    kernels wrongly, or skipped work, would not (the timings replay graphs, the tests check small shapes)."""
    graph, out = capture(fn)
    graph.replay()
    replayed = out.clone()
    eager = fn()
    torch.cuda.synchronize()
    return bool(torch.equal(replayed, eager))


def time_eager(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    out.sort()
    return out[len(out) // 2]


# --- ceilings -----------------------------------------------------------------------------------
def ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_end = time.time() + 1.0          # the card idles at low clocks: run it warm before measuring
    while time.time() < t_end:
        a @ b
    torch.cuda.synchronize()
    mm_us = min(time_graphs([lambda: a @ b], samples=10, batch=3) for _ in range(2))
    bf16 = 2 * 8192 ** 3 / (mm_us * 1e-6)
    # device-to-device copy, bytes read + written: a graph-captured copy_ becomes a copy-engine node
    # (slower here), so time eager copy_ with events and an SM copy kernel in a graph; keep the best
    src = torch.empty(2 ** 30, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    eager = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        eager.append(start.elapsed_time(end) * 1000)
    kernel = min(time_graphs([lambda: torch.mul(src, 1.0, out=dst)], samples=10, batch=3) for _ in range(2))
    copy_us = min(min(eager), kernel)
    bw = 2 * src.numel() * 4 / (copy_us * 1e-6)
    log(f"copy: eager copy_ {2 * src.numel() * 4 / (min(eager) * 1e-6) / 1e12:.2f} TB/s, "
        f"graph SM kernel {2 * src.numel() * 4 / (kernel * 1e-6) / 1e12:.2f} TB/s")
    del src, dst
    fp8 = None
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        mm8_us = time_graphs([lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)], samples=10, batch=3)
        fp8 = 2 * 8192 ** 3 / (mm8_us * 1e-6)
    except Exception as exc:   # noqa: BLE001
        log("fp8 ceiling unavailable:", exc)
    return {"copy_bytes_per_s": bw, "bf16_flops": bf16, "fp8_flops": fp8}


# --- inputs -------------------------------------------------------------------------------------
def skew_bias(experts, top_k, hidden, gen):
    """A fixed Zipf-like logit bias, scaled so the hottest 8 experts take ~30 % of the pairs."""
    rank = torch.randperm(experts, generator=gen)
    base = -torch.log1p(rank.float()).cuda()
    hot = rank < 8
    x = torch.randn(4096, experts, device="cuda")
    lo, hi = 0.0, 8.0
    for _ in range(30):
        s = (lo + hi) / 2
        ids = (x + s * base).topk(top_k, dim=1).indices
        frac = hot.cuda()[ids].float().mean().item()
        lo, hi = (s, hi) if frac < 0.30 else (lo, s)
    return (lo + hi) / 2 * base


class Router:
    """Softmax top-k routing with renormalisation, the skewed mode's bias added to the logits. Called, it is
    torch's linear, softmax, top-k and division (the peers' router); `fused` is what a build runs instead
    (runtime/kernels/router.py): the router kernel up to 64 tokens, torch's linear and the top-k kernel above."""

    def __init__(self, hidden, experts, top_k, bias):
        self.w = (torch.randn(experts, hidden, device="cuda") / math.sqrt(hidden)).bfloat16()
        self.bias = bias
        self.top_k = top_k

    def __call__(self, x):
        logits = (x @ self.w.t()).float()
        if self.bias is not None:
            logits = logits + self.bias
        weights, ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def fused(self, x):
        if router_kernel.applies(x, self.w, self.top_k):
            return router_kernel.route(x, self.w, self.top_k, router_kernel.SOFTMAX, logit_bias=self.bias,
                                       round_logits=True, renormalize=True)
        logits = x @ self.w.t()
        if self.bias is not None:
            logits = logits.float() + self.bias
        if not router_kernel.topk_applies(logits, self.top_k):
            return self(x)
        return router_kernel.topk(logits, self.top_k, router_kernel.SOFTMAX, renormalize=True)


def fill_module(module, gen_seed):
    """Random contents in the module's own layout: valid codes and realistic scales. Filled an expert at a time, so
    the fp32 temporaries of the FP8 codes stay small (D's w13 whole would need 28 GiB: more than an H100 has free
    beside two weight copies)."""
    # on the module's own device: the GPU in a run, the CPU in tests
    g = torch.Generator(device=next(module.buffers()).device).manual_seed(gen_seed)
    for name, whole in module.named_buffers():
        for buf in (whole.unbind(0) if whole.dim() > 2 else (whole,)):
            _fill(name, buf, g)
    module.weights_loaded = True


def _fill(name, buf, g):
    """fill_module's contents of one buffer (or one expert's slice of it)."""
    if buf.dtype == torch.bfloat16:
        buf.normal_(0, 0.02, generator=g)
    elif buf.dtype == torch.float8_e4m3fn:
        if name.startswith("s"):   # NVFP4 block scales, E4M3, positive
            buf.copy_(torch.empty_like(buf, dtype=torch.float32).uniform_(0.5, 4, generator=g).to(buf.dtype))
        else:
            buf.copy_(torch.empty_like(buf, dtype=torch.float32).normal_(0, 100, generator=g).clamp(-448, 448).to(buf.dtype))
    elif buf.dtype == torch.uint8:
        if name.startswith("s"):   # E8M0 scale bytes near 2^-8
            buf.copy_(torch.randint(115, 124, buf.shape, device=buf.device, generator=g).to(torch.uint8))
        else:                      # every byte is two valid E2M1 codes
            buf.copy_(torch.randint(0, 256, buf.shape, device=buf.device, generator=g).to(torch.uint8))
    elif buf.dtype == torch.float32:
        buf.uniform_(1e-4, 3e-4, generator=g)


# --- peers --------------------------------------------------------------------------------------
def _sort(ids, experts):
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


def torch_pipeline(x, ids, weights, w13, w2):
    """What a competent engineer writes with torch: sort, gather, two grouped GEMMs, combine."""
    t, k = ids.shape
    order, offs = _sort(ids, w13.shape[0])
    tok = order // k
    gu = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    g, u = gu.float().chunk(2, dim=-1)
    h = (F.silu(g) * u).bfloat16()
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs).float() * weights.reshape(-1)[order, None]
    return torch.zeros(t, x.shape[1], device=x.device).index_add_(0, tok, y).bfloat16()


def _rowwise(a):
    s = a.float().abs().amax(dim=-1).clamp_min(1e-4) / 448
    return (a.float() / s[:, None]).to(torch.float8_e4m3fn), s


def fp8_rowwise_pipeline(x, ids, weights, w13, s13, w2, s2):
    t, k = ids.shape
    order, offs = _sort(ids, w13.shape[0])
    tok = order // k
    a, sa = _rowwise(x[tok])
    gu = torch._scaled_grouped_mm(a, w13.transpose(1, 2), sa, s13, offs=offs, out_dtype=torch.bfloat16)
    g, u = gu.float().chunk(2, dim=-1)
    h, sh = _rowwise((F.silu(g) * u).bfloat16())
    y = torch._scaled_grouped_mm(h, w2.transpose(1, 2), sh, s2, offs=offs, out_dtype=torch.bfloat16)
    y = y.float() * weights.reshape(-1)[order, None]
    return torch.zeros(t, x.shape[1], device=x.device).index_add_(0, tok, y).bfloat16()


class HFExperts(torch.nn.Module):
    """The attributes transformers' experts functions read (concatenated [gate; up], not transposed)."""

    def __init__(self, w13, w2):
        super().__init__()
        self.gate_up_proj, self.down_proj = w13, w2
        self.num_experts = w13.shape[0]
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm = False
        self._is_expert_parallel = False
        self.act_fn = F.silu

    def _apply_gate(self, gate_up):
        g, u = gate_up.chunk(2, dim=-1)
        return self.act_fn(g) * u


def hf_functions():
    try:
        from transformers.integrations import moe
        return {"hf_grouped_mm": moe.grouped_mm_experts_forward, "hf_batched_mm": moe.batched_mm_experts_forward}
    except Exception as exc:   # noqa: BLE001
        log("transformers experts functions unavailable:", exc)
        return {}


def loop_pipeline(x, ids, weights, w13, w2):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        g, u = (x[tok] @ w13[e].t()).float().chunk(2, dim=-1)
        y = ((F.silu(g) * u).bfloat16() @ w2[e].t()).float()
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out.bfloat16()


# --- the cells ----------------------------------------------------------------------------------
def active_experts(shape, tokens, routing, ids):
    h, i, e, k = SHAPES[shape]
    if routing == "uniform":
        return e * (1 - (1 - k / e) ** tokens)
    return float(ids.unique().numel())


def tile_fill(ids, experts, bm):
    """Routed rows over the rows the grouped GEMMs multiply: each expert's rows in tiles of `bm`, its last tile
    padded, so at a few tiles an expert a good part of the tensor work is padding."""
    rows = torch.bincount(ids.flatten(), minlength=experts)
    return rows.sum().item() / (((rows + bm - 1) // bm).sum().item() * bm)


def vllm_us(shape, fmt, tokens, routing, gpu):
    """The research note's vLLM Triton time of the cell (uniform routing, on the note's GPU type `VLLM_GPU`), or
    None."""
    row = VLLM_TRITON_US.get((shape, fmt))
    if row is None or routing != "uniform" or tokens not in TOKENS or VLLM_GPU not in gpu:
        return None
    return float(row[TOKENS.index(tokens)])


def build(fmt, spec, copies=COPIES, extra_tiles=(), classes=None):
    mods = []
    for c in range(copies):
        m = (classes or CLASSES)[fmt](spec, device="meta").to_empty(device="cuda")
        m.extra_tiles = tuple(extra_tiles)
        fill_module(m, 100 + c)
        m.prepare("cuda")
        mods.append(m)
    return mods


def sweep(args, result):
    """Every compiled warp tile (and bf16's grouped_mm path) on the prefill cells: picks `plan`'s tiles."""
    rows = []
    for shape in ("Q", "D"):
        h, i, e, k = SHAPES[shape]
        spec = MoeShape(h, i, e, k, "silu_glu")
        router = Router(h, e, k, None)
        for t in (int(v) for v in args.sweep_tokens.split(",")):
            x = torch.randn(t, h, device="cuda").bfloat16()
            for fmt in args.formats.split(","):
                if fmt == "fp8_block_scales" and (h % 128 or i % 128):
                    continue
                mods = build(fmt, spec, extra_tiles=K.EXTRA_TILES)
                options = [("kernels", tile) for tile in K.tiles(fmt) + K.EXTRA_TILES]
                if t < 1024:
                    options = [("kernels", tile) for tile in ((1, 1), (1, 2), (2, 4))]
                if fmt == "bf16":
                    options.append(("grouped_mm", (1, 1)))
                options.append((None, None))    # what plan() picks
                for path, tile in dict.fromkeys(options):
                    try:
                        with torch.no_grad():
                            us = time_graphs([(lambda m: lambda: m(x, *router(x), path=path, tile=tile))(m) for m in mods],
                                             samples=8, batch=3)
                    except Exception as exc:   # noqa: BLE001
                        us = None
                        result["errors"].append(f"sweep {shape} {fmt} T={t} {path} {tile}: {exc!r}"[:300])
                        torch.cuda.synchronize()
                    if path is None:
                        path, tile = "plan " + mods[0].plan(t, k)[0], mods[0].plan(t, k)[1]
                    rows.append({"shape": shape, "format": fmt, "tokens": t, "path": path, "tile": tile, "us": us})
                    log(f"sweep {shape} {fmt:16s} T={t:5d} {path:10s} {tile}: {us if us is None else round(us, 1)}")
                del mods
                gc.collect()
                torch.cuda.empty_cache()
    result["sweep"] = rows


def triton_sweep(args, result):
    """Every TRITON_SWEEP configuration on the prefill cells, with the CUPY plan of the same weights."""
    rows = []
    for shape in args.shapes.split(","):
        h, i, e, k = SHAPES[shape]
        spec = MoeShape(h, i, e, k, "silu_glu")
        router = Router(h, e, k, None)
        for fmt in args.formats.split(","):
            if fmt not in TRITON_CLASSES or (fmt == "fp8_block_scales" and (h % 128 or i % 128)):
                continue
            mods = build(fmt, spec, classes=TRITON_CLASSES)
            for t in (int(v) for v in args.sweep_tokens.split(",")):
                x = torch.randn(t, h, device="cuda").bfloat16()
                options = [("triton", cfg) for cfg in TRITON_SWEEP[fmt]]
                options.append((CUPY_CLASSES[fmt].plan(mods[0], t, k)[0], None))   # what the CUPY class runs
                for path, cfg in options:
                    try:
                        with torch.no_grad():
                            us = time_graphs([(lambda m: lambda: m(x, *router(x), path=path, tile=cfg))(m) for m in mods],
                                             samples=8, batch=3)
                    except Exception as exc:   # noqa: BLE001
                        us = None
                        result["errors"].append(f"triton sweep {shape} {fmt} T={t} {cfg}: {exc!r}"[:400])
                        log("ERROR", result["errors"][-1])
                        torch.cuda.synchronize()
                    flops = 2 * t * k * 3 * h * i
                    rows.append({"shape": shape, "format": fmt, "tokens": t, "path": path, "tile": cfg, "us": us,
                                 "vllm_us": vllm_us(shape, fmt, t, "uniform", result["gpu"])})
                    vl = rows[-1]["vllm_us"]
                    log(f"tsweep {shape} {fmt:16s} T={t:5d} {path:10s} {cfg}: "
                        f"{'-' if us is None else f'{us:.1f} us {flops / us / 1e6:.0f} TFLOP/s'}"
                        f"{'' if us is None or vl is None else f'  R_peer(vLLM) {vl / us:.2f}'}")
            del mods
            gc.collect()
            torch.cuda.empty_cache()
    result["triton_sweep"] = rows


def profile(args):
    """Kernel times of one call of ours (torch.profiler): where the fixed cost and the time go."""
    from torch.profiler import ProfilerActivity, profile as prof

    cells = ((("Q", "bf16", 1), ("Q", "bf16", 2048), ("Q", "w4a16_mxfp4", 2048), ("D", "fp8_block_scales", 2048))
             if args.impl == "cupy" else
             (("Q", "fp8_block_scales", 2048), ("Q", "fp8_block_scales", 8192), ("D", "fp8_block_scales", 8192),
              ("Q", "bf16", 2048), ("D", "bf16", 8192)))
    for shape, fmt, t in cells:
        h, i, e, k = SHAPES[shape]
        spec = MoeShape(h, i, e, k, "silu_glu")
        mods = build(fmt, spec, copies=1)
        router = Router(h, e, k, None)
        x = torch.randn(t, h, device="cuda").bfloat16()
        with torch.no_grad():
            for _ in range(3):
                mods[0](x, *router(x))
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    mods[0](x, *router(x))
                torch.cuda.synchronize()
        log(f"--- profile {shape} {fmt} T={t} (5 calls) ---")
        log(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        del mods
        gc.collect()
        torch.cuda.empty_cache()


def decode_kernels(args, result):
    """The GEMMs alone at the decode cells (torch.profiler over the rotated weight copies, uniform
    routing): GEMM1 and GEMM2 microseconds per call and TB/s of the packed bytes of the active experts,
    for what plan() and _split() pick, on the split-K tile each compiled factor forced, and each tile of
    `--decode-tiles` forced."""
    from torch.profiler import ProfilerActivity, profile as prof

    rows, reps = [], 6
    for shape in args.shapes.split(","):
        h, i, e, k = SHAPES[shape]
        spec = MoeShape(h, i, e, k, "silu_glu")
        router = Router(h, e, k, None)
        for fmt in args.formats.split(","):
            mods = build(fmt, spec)
            for t in (int(v) for v in args.tokens.split(",")):
                x = torch.randn(t, h, device="cuda").bfloat16()
                with torch.no_grad():
                    ids, weights = router(x)
                active = int(ids.unique().numel())
                tile = tuple(mods[0].plan(t, k)[1])
                splits = K.splits(tile)
                options = [{}] + ([{"tile": (*tile, sk)} for sk in (1,) + splits] if splits else [])
                options += [{"tile": forced} for forced in args.decode_tiles if {"tile": forced} not in options]
                if t > 1:   # the staged GEMMs run the sorted path
                    options += [{"path": "staged", "tile": (1, nt), "staging": (kc, st)}
                                for nt, kc, st in K.STAGED.get(fmt, ())]
                for opt in options:
                    with torch.no_grad():
                        for m in mods:
                            m(x, ids, weights, **opt)
                        torch.cuda.synchronize()
                        with prof(activities=[ProfilerActivity.CUDA]) as p:
                            for r in range(reps * len(mods)):
                                mods[r % len(mods)](x, ids, weights, **opt)
                            torch.cuda.synchronize()
                    label = "plan" if not opt else list(opt["tile"]) + ([f"s{opt['staging'][0]}x{opt['staging'][1]}"]
                                                                         if "staging" in opt else [])
                    row = {"shape": shape, "format": fmt, "tokens": t, "active_experts": active, "tile": label}
                    for ev in p.key_averages():
                        if not ev.key.startswith("moe_gemm_"):
                            continue
                        gemm = "gemm2" if int(ev.key.split("_")[4]) == K.EPI_DOWN else "gemm1"   # moe_gemm_WF_AQ_EPI_...
                        us = (getattr(ev, "device_time_total", None) or ev.cuda_time_total) / ev.count
                        n_out = (2 * i if gemm == "gemm1" else h)
                        n_in = h if gemm == "gemm1" else i
                        row[gemm] = {"kernel": ev.key, "us": us,
                                     "tb_per_s": active * n_out * n_in * BYTES_PER_PARAM[fmt] / (us * 1e-6) / 1e12}
                    rows.append(row)
                    log(f"decode {shape} {fmt} T={t:3d} E_act={active:3d} {str(row['tile']):10s} " + "  ".join(
                        f"{g} {row[g]['us']:7.1f} us {row[g]['tb_per_s']:.2f} TB/s [{row[g]['kernel']}]"
                        for g in ("gemm1", "gemm2") if g in row))
            del mods
            gc.collect()
            torch.cuda.empty_cache()
    result["decode_kernels"] = rows


def run(args):
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.max_seconds
    props = torch.cuda.get_device_properties(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__, "commit": args.commit or commit,
              "date": args.date, "cells": [], "peers": [], "missing": [], "errors": []}
    ceil = ceilings()
    result["ceilings"] = ceil
    log(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, "
        f"fp8 {(ceil['fp8_flops'] or 0) / 1e12:.0f} TFLOP/s")
    if args.impl == "triton":
        CLASSES.update(TRITON_CLASSES)
    for fmt in K.STAGED if args.staged_plan is not None else ():   # TRITON's classes of the format too
        for cls in {CLASSES[fmt], TRITON_CLASSES.get(fmt, CLASSES[fmt])}:
            cls.STAGED_PLAN = dict(args.staged_plan)
    if args.profile:
        profile(args)
    if args.decode_kernels:
        decode_kernels(args, result)
        (out_dir / "moe_layer.json").write_text(json.dumps(result, indent=1))
    if args.sweep:
        sweep(args, result)
        (out_dir / "moe_layer.json").write_text(json.dumps(result, indent=1))
    if args.triton_sweep:
        triton_sweep(args, result)
        (out_dir / "moe_layer.json").write_text(json.dumps(result, indent=1))
    if args.only_extras:
        return
    hf = hf_functions() if not args.no_hf else {}
    formats = args.formats.split(",")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    routings = args.routing.split(",")
    peer_cache = {}
    if args.peers_from:
        for row in json.loads(Path(args.peers_from).read_text())["peers"]:
            key = (row["shape"], row["tokens"], row["routing"])
            peer_cache[key] = {**peer_cache.get(key, {}),
                               **{n: v for n, v in row.items() if n not in ("shape", "tokens", "routing")}}
    for shape in args.shapes.split(","):
        h, i, e, k = SHAPES[shape]
        spec = MoeShape(h, i, e, k, "silu_glu")
        gen = torch.Generator().manual_seed(1)
        bias = {"uniform": None, "skewed": skew_bias(e, k, h, gen)}
        routers = {r: Router(h, e, k, bias[r]) for r in routings}
        inputs = {}
        for t in tokens_list:
            x = torch.randn(t, h, device="cuda").bfloat16()
            for r in routings:
                with torch.no_grad():
                    ids, _ = routers[r](x)
                inputs[t, r] = (x, active_experts(shape, t, r, ids), ids)
        for fmt in formats:
            if fmt != "bf16" and shape == "tiny":
                continue
            if fmt == "fp8_block_scales" and (h % 128 or i % 128):
                result["missing"].append(f"{shape} {fmt}: hidden {h} / intermediate {i} are not multiples of the "
                                         f"128x128 weight blocks")
                continue
            if time.time() > deadline:
                result["missing"].append(f"{shape} {fmt}: time budget spent")
                continue
            def measure(fmt):
                cls = CLASSES[fmt]
                try:
                    mods = []
                    for c in range(COPIES):
                        m = cls(spec, device="meta").to_empty(device="cuda")
                        fill_module(m, 100 + c)
                        m.prepare("cuda")
                        mods.append(m)
                except Exception as exc:   # noqa: BLE001
                    result["errors"].append(f"{shape} {fmt}: building: {exc!r}")
                    log("ERROR", shape, fmt, exc)
                    return
                for t in tokens_list:
                    for r in routings:
                        if time.time() > deadline:
                            result["missing"].append(f"{shape} {fmt} T={t} {r}: time budget spent")
                            continue
                        x, e_act, ids = inputs[t, r]
                        router = routers[r]
                        # --- peers, once per (shape, T, routing) on the bf16 weights; fp8 rowwise on fp8 ---
                        if fmt == "bf16":
                            peers = {}
                            w13s = [m.w13 for m in mods]
                            w2s = [m.w2 for m in mods]
                            candidates = {"torch_pipeline": lambda j: (lambda: torch_pipeline(x, *router(x), w13s[j], w2s[j]))}
                            for name, fn in hf.items():
                                if name == "hf_batched_mm" and t * k * 3 * h * i * 2 > 8e9:
                                    continue
                                experts = [HFExperts(w13s[j], w2s[j]) for j in range(COPIES)]
                                candidates[name] = (lambda fn, experts: lambda j: (lambda: fn(experts[j], x, *router(x))))(fn, experts)
                            for name, make in candidates.items():
                                try:
                                    with torch.no_grad():
                                        peers[name] = time_graphs([make(j) for j in range(COPIES)])
                                except Exception as exc:   # noqa: BLE001
                                    result["errors"].append(f"peer {name} {shape} T={t} {r}: {exc!r}"[:300])
                                    torch.cuda.synchronize()
                            if t <= 64 and shape != "tiny" or shape == "tiny":
                                try:
                                    with torch.no_grad():
                                        peers["loop_eager"] = time_eager(lambda: loop_pipeline(x, *router(x), w13s[0], w2s[0]))
                                except Exception as exc:   # noqa: BLE001
                                    result["errors"].append(f"peer loop {shape} T={t}: {exc!r}"[:300])
                            peer_cache[shape, t, r] = peers
                            result["peers"].append({"shape": shape, "tokens": t, "routing": r, **peers})
                            log(f"  peers {shape} T={t} {r}: " + ", ".join(f"{n} {v:.1f}" for n, v in peers.items()))
                        if fmt == "fp8_block_scales":
                            try:
                                w13s = [m.w13 for m in mods]
                                w2s = [m.w2 for m in mods]
                                s13 = torch.full((e, 2 * i), 1e-3, device="cuda")
                                s2 = torch.full((e, h), 1e-3, device="cuda")
                                with torch.no_grad():
                                    us = time_graphs([(lambda j: lambda: fp8_rowwise_pipeline(
                                        x, *router(x), w13s[j], s13, w2s[j], s2))(j) for j in range(COPIES)])
                                peer_cache[shape, t, r] = {**peer_cache.get((shape, t, r), {}), "fp8_rowwise_pipeline": us}
                                result["peers"].append({"shape": shape, "tokens": t, "routing": r, "fp8_rowwise_pipeline": us})
                            except Exception as exc:   # noqa: BLE001
                                result["errors"].append(f"peer fp8_rowwise {shape} T={t} {r}: {exc!r}"[:300])
                                torch.cuda.synchronize()
                        # --- ours: the router a build runs, and torch's, as the peers ---
                        try:
                            with torch.no_grad():
                                ours = time_graphs([(lambda m: lambda: m(x, *router.fused(x)))(m) for m in mods])
                                ours_torch_router = time_graphs([(lambda m: lambda: m(x, *router(x)))(m) for m in mods])
                                replay_ok = replay_matches_eager(lambda: mods[0](x, *router.fused(x)))
                        except Exception as exc:   # noqa: BLE001
                            result["errors"].append(f"ours {shape} {fmt} T={t} {r}: {exc!r}"[:300])
                            log("ERROR ours", shape, fmt, t, r, exc)
                            torch.cuda.synchronize()
                            continue
                        path, tile = mods[0].plan(t, k)
                        # the GEMM kernels (split factor included) of replay_matches_eager's eager call, the last one
                        gemms = dict(mods[0].last_gemm_kernels)
                        w_bytes = e_act * 3 * h * i * BYTES_PER_PARAM[fmt]
                        flops = 2 * t * k * 3 * h * i
                        peak = ceil["fp8_flops"] if fmt in FP8_PEAK_FORMATS and ceil["fp8_flops"] else ceil["bf16_flops"]
                        t_lb = max(w_bytes / ceil["copy_bytes_per_s"], flops / peak) * 1e6
                        peers = {n: v for n, v in peer_cache.get((shape, t, r), {}).items()
                                 if n != "fp8_rowwise_pipeline" or fmt in FP8_PEAK_FORMATS}
                        best = min(peers.items(), key=lambda kv: kv[1]) if peers else (None, None)
                        vl = vllm_us(shape, fmt, t, r, result["gpu"])
                        cell = {"shape": shape, "format": fmt, "tokens": t, "routing": r, "ours_us": ours,
                                "ours_torch_router_us": ours_torch_router, "replay_matches_eager": replay_ok,
                                "path": path, "tile": tile, "gemm_kernels": gemms, "active_experts": e_act,
                                "weight_bytes": w_bytes,
                                "flops": flops, "t_lb_us": t_lb, "r_roof": t_lb / ours,
                                "best_peer": best[0], "best_peer_us": best[1],
                                "r_peer": (best[1] / ours) if best[1] else None,
                                "impl": mods[0].IMPL_ID, "vllm_us": vl, "r_peer_vllm": vl / ours if vl else None,
                                "tile_fill": tile_fill(ids, e, tile[0][0]) if path == "triton" else None,
                                "tflops": flops / (ours * 1e-6) / 1e12, "tb_per_s": w_bytes / (ours * 1e-6) / 1e12}
                        result["cells"].append(cell)
                        log(f"{shape} {fmt:16s} T={t:5d} {r:7s} ours {ours:9.1f} us (torch router {ours_torch_router:.1f})  "
                            f"lb {t_lb:8.1f}  "
                            f"R_roof {cell['r_roof']:.2f}  peer {best[0]} {best[1] or 0:.1f}  "
                            f"R_peer {cell['r_peer'] or 0:.2f}  R_peer(vLLM) {cell['r_peer_vllm'] or 0:.2f}  [{path} {tile}]"
                            f"{'' if replay_ok else '  REPLAY DIFFERS FROM EAGER'}")

            measure(fmt)
            gc.collect()
            torch.cuda.empty_cache()
        (out_dir / "moe_layer.json").write_text(json.dumps(result, indent=1))
    (out_dir / "moe_layer.json").write_text(json.dumps(result, indent=1))
    (out_dir / "moe_layer.md").write_text(markdown(result))
    log(markdown(result))


def _kernels(cell) -> str:
    """' [gemm1 kernel, gemm2 kernel]' of a cell that launched moe_gemm kernels (their names carry the warp tile and
    the split-K factor), else ''."""
    names = cell.get("gemm_kernels") or {}
    return f" [{', '.join(names[g] for g in ('gemm1', 'gemm2') if g in names)}]" if names else ""


def _fill_note(cell) -> str:
    """' fill F' of a cell the grouped GEMMs ran: its routed rows over the rows they multiply (tile_fill), else ''."""
    return f" fill {cell['tile_fill']:.2f}" if cell.get("tile_fill") else ""


def markdown(result):
    c = result["ceilings"]
    lines = [f"GPU {result['gpu']} ({result['sms']} SMs), torch {result['torch']}, commit {result['commit']}, "
             f"{result['date']}. Ceilings measured in the same run: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
             f"bf16 {c['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 {(c['fp8_flops'] or 0) / 1e12:.0f} TFLOP/s.", "",
             "| shape | format | routing | tokens | ours µs | replay = eager | ours with torch's router µs | vLLM Triton µs (note) | R_peer vs vLLM | best in-process peer µs (which) | T_lb µs | R_roof | R_peer in-process | TB/s | TFLOP/s | impl, path, tile |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in result["cells"]:
        peer = f"{x['best_peer_us']:.1f} ({x['best_peer']})" if x["best_peer_us"] else "-"
        rpeer = f"{x['r_peer']:.2f}" if x["r_peer"] else "-"
        vl = f"{x['vllm_us']:.0f}" if x.get("vllm_us") else "-"
        rvl = f"{x['r_peer_vllm']:.2f}" if x.get("r_peer_vllm") else "-"
        lines.append(f"| {x['shape']} | {x['format']} | {x['routing']} | {x['tokens']} | {x['ours_us']:.1f} | "
                     f"{'yes' if x['replay_matches_eager'] else 'NO'} | {x['ours_torch_router_us']:.1f} | {vl} | {rvl} | "
                     f"{peer} | {x['t_lb_us']:.1f} | {x['r_roof']:.2f} | {rpeer} | {x['tb_per_s']:.2f} | {x['tflops']:.0f} | "
                     f"{x.get('impl', '')} {x['path']} {x['tile']}{_kernels(x)}{_fill_note(x)} |")
    if VLLM_GPU not in result["gpu"]:
        lines += ["", f"No vLLM time or R_peer vs vLLM: the research note's times are an {VLLM_GPU}'s."]
    if result["missing"]:
        lines += ["", "Not measured: " + "; ".join(result["missing"])]
    if result["errors"]:
        lines += ["", "Errors: " + "; ".join(result["errors"])]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--shapes", default="Q,D,G,tiny")
    p.add_argument("--formats", default="bf16,fp8_block_scales,w4a16_mxfp4,w4a16_nvfp4,w4a8_mxfp4_fp8")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--max-seconds", type=float, default=420)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--sweep", action="store_true", help="time every compiled tile on the prefill cells first")
    p.add_argument("--sweep-tokens", default="256")
    p.add_argument("--impl", choices=("cupy", "triton"), default="cupy",
                   help="whose experts are 'ours': the CUPY classes, or the TRITON ones where a format has one")
    p.add_argument("--triton-sweep", action="store_true", help="time every TRITON_SWEEP configuration first")
    p.add_argument("--profile", action="store_true", help="print per-kernel times of a few cells first")
    p.add_argument("--decode-kernels", action="store_true",
                   help="time the GEMM kernels alone at --shapes/--formats/--tokens first (split-K factors too)")
    p.add_argument("--decode-tiles", default="", type=lambda v: [tuple(map(int, x.split("x"))) for x in v.split(",") if x],
                   help="warp tiles MTxNT (comma-separated, e.g. 1x1,1x2) --decode-kernels also forces at every cell")
    p.add_argument("--only-extras", action="store_true", help="stop after --sweep / --profile / --decode-kernels")
    p.add_argument("--staged-plan", default=None,
                   type=lambda v: {tuple(map(int, a.split("x"))): tuple(None if g == "-" else tuple(map(int, g.split("x")))
                                                                         for g in (b.split("/") * 2)[:2])
                                   for a, b in (x.split("=") for x in v.split(",") if x)},
                   help="the W4A16 classes' STAGED_PLAN for this run: tile=stages[/GEMM2's stages, - for the register "
                        "kernel], e.g. 1x1=8x2,1x2=8x2/- ('' = none)")
    p.add_argument("--peers-from", default="", help="a previous moe_layer.json whose peer times to reuse")
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--commit", default="")
    args = p.parse_args()
    try:
        run(args)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
