"""TRITON experts: the CUPY experts with prefill GEMMs written in Triton (wgmma on sm_90, FP8 at the E4M3 rate).

The CUPY GEMMs are mma.sync kernels that stream weights into registers: right for decode, where
they read weights at up to 4.4 TB/s, but on sm_90 mma.sync runs FP8 as f16 HMMA and bf16 well below
the wgmma rate. Here, once a call routes enough rows per expert (`TRITON_MIN_ROWS`: 2 for FP8, 4 for
bf16, 64 for the 4-bit formats), both GEMMs run
as Triton grouped GEMMs (runtime/kernels/triton_grouped.py) over the same CUPY routing, activation
quantization and combine kernels; smaller calls run the CUPY path unchanged. Same buffers and weight
layouts as the CUPY class of the format (weights stay packed: FP8 codes and block scales, FP4 words decoded
to bf16 in the GEMMs' registers).

Per prefill call, with no host synchronization (CUDA-graph capturable): `moe_align` (tiles of BM
rows of one expert), FP8 activations only: `quant_fp8_rows` of the tokens (1x128 groups, or W4A8's scale per
token), `gemm1` (token rows gathered in its loads, bias, activation, bf16 rounding and, for FP8, the 1x128
quantization of the intermediate in its epilogue), W4A8 only: `quant_fp8_rows` of the intermediate, `gemm2` (bf16
rows), `moe_combine` (down bias, weights, fp32 sum).
Triton is imported on the first prefill call only.
"""
from __future__ import annotations

import torch

from .. import kernels as K
from .cupy_mma import (CupyMmaBf16Experts, CupyMmaFp8BlockScalesExperts, CupyMmaW4a8Mxfp4Fp8Experts,
                       CupyMmaW4a16Mxfp4Experts, CupyMmaW4a16Nvfp4Experts)

_ACT = {"silu_glu": 0, "swiglu_oai": 1, "relu2": 2}
# the packed FP4 Triton tiles (gemm1, gemm2) the 4-bit classes plan with: 128 token rows on 8 warps, 64 on 4
_PACKED_128 = ((128, 64, 64, 8, 3, 8, True), (128, 128, 64, 8, 3, 8, True))
_PACKED_64_4WARPS = ((64, 64, 64, 4, 3, 8, True), (64, 128, 64, 4, 3, 8, True))


