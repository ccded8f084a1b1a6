"""The CUPY experts' host-side plan: which path, warp tile and split-K factor a call of a given shape runs."""
from __future__ import annotations

import math

from .. import kernels as K

# A GEMM item's fixed cost in 64-chunks of K walked (the split-K rule's model, `CupyPlan._split`). Any value above 8, up
# to 56, picks the faster factor in every cell timed with each factor forced on the H200 (BENCHMARKS.md: the
# 4-bit decode GEMMs of the eleventh session, deepseek_v3's FP8 GEMMs at one token of the fourteenth: gate/up
# SK = 2, down SK = 1); the ratios of those times fit 2.6 to 38, so the model ranks factors, it does not
# predict times.
_ITEM_OVERHEAD_CHUNKS = 12


def row_blocks(n: int, tile) -> int:
    """Output-row blocks of one token tile for a GEMM of `n` rows: each CTA's 4 warps form 4 / SK groups of MT
    16-row m-tiles (tile = (MT, NT) or (MT, NT, SK); moe_kernels.cu's `nblocks`)."""
    sk = tile[2] if len(tile) > 2 else 1
    return math.ceil(n // 16 / (4 // sk * tile[0]))


class CupyPlan:
    """The choices of the CUPY experts classes (runtime/experts/cupy_mma.py), made on the host from the call's
    shape alone, so that a CUDA graph of that shape replays them."""

    # weight bytes the pairs path may read again (experts shared by several pairs) before the sort pays (`_pairs_pay`):
    # about what moe_align's launch costs. Timed with bench/moe_layer.py at 1 MiB and at 8 MiB on one GPU, Qwen3's
    # experts at 2 to 5 tokens in every CUPY format: each cell that 8 MiB moves to the pairs path ran as fast or
    # faster, 2-6 µs (BENCHMARKS.md, twenty-second session)
    PAIRS_MAX_EXTRA_BYTES = 8 << 20
    # rows per expert (average) from which bf16 layers use torch._grouped_mm for both GEMMs
    GROUPED_MM_MIN_ROWS = 64
    # token tile (1, NT) -> (GEMM1's, GEMM2's) (KC, ST): the sorted path's tiles that `plan` runs on the staged GEMM
    # (kernels.STAGED; W4A16 formats), with KC chunks of K a stage and ST stages (None: that GEMM runs the register
    # kernel); the other tiles run the register GEMM
    STAGED_PLAN: dict = {}

    def plan(self, tokens: int, top_k: int) -> tuple[str, tuple[int, int]]:
        """('pairs' | 'grouped_mm' | 'kernels', warp tile) for a call with `tokens` tokens: a host-side
        choice on the shape only (fixed for a CUDA graph of that shape); 'pairs' for one token and for a few
        tokens on small experts (`_pairs_pay`)."""
        if self._pairs_pay(tokens, top_k):
            return "pairs", K.SPLIT_TILE
        rows = tokens * top_k / self.spec.num_experts   # expected rows per expert, uniform routing
        # size the token tile for a busy expert (mean + 2 sigma of a Poisson count): an expert whose
        # rows overflow the tile streams its weights once more
        busy = rows + 2 * math.sqrt(rows)
        tiles = K.tiles(self.FORMAT)
        tile = tiles[-1]
        for candidate in tiles:
            if busy <= 8 * candidate[1]:
                tile = candidate
                break
        if self.FORMAT == "bf16" and self.GROUPED_MM_MIN_ROWS is not None and rows >= self.GROUPED_MM_MIN_ROWS:
            return "grouped_mm", tile
        return ("staged" if tile in self.STAGED_PLAN else "kernels"), tile

    def _pairs_pay(self, tokens: int, top_k: int) -> bool:
        """Whether the pairs path (no sort: every routing pair its own tile) pays for `tokens` tokens. A pair reads its
        expert's weights itself, so an expert that several pairs share is read once per pair: the pairs beyond the
        expected number of distinct experts (uniform routing) read that many experts' bytes again. At one token
        there are none; the sort's launch costs less than `PAIRS_MAX_EXTRA_BYTES` of re-reads."""
        experts = self.spec.num_experts
        distinct = experts * (1 - (1 - top_k / experts) ** tokens)
        expert_bytes = sum(t.numel() * t.element_size() for t in (self.w13, self.w2)) / max(len(self.expert_ids), 1)
        return (tokens * top_k - distinct) * expert_bytes <= self.PAIRS_MAX_EXTRA_BYTES

    def _split(self, kern, epi, tile, pairs, n, k, pair_tiles: bool = False):
        """`tile` with the split-K factor of this GEMM (`n` rows, K = `k`): the one of least modelled time,
        waves x (chunks of K per warp + _ITEM_OVERHEAD_CHUNKS). A wave is one item for every resident CTA
        (for the most token tiles `pairs` routed rows can make); a warp walks its 1/SK of K's 64-chunks and
        pays a fixed cost per item (its loads' first latency, the epilogue, split K's barrier). Where the
        largest split fits one wave, it wins: a decode call with few active experts spreads K over more
        warps instead of leaving SMs idle (split within one wave 27-29 % faster, BENCHMARKS.md). Where even
        SK = 1 takes more than one wave, a split wins only when it fills the last wave better: SK = 1's
        1.29 waves at deepseek_v3's one-token gate/up leave 70 % of the CTAs idle in the second (SK = 2:
        75.6 -> 71.0 µs). Host-side, from the shape only (CUDA graphs)."""
        if len(tile) > 2:
            return tuple(tile)
        # token tiles <= m + (pairs - m) // bt, m = min(experts, pairs): every active expert's first
        # tile, plus one per further bt rows (tighter than _route's allocation bound)
        bt = 8 * tile[1]
        m = min(len(self.expert_ids), pairs)
        tiles = m + (pairs - m) // bt

        def cost(sk):
            split = (*tile, sk)
            grid = kern.persistent_grid(K.gemm_name(self.FORMAT, epi, split, pairs=pair_tiles), 1 << 30)
            waves = -(-tiles * row_blocks(n, split) // grid)
            return waves * (k / 64 / sk + _ITEM_OVERHEAD_CHUNKS)

        return (*tile, min((1,) + K.splits(tile), key=lambda sk: (cost(sk), -sk)))
