"""CUPY experts: the routed MoE op in CUDA kernels compiled through CuPy for Hopper (runtime/kernels).

Per call, with no host synchronization (CUDA-graph capturable):
  1. `moe_align` counting-sorts the (token, slot) pairs by local expert and lists token tiles (one CTA;
     calls of more than 2048 pairs: `moe_align_count` and `moe_align_scatter`, a CTA per 2048 pairs);
  2. FP8 formats quantize the token rows once (1x128 groups or per token);
  3. GEMM1 (gate/up) with the activation fused in its epilogue writes the bf16 intermediate;
  4. FP8 formats quantize the intermediate;
  5. GEMM2 (down) writes fp32 rows; 6. `moe_combine` adds the down bias, weighs and sums each
     token's rows in fp32 and rounds once to bf16.
A one-token call (a batch-1 decode step) takes the `pairs` path: each routing pair is its own tile
(the `_pairs` GEMMs read the expert from the ids, and y's rows are the pairs), step 1 is skipped and
GEMM2 runs step 6 too (the last of a token's pairs to finish 16 channels combines them); the same
values with two launches fewer. Its top-k experts are distinct; a call of
more tokens takes it too while the experts its pairs share are cheap to read again (`_pairs_pay`).
The GEMMs are `moe_gemm` (tensor-core mma.sync, weights streamed from HBM into registers and
dequantized there, so quantized weights stay packed on the device); the W4A16 decode tiles run its staged
variant (`path` 'staged': a producer warp copies weights and token rows into shared memory ahead of the
warps that compute, same results bit for bit). bf16 layers with many rows per
expert (prefill) run both GEMMs through `torch._grouped_mm` instead (~600 TFLOP/s here), keeping the
kernels for routing, gather, activation and combine.

Activations run in bf16 (hidden states of another dtype are converted). Weights are re-laid out
once at load (gate/up rows interleaved; FP4 bits rearranged and rows tiled by 16 x 64:
runtime/kernels/layouts.py).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .. import kernels as K
from ..graphs import kernel_counters
from .base import ExpertParallel, ExpertsBase, MoeShape
from .cupy_layout import buffer_specs, convert
from .cupy_plan import CupyPlan, row_blocks

_ACT_KIND = {"silu_glu": 0, "swiglu_oai": 1, "relu2": 0}
_MAX_LOCAL_EXPERTS = 1024   # moe_align: one thread per local expert
# pairs per CTA of the multi-CTA sort (moe_align_count / _scatter); calls with at most this many pairs
# (decode) sort in one CTA, one launch
_ALIGN_CTA_PAIRS = 2048


def _p(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


_i, _f = np.int32, np.float32   # kernel int and float arguments


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """The token tiles of one call's GEMMs over its `routed` (token, slot) pairs: moe_align's (`count`
    bounds them; `args`: its sorted pairs, expert offsets, tile experts, tile rows and tile count) or,
    `by_pair`, the pairs themselves (`args`: the ids, the local-expert map, the experts and the pairs)."""
    count: int
    args: tuple
    routed: int
    by_pair: bool = False


class _CupyMmaExperts(CupyPlan, ExpertsBase):
    """Shape constraints: hidden size and this rank's intermediate size multiples of 64 (128 for
    fp8_block_scales: the weight blocks), at most 1024 local experts. Runs on CUDA SM 9.0 only; the
    host CPU is refused. CUDA-graph capturable (warm it up once outside the capture: the first call
    compiles the kernels)."""

    # fill the workspaces and the output with NaN before each call (tests: catches unwritten reads)
    debug_poison = False
    # warp tiles compiled besides `plan`'s (for `forward(..., tile=)` measurements)
    extra_tiles: tuple[tuple[int, int], ...] = ()

    def __init__(self, spec: MoeShape, parallel: ExpertParallel = ExpertParallel(), device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__(spec, parallel, device, dtype)
        self._local_maps: dict = {}
        self._align_tickets: dict = {}
        self._combine_counters: dict = {}
        # the moe_gemm kernels the last call launched, "gemm1" / "gemm2" -> name (the split factor included), so
        # that a benchmark reports what ran; empty after a call that launched none (grouped_mm, Triton)
        self.last_gemm_kernels: dict[str, str] = {}

    # --- layout -----------------------------------------------------------------------------------
    @property
    def _unit(self) -> int:
        return 128 if self.FORMAT == "fp8_block_scales" else 64

    def _extra_size_checks(self):
        unit = self._unit
        problems = [f"{name} {size} is not a multiple of {unit} (kernel K-chunks)"
                    for name, size in (("hidden_size", self.spec.hidden_size),
                                       ("the per-rank intermediate size", self.inter_size)) if size % unit]
        n_local = len(self.parallel.local_experts(self.spec.num_experts))
        if n_local > _MAX_LOCAL_EXPERTS:
            problems.append(f"{n_local} local experts exceed {_MAX_LOCAL_EXPERTS}")
        return problems

    def _buffer_specs(self):
        return buffer_specs(self.FORMAT, self.spec, len(self.expert_ids), self.inter_size)

    def _convert(self, staged, device):
        return convert(self.FORMAT, self.spec, self.expert_ids, staged, device)

    # --- kernels ----------------------------------------------------------------------------------
    def _kernels(self, device) -> K.Kernels:
        epi1 = K.EPI_GATED if self.spec.gated else K.EPI_RELU2
        return K.load(K.gemm_instances(self.FORMAT, (epi1, K.EPI_DOWN), self.extra_tiles), device)

    def _local_map(self, device) -> torch.Tensor:
        local = self._local_maps.get(device)
        if local is None:
            table = torch.full((self.spec.num_experts,), -1, dtype=torch.int32)
            table[list(self.expert_ids)] = torch.arange(len(self.expert_ids), dtype=torch.int32)
            local = self._local_maps[device] = table.to(device)
        return local

    def _align_ticket(self, device) -> torch.Tensor:
        """The counter `moe_align_count`'s CTAs take a number from (zero between calls: its last CTA resets it)."""
        ticket = self._align_tickets.get(device)
        if ticket is None:
            ticket = self._align_tickets[device] = kernel_counters(1, device, f"{type(self).__name__}'s moe_align_count")
        return ticket

    def _pair_counters(self, device, tokens: int) -> torch.Tensor:
        """The pair GEMM2's fused-combine counters, one per token and 16 channels (zero between calls), a set per
        call size: a CUDA graph keeps the set its capture used."""
        size = tokens * (self.spec.hidden_size // 16)
        counters = self._combine_counters.get((device, size))
        if counters is None:
            counters = self._combine_counters[(device, size)] = kernel_counters(
                size, device, f"{type(self).__name__}'s fused combine")
        return counters

    def prepare(self, device=None) -> None:
        """Compile the kernels and upload the routing tables now (before any CUDA-graph capture)."""
        device = torch.device(device) if device is not None else self._device()
        self._kernels(device)
        self._local_map(device)
        self._align_ticket(device)

    def _empty(self, shape, dtype, device, poison):
        t = torch.empty(shape, dtype=dtype, device=device)
        if poison:
            if dtype in (torch.uint8, torch.float8_e4m3fn):
                t.view(torch.uint8).fill_(0xFF)     # E4M3 NaN
            else:
                t.fill_(float("nan"))
        return t

    # --- forward ----------------------------------------------------------------------------------
    def _launch_inputs(self, hidden, topk_ids, topk_weights):
        """What every GPU path of a forward starts from: the kernels, the stream, the poison flag and the
        contiguous operands; None when there is nothing to compute (no tokens, or no experts on this rank)."""
        self.last_gemm_kernels = {}
        if hidden.shape[0] == 0 or not self.expert_ids:
            return None
        device = hidden.device
        if device.type != "cuda":
            raise RuntimeError(f"{self.IMPL_ID} runs on a CUDA GPU (SM 9.0), not on {device}")
        return (self._kernels(device), torch.cuda.current_stream(device).cuda_stream, self.debug_poison,
                hidden.to(torch.bfloat16).contiguous(), topk_ids.to(torch.int64).contiguous(),
                topk_weights.to(torch.float32).contiguous())

    def _staging(self, tile, staging):
        """(GEMM1's, GEMM2's) (KC, ST) of the staged GEMMs of `tile` (kernels.staged_pair), or refused by name."""
        pair = K.staged_pair(self.FORMAT, tile, staging, self.STAGED_PLAN.get(tuple(tile)))
        if pair is None:
            compiled = ", ".join(f"tile (1, {nt}) with {kc} x {st}" for nt, kc, st in K.STAGED.get(self.FORMAT, ()))
            raise ValueError(f"{self.IMPL_ID}: no staged GEMM for tile {tuple(tile)} with stages {staging} "
                             f"(compiled: {compiled or 'none'})")
        return pair

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                path: str | None = None, tile: tuple[int, int] | None = None,
                staging: tuple[int, int] | None = None) -> torch.Tensor:
        """The contract's forward; `path`, `tile` and `staging` override `plan` (tests and measurements):
        path 'staged' runs the sorted path's GEMMs in the staged kernel of `tile` with `staging` (KC, ST), or as
        STAGED_PLAN says for that tile."""
        self._check_inputs(hidden, topk_ids, topk_weights)
        spec, fmt = self.spec, self.FORMAT
        (tokens, hsize), top_k, device = hidden.shape, topk_ids.shape[1], hidden.device
        launch = self._launch_inputs(hidden, topk_ids, topk_weights)
        if launch is None:
            return torch.zeros_like(hidden)
        kern, stream, poison, x, ids, weights = launch
        inter = self.inter_size
        n1 = 2 * inter if spec.gated else inter
        pairs = tokens * top_k
        auto_path, auto_tile = self.plan(tokens, top_k)
        if auto_path == "pairs" and tile is not None and tuple(tile[:2]) != K.SPLIT_TILE:
            auto_path = "kernels"   # a forced tile the pair kernels lack runs the sorted path
        if auto_path == "staged" and tile is not None and staging is None and tuple(tile) not in self.STAGED_PLAN:
            auto_path = "kernels"   # a forced tile the plan does not stage (a split factor) runs the register GEMM
        path, tile = path or auto_path, tuple(tile or auto_tile)
        staging = self._staging(tile, staging) if path == "staged" else (None, None)
        if path == "pairs":
            if tile[:2] != K.SPLIT_TILE:
                raise ValueError(f"{self.IMPL_ID}: the pairs path runs the {K.SPLIT_TILE} warp tile, not {tile}")
            local = self._local_map(device)
            tiles = _Tiles(pairs, (_p(ids), _p(local), _i(spec.num_experts), _i(pairs)), pairs, by_pair=True)
            total_ptr = None
        else:
            max_tiles, offs, sorted_pair, sorted_expert, pair_pos, tile_expert, tile_row, num_tiles, total_ptr = \
                self._route(kern, stream, ids, pairs, 8 * tile[1])
            tiles = _Tiles(max_tiles, (_p(sorted_pair), _p(offs), _p(tile_expert), _p(tile_row), _p(num_tiles)), pairs)
        kind, alpha, limit = _ACT_KIND[spec.activation], spec.swiglu_alpha, spec.swiglu_limit
        b13 = self.b13 if spec.expert_bias else None

        if path == "grouped_mm":
            if fmt != "bf16":
                raise ValueError(f"{self.IMPL_ID}: the grouped_mm path serves bf16 layers only")
            rows = self._empty((pairs, hsize), torch.bfloat16, device, poison)
            kern.launch("gather_rows", (pairs,), (128,),
                        (_p(x), _p(sorted_pair), total_ptr, _p(rows), _i(hsize), _i(top_k)), stream)
            ends = offs[1:]
            gu = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=ends)
            h = self._empty((pairs, inter), torch.bfloat16, device, poison)
            kern.launch("act_rows", (pairs,), (128,),
                        (_p(gu), _p(b13), _p(sorted_expert), total_ptr, _p(h), _i(inter), _i(int(spec.gated)),
                         _i(kind), _f(alpha), _f(limit)), stream)
            y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=ends)
            y_bf16 = 1
        else:
            aq = K.AQ[fmt]
            a1, as1 = x, None
            if aq:
                a1, as1 = self._quantize_rows(kern, stream, x, tokens, hsize, None, poison)
            h = self._empty((pairs, inter), torch.bfloat16, device, poison)
            epi1 = K.EPI_GATED if spec.gated else K.EPI_RELU2
            ws2_13 = self.g13 if fmt == "w4a16_nvfp4" else None
            ws2_2 = self.g2 if fmt == "w4a16_nvfp4" else None
            s13 = self.s13 if fmt != "bf16" else None
            s2 = self.s2 if fmt != "bf16" else None
            # the pair GEMMs' last arguments: GEMM2's fused combine (weights, down bias, output, counters); none for GEMM1
            no_combine = (_p(None),) * 4 if tiles.by_pair else ()
            self._gemm(kern, stream, epi1, tile, tiles, self.w13, s13, ws2_13, a1, as1, 1, b13, h, n1, hsize, inter,
                       top_k, kind, alpha, limit, staging[0], no_combine)
            a2, as2 = h, None
            if aq:
                a2, as2 = self._quantize_rows(kern, stream, h, pairs, inter, total_ptr, poison)
            y = self._empty((pairs, hsize), torch.float32, device, poison)
            combine = ()
            if tiles.by_pair:
                out = self._empty((tokens, hsize), torch.bfloat16, device, poison)
                b2 = self.b2 if self.adds_down_bias else None
                combine = (_p(weights), _p(b2), _p(out), _p(self._pair_counters(device, tokens)))
            self._gemm(kern, stream, K.EPI_DOWN, tile, tiles, self.w2, s2, ws2_2, a2, as2, 0, None, y, hsize, inter,
                       inter, top_k, kind, alpha, limit, staging[1], combine)
            if tiles.by_pair:
                return out if hidden.dtype == torch.bfloat16 else out.to(hidden.dtype)
            y_bf16 = 0

        return self._combine(kern, stream, y, y_bf16, pair_pos, sorted_expert, weights, tokens, hidden.dtype)

    def _quantize_rows(self, kern, stream, rows, count, width, total_ptr, poison):
        """`quant_fp8_rows`: E4M3 codes (float8_e4m3fn) and fp32 scales of `count` bf16 rows of `width` (the first
        *total_ptr of them when given), per 128 channels (fp8_block_scales) or per row (w4a8_mxfp4_fp8)."""
        aq = K.AQ[self.FORMAT]
        codes = self._empty((count, width), torch.float8_e4m3fn, rows.device, poison)
        scales = self._empty((count, width // 128) if aq == 1 else (count,), torch.float32, rows.device, poison)
        kern.launch("quant_fp8_rows", (count,), (128,),
                    (_p(rows), np.uint64(0) if total_ptr is None else total_ptr, _p(codes), _p(scales), _i(width),
                     _i(aq)), stream)
        return codes, scales

    def _route(self, kern, stream, ids, pairs, bt):
        """`moe_align` into fresh int32 workspaces: the pairs counting-sorted by local expert and the
        token tiles of `bt` rows. Returns (max_tiles, offs, sorted_pair, sorted_expert, pair_pos,
        tile_expert, tile_row, num_tiles, pointer to offs[n_local] = the routed rows in all)."""
        device, n_local = ids.device, len(self.expert_ids)
        max_tiles = pairs // bt + min(n_local, pairs)
        ctas = -(-pairs // _ALIGN_CTA_PAIRS)
        offs = torch.empty(n_local + 1, dtype=torch.int32, device=device)
        # one workspace: sorted_pair, sorted_expert, pair_pos, tile_expert, tile_row, num_tiles and, for the
        # multi-CTA sort, its per-CTA counts
        sizes = (pairs, pairs, pairs, max_tiles, max_tiles, 1, ctas * n_local if ctas > 1 else 0)
        sorted_pair, sorted_expert, pair_pos, tile_expert, tile_row, num_tiles, counts = \
            torch.empty(sum(sizes), dtype=torch.int32, device=device).split(sizes)
        total_ptr = np.uint64(offs.data_ptr() + 4 * n_local)
        routing = (_p(ids), _p(self._local_map(device)), _i(self.spec.num_experts), _i(pairs), _i(n_local))
        if ctas == 1:
            kern.launch("moe_align", (1,), (1024,),
                        routing + (_i(bt), _p(offs), _p(sorted_pair), _p(sorted_expert), _p(pair_pos), _p(tile_expert),
                                   _p(tile_row), _p(num_tiles)), stream)
        else:
            kern.launch("moe_align_count", (ctas,), (1024,),
                        routing + (_i(bt), _i(_ALIGN_CTA_PAIRS), _p(counts), _p(self._align_ticket(device)), _p(offs),
                                   _p(tile_expert), _p(tile_row), _p(num_tiles)), stream)
            kern.launch("moe_align_scatter", (ctas,), (1024,),
                        routing + (_i(_ALIGN_CTA_PAIRS), _p(counts), _p(sorted_pair), _p(sorted_expert), _p(pair_pos)),
                        stream)
        return max_tiles, offs, sorted_pair, sorted_expert, pair_pos, tile_expert, tile_row, num_tiles, total_ptr

    def _combine(self, kern, stream, y, y_bf16, pair_pos, sorted_expert, weights, tokens, dtype):
        """`moe_combine`: each token's rows of `y` (sorted order) plus the down bias, weighed, summed in fp32 and
        rounded once to bf16; returned in `dtype`. (The pairs path combines in its GEMM2.)"""
        hsize, b2 = self.spec.hidden_size, self.b2 if self.adds_down_bias else None
        out = self._empty((tokens, hsize), torch.bfloat16, y.device, self.debug_poison)
        kern.launch("moe_combine", (math.ceil(hsize / 1024), tokens), (256,),
                    (_p(y), _i(y_bf16), _p(pair_pos), _p(sorted_expert), _p(weights), _p(b2), _p(out),
                     _i(hsize), _i(weights.shape[1])), stream)
        return out if dtype == torch.bfloat16 else out.to(dtype)

    def _gemm(self, kern, stream, epi, tile, tiles: _Tiles, w, ws, ws2, a, a_scale, a_by_token, bias, out, n, k,
              inter, top_k, kind, alpha, limit, staging=None, combine=()):
        if staging is None:
            tile = self._split(kern, epi, tile, tiles.routed, n, k, tiles.by_pair)
            name, threads, smem = K.gemm_name(self.FORMAT, epi, tile, pairs=tiles.by_pair), 128, 0
        else:
            name = K.gemm_name(self.FORMAT, epi, tile, staging=staging)
            threads, smem = K.STAGED_THREADS, K.staged_smem(K.WF[self.FORMAT], tile[1], *staging)
        self.last_gemm_kernels["gemm2" if epi == K.EPI_DOWN else "gemm1"] = name
        grid = kern.persistent_grid(name, tiles.count * row_blocks(n, tile), threads, smem)
        kern.launch(name, (grid,), (threads,),
                    (_p(w), _p(ws), _p(ws2), _p(a), _p(a_scale), _i(a_by_token), *tiles.args, _p(bias), _p(out),
                     _i(n), _i(k), _i(inter), _i(top_k), _i(kind), _f(alpha), _f(limit), *combine), stream, smem)


class CupyMmaBf16Experts(_CupyMmaExperts):
    __doc__ = "CUPY, bf16 weights and activations. " + _CupyMmaExperts.__doc__
    IMPL_ID = "cupy.mma.grouped_gemm.bf16"
    FORMAT = "bf16"


class CupyMmaFp8BlockScalesExperts(_CupyMmaExperts):
    __doc__ = ("CUPY, FP8 128x128-block weights and 1x128 dynamic FP8 activations on E4M3 tensor cores, "
               "block scales applied per 128 channels of K. " + _CupyMmaExperts.__doc__)
    IMPL_ID = "cupy.mma.grouped_gemm.fp8_block_scales"
    FORMAT = "fp8_block_scales"


class CupyMmaW4a16Mxfp4Experts(_CupyMmaExperts):
    __doc__ = ("CUPY, MXFP4 weights kept packed and dequantized to bf16 in registers, bf16 activations. "
               + _CupyMmaExperts.__doc__)
    IMPL_ID = "cupy.mma.grouped_gemm.w4a16_mxfp4"
    FORMAT = "w4a16_mxfp4"
    STAGED_PLAN = K.W4A16_STAGED_PLAN


class CupyMmaW4a8Mxfp4Fp8Experts(_CupyMmaExperts):
    __doc__ = ("CUPY, MXFP4 weights turned into E4M3 in registers (exact), FP8 per-token activations, "
               "E4M3 tensor cores with the MX scale applied per 32 channels. " + _CupyMmaExperts.__doc__)
    IMPL_ID = "cupy.mma.grouped_gemm.w4a8_mxfp4_fp8"
    FORMAT = "w4a8_mxfp4_fp8"


class CupyMmaW4a16Nvfp4Experts(_CupyMmaExperts):
    __doc__ = ("CUPY, NVFP4 weights kept packed and dequantized to bf16 in registers, bf16 activations. "
               + _CupyMmaExperts.__doc__)
    IMPL_ID = "cupy.mma.grouped_gemm.w4a16_nvfp4"
    FORMAT = "w4a16_nvfp4"
    STAGED_PLAN = K.W4A16_STAGED_PLAN