class _TritonGroupedExperts:
    """Shape constraints: those of the CUPY class (hidden and per-rank intermediate sizes multiples
    of 64, 128 for fp8_block_scales). Runs on CUDA SM 9.0 only. CUDA-graph capturable (warm it up
    once outside the capture: the first call of each shape compiles the kernels)."""

    # rows per expert (average, uniform routing) from which the Triton GEMMs run; below it the CUPY
    # decode path. Per format, from bench/moe_layer.py --triton-sweep on an H200 (BENCHMARKS.md).
    TRITON_MIN_ROWS: float
    # ((BM, BN, BK, warps, stages, GROUP_M) of gemm1, of gemm2): the first whose rows bound >= rows per
    # expert. The fastest of bench/moe_layer.py --triton-sweep on an H200 (2026-12-01, BENCHMARKS.md).
    CONFIGS: tuple

    def plan(self, tokens: int, top_k: int):
        """('triton', (gemm1 config, gemm2 config)) from `TRITON_MIN_ROWS` rows per expert, else the CUPY plan."""
        rows = tokens * top_k / self.spec.num_experts
        if rows >= self.TRITON_MIN_ROWS:
            for bound, cfg in self.CONFIGS:
                if rows <= bound:
                    return "triton", cfg
            return "triton", self.CONFIGS[-1][1]
        return super().plan(tokens, top_k)

    def forward(self, hidden, topk_ids, topk_weights, path=None, tile=None, staging=None):
        """The contract's forward; `path` ('triton' or a CUPY path), `tile` and `staging` override `plan`."""
        self._check_inputs(hidden, topk_ids, topk_weights)
        tokens, top_k = hidden.shape[0], topk_ids.shape[1]
        auto_path, auto_tile = self.plan(tokens, top_k)
        path = path or auto_path
        if path != "triton":
            if tile is None:
                tile = super().plan(tokens, top_k)[1]
            return super().forward(hidden, topk_ids, topk_weights, path=path, tile=tile, staging=staging)
        cfg1, cfg2 = tile or (auto_tile if auto_path == "triton" else self.CONFIGS[-1][1])
        if cfg1[0] != cfg2[0]:
            raise ValueError(f"{self.IMPL_ID}: both GEMMs walk the same token tiles: BM {cfg1[0]} != {cfg2[0]}")
        return self._forward_triton(hidden, topk_ids, topk_weights, tuple(cfg1), tuple(cfg2))

    def _forward_triton(self, hidden, topk_ids, topk_weights, cfg1, cfg2):
        spec, fmt = self.spec, self.FORMAT
        fp8 = fmt == "fp8_block_scales"
        (tokens, hsize), top_k, device = hidden.shape, topk_ids.shape[1], hidden.device
        launch = self._launch_inputs(hidden, topk_ids, topk_weights)   # refuses a CPU or pre-SM-9.0 device first
        if launch is None:
            return torch.zeros_like(hidden)
        from ..kernels import triton_grouped as T

        if fp8 and cfg1[1] != 128:
            raise ValueError(f"{self.IMPL_ID}: gemm1 quantizes the intermediate per 128 channels: BN must be 128")
        kern, stream, poison, x, ids, weights = launch
        inter, pairs = self.inter_size, tokens * top_k
        max_tiles, offs, sorted_pair, sorted_expert, pair_pos, tile_expert, tile_row, num_tiles, total_ptr = \
            self._route(kern, stream, ids, pairs, cfg1[0])
        a1, as1, hs = x, None, None
        if K.AQ[fmt]:   # FP8 activations: 1x128 groups (FP8) or a scale per token (W4A8)
            a1, as1 = self._quantize_rows(kern, stream, x, tokens, hsize, None, poison)
        if fp8:   # gemm1 quantizes the intermediate in its epilogue
            h = self._empty((pairs, inter), torch.float8_e4m3fn, device, poison)
            hs = self._empty((pairs, inter // 128), torch.float32, device, poison)
        else:
            h = self._empty((pairs, inter), torch.bfloat16, device, poison)
        s13, s2 = (self.s13, self.s2) if fmt != "bf16" else (None, None)
        g13, g2 = (self.g13, self.g2) if fmt == "w4a16_nvfp4" else (None, None)
        T.launch_gemm1(a1, as1, self.w13, s13, g13, self.b13 if spec.expert_bias else None, sorted_pair, offs,
                       tile_expert, tile_row, num_tiles, h, hs, hidden=hsize, inter=inter, top_k=top_k,
                       max_tiles=max_tiles, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit, fmt=fmt,
                       gated=spec.gated, act=_ACT[spec.activation], cfg=cfg1)
        if fmt == "w4a8_mxfp4_fp8":   # its intermediate's scale spans the whole row: a pass after gemm1
            h, hs = self._quantize_rows(kern, stream, h, pairs, inter, total_ptr, poison)
        y = self._empty((pairs, hsize), torch.bfloat16, device, poison)
        T.launch_gemm2(h, hs, self.w2, s2, g2, offs, tile_expert, tile_row, num_tiles, y, hidden=hsize, inter=inter,
                       max_tiles=max_tiles, fmt=fmt, cfg=cfg2)
        return self._combine(kern, stream, y, 1, pair_pos, sorted_expert, weights, tokens, hidden.dtype)


class TritonWgmmaBf16Experts(_TritonGroupedExperts, CupyMmaBf16Experts):
    __doc__ = ("TRITON, bf16 weights and activations: Triton grouped GEMMs for prefill, the CUPY kernels "
               "for decode. " + _TritonGroupedExperts.__doc__)
    IMPL_ID = "triton.wgmma.grouped_gemm.bf16"
    # From 4 rows (64 tokens of the Q shape: a tie with CUPY; at 256 tokens Q, 16 rows, 8 % less time and D,
    # 8 rows, 2-9 %: 2026-12-01); up to 32 rows a 64-row tile on 4 warps, then the 128-row wgmma tile.
    TRITON_MIN_ROWS = 4
    CONFIGS = ((32, ((64, 128, 64, 4, 4, 8), (64, 128, 64, 4, 4, 8))),
               (1e9, ((128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8))))


class TritonWgmmaFp8BlockScalesExperts(_TritonGroupedExperts, CupyMmaFp8BlockScalesExperts):
    __doc__ = ("TRITON, FP8 128x128-block weights and 1x128 dynamic FP8 activations: Triton grouped GEMMs "
               "on E4M3 wgmma for prefill (block scales promoted per 128 channels of K), the CUPY kernels "
               "for decode. " + _TritonGroupedExperts.__doc__)
    IMPL_ID = "triton.wgmma.grouped_gemm.fp8_block_scales"
    # From 2 rows (64 tokens of the D shape: 6 % less time than CUPY; Q at 256 tokens, 16 rows: 32 % less,
    # 2026-12-01); up to 16 rows a 16-row tile (mma.sync, 4 warps), then the 64-row wgmma tile. Above 64 rows the
    # warp-specialized Gluon kernels (the eighth element: runtime/kernels/gluon_fp8.py, 128 token rows, two MMA
    # warpgroups, gemm2 persistent): the same bits; against the 64-row tile 442 vs 462-464 us at Q 2048 (128 rows),
    # 1156-1179 vs 1376-1390 at Q 8192, 8945-9037 vs 11489-11670 at D 8192 (H100, 2026-12-06, BENCHMARKS.md); a
    # tie at D 2048 (64 rows). Its 64-row tile (one MMA warpgroup) was 35 % slower at Q 8192, w2 blocks of 256
    # columns 3 % (they spill). Its gemm1 gathers the token rows itself (cp.async): 4-6 % less time at Q 2048 and
    # 8192 than putting them in sorted order first, none at D 8192 (H100, 2026-12-06).
    TRITON_MIN_ROWS = 2
    CONFIGS = ((16, ((16, 128, 128, 4, 4, 8), (16, 128, 128, 4, 4, 8))),
               (64, ((64, 128, 128, 8, 3, 8), (64, 128, 128, 4, 4, 8))),
               (1e9, ((128, 128, 128, 8, 4, 8, False, True), (128, 128, 128, 8, 4, 8, False, True))))


class TritonWgmmaW4a16Mxfp4Experts(_TritonGroupedExperts, CupyMmaW4a16Mxfp4Experts):
    __doc__ = ("TRITON, MXFP4 weights kept packed (the CUPY layout) and decoded to bf16 in the Triton GEMMs' "
               "registers for prefill, the CUPY kernels for decode. " + _TritonGroupedExperts.__doc__)
    IMPL_ID = "triton.wgmma.grouped_gemm.w4a16_mxfp4"
    # From 64 rows: the overlapped 64-row tile (the eighth element: runtime/kernels/gluon_w4.py, two CTAs an SM) is
    # 12 % faster than CUPY at G 2048 (64 rows; 2189 against 2500 us) and 2 % faster than the packed Triton tile at
    # Q 2048 and G 8192 (128, 256 rows); from 512 rows (Q 8192) the packed 128-row Triton tile is 5 % faster
    # (H100, 2026-12-06, BENCHMARKS.md). The overlapped 128-row tile (one CTA an SM) is 3-13 % slower than the
    # packed one.
    # GEMM1 on 64-channel blocks (128 w13 rows): 256 rows are 5-10 % slower (H100, 2026-12-05). The packed decode
    # (the seventh element: bf16x2 pairs, the same bits) is 3-7 % faster than the unpacked one, which is what
    # Triton's CPU interpreter runs.
    TRITON_MIN_ROWS = 64
    CONFIGS = ((256, ((64, 64, 64, 8, 4, 8, True, True), (64, 128, 64, 8, 4, 8, True, True))), (1e9, _PACKED_128))


class TritonWgmmaW4a16Nvfp4Experts(_TritonGroupedExperts, CupyMmaW4a16Nvfp4Experts):
    __doc__ = ("TRITON, NVFP4 weights kept packed (the CUPY layout) and decoded to bf16 in the Triton GEMMs' registers "
               "with their E4M3 block scales, the per-expert scales in the epilogue, for prefill; the CUPY kernels "
               "for decode. " + _TritonGroupedExperts.__doc__)
    IMPL_ID = "triton.wgmma.grouped_gemm.w4a16_nvfp4"
    # The packed tiles (no overlapped kernel: the Gluon one decodes E8M0 scales of the BF16_WORD layout only).
    # bench/moe_layer.py --triton-sweep (H100, 2026-12-07, BENCHMARKS.md), us, against CUPY: from 64 to 128 rows the
    # 64-row tile on 4 warps (G 2048, 64 rows: 2547 vs CUPY's 2698; Q 2048, 128 rows: 901 vs 996), above them the
    # 128-row tile (Q 8192, 512 rows: 2501 vs 3324; G 8192, 256 rows: 6432 vs 7820, where the 4-warp tile takes 7465).
    TRITON_MIN_ROWS = 64
    CONFIGS = ((128, _PACKED_64_4WARPS), (1e9, _PACKED_128))


class TritonWgmmaW4a8Mxfp4Fp8Experts(_TritonGroupedExperts, CupyMmaW4a8Mxfp4Fp8Experts):
    __doc__ = ("TRITON, MXFP4 weights kept packed (the CUPY w4a8 layout) and decoded to bf16 in the Triton GEMMs' "
               "registers, FP8 activations with a scale per token widened to bf16 (exact) and their scales applied in "
               "the epilogue, for prefill; the CUPY kernels for decode. " + _TritonGroupedExperts.__doc__)
    IMPL_ID = "triton.wgmma.grouped_gemm.w4a8_mxfp4_fp8"
    # From 64 rows the packed 64-row tile on 4 warps at every size: bench/moe_layer.py --triton-sweep (H100,
    # 2026-12-07, BENCHMARKS.md), us, against CUPY: Q 2048 932 vs 1156, Q 8192 2941 vs 4085, G 2048 2579 vs 3049,
    # G 8192 7484 vs 10298; NVFP4's 128-row tile takes 3944 and 11029 at the 8192-token cells.
    TRITON_MIN_ROWS = 64
    CONFIGS = ((1e9, _PACKED_64_4WARPS),)
