"""TORCH experts: one grouped GEMM per projection over tokens sorted by expert (`torch._grouped_mm`).

Both GEMMs run on bf16 operands with fp32 accumulation. FP8 block weights become bf16 once, at load;
MXFP4/NVFP4 weights stay packed as loaded and each GEMM dequantizes them a bounded chunk at a time
(`_PackedGroupedMmExperts`). It publishes only the formats whose activations it computes faithfully:
bf16, the W4A16 formats, and fp8_block_scales, whose activations it quantizes and dequantizes per
1x128 group before each GEMM. It also consumes dynamic EPLB plans (`set_eplb_plan`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import activations
from ..formats.fp8 import qdq_act_groups
from .base import ExpertParallel, ExpertsBase, MoeShape
from .canonical import WEIGHT_PARTS, dequantize_canonical

# torch._grouped_mm wants 16-byte aligned strides, on CPU as on CUDA: with bf16 operands every
# K and N of both GEMMs (hidden size, this rank's intermediate size) is a multiple of 8.
ALIGN = 8


class _GroupedMmExperts(ExpertsBase):
    """Shape constraints: hidden_size and intermediate_size / moe_tp_size multiples of 8 (16-byte
    strides for `torch._grouped_mm`). CUDA needs SM 9.0 or newer; CPU runs anywhere. CUDA-graph
    capturable: every (token, k) pair is permuted, the pairs of other ranks' experts sorted last, past
    the last group offset, and their rows masked out, so no count is read back."""

    def __init__(self, spec: MoeShape, parallel: ExpertParallel = ExpertParallel(), device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__(spec, parallel, device, dtype)
        self._plan: tuple[int, ...] | None = None
        self._index_cache: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _extra_size_checks(self):
        return [f"{name} {size} is not a multiple of {ALIGN} (torch._grouped_mm strides)"
                for name, size in (("hidden_size", self.spec.hidden_size),
                                   ("the per-rank intermediate size", self.inter_size)) if size % ALIGN]

    def _buffer_specs(self):
        n, h, i = len(self.expert_ids), self.spec.hidden_size, self.inter_size
        first = len(self.spec.projections) - 1
        specs = self._weight_specs()
        if self.spec.expert_bias:
            specs.update(b13=((n, first * i), torch.bfloat16), b2=((n, h), torch.bfloat16))
        return specs

    def _weight_specs(self):
        n, h, i = len(self.expert_ids), self.spec.hidden_size, self.inter_size
        first = len(self.spec.projections) - 1
        return {"w13": ((n, first * i, h), torch.bfloat16), "w2": ((n, h, i), torch.bfloat16)}

    def _convert(self, staged, device):
        def stacked(proj, kind):
            return torch.stack([staged[e, proj, kind] for e in self.expert_ids]).to(device)

        first = self.spec.projections[:-1]
        new = self._convert_weights(stacked)
        if self.spec.expert_bias:
            new["b13"] = torch.cat([stacked(p, "bias") for p in first], dim=1)
            new["b2"] = stacked("down", "bias")
        return new

    def _convert_weights(self, stacked):
        def weight(proj):
            parts = {t.kind: stacked(proj, t.kind) for t in self.tensors
                     if t.proj == proj and t.kind in WEIGHT_PARTS}
            return dequantize_canonical(self.FORMAT, parts, torch.bfloat16)

        return {"w13": torch.cat([weight(p) for p in self.spec.projections[:-1]], dim=1), "w2": weight("down")}

    def _gemm(self, x: torch.Tensor, which: str, offs: torch.Tensor) -> torch.Tensor:
        """The bf16 grouped GEMM of `x` (rows sorted by local expert) with "w13" (gate and up) or "w2"."""
        return torch._grouped_mm(x, getattr(self, which).transpose(1, 2), offs=offs)

    # --- EPLB -------------------------------------------------------------------------------------
    def set_eplb_plan(self, slots: Sequence[int]) -> None:
        """Physical slot s holds a replica of logical expert slots[s]; EP rank r owns the r-th of
        ep_size equal contiguous runs of slots. A pair (token t, expert e) runs on replica
        t mod (replicas of e). The output is the same as without a plan.

        Set the plan before `load_weights` when it moves experts onto this rank: a loaded module
        only accepts plans whose experts it already holds."""
        num_experts, ep = self.spec.num_experts, self.parallel.ep_size
        slots = tuple(int(s) for s in slots)
        if not slots or len(slots) % ep:
            raise ValueError(f"an EPLB plan of {len(slots)} slots does not split over {ep} ep ranks")
        outside = sorted({s for s in slots if not 0 <= s < num_experts})
        if outside:
            raise ValueError(f"EPLB plan names expert {outside[0]}, outside 0..{num_experts - 1}")
        absent = sorted(set(range(num_experts)) - set(slots))
        if absent:
            raise ValueError(f"EPLB plan holds no replica of expert {absent[0]}")
        per_rank = len(slots) // ep
        held = tuple(sorted(set(slots[self.parallel.ep_rank * per_rank:(self.parallel.ep_rank + 1) * per_rank])))
        if held != self.expert_ids:
            if self.weights_loaded:
                missing = sorted(set(held) - set(self.expert_ids))
                if missing:
                    raise ValueError(f"EPLB plan puts expert {missing[0]} on ep rank {self.parallel.ep_rank}, "
                                     f"whose loaded weights do not include it; set the plan before load_weights")
            else:
                self.expert_ids = held
                self._allocate(self._device())
        self._plan = slots
        self._index_cache.clear()

    def _indices(self, device: torch.device) -> dict[str, torch.Tensor]:
        cached = self._index_cache.get(device)
        if cached is None:
            local = torch.full((self.spec.num_experts,), -1, dtype=torch.long)
            local[list(self.expert_ids)] = torch.arange(len(self.expert_ids))
            cached = {"local": local}
            if self._plan is not None:
                replicas = [[s for s, e in enumerate(self._plan) if e == expert]
                            for expert in range(self.spec.num_experts)]
                width = max(len(r) for r in replicas)
                cached["count"] = torch.tensor([len(r) for r in replicas])
                cached["slot"] = torch.tensor([r + [r[0]] * (width - len(r)) for r in replicas])
                per_rank = len(self._plan) // self.parallel.ep_size
                cached["mine"] = torch.arange(len(self._plan)) // per_rank == self.parallel.ep_rank
            cached = {k: v.to(device) for k, v in cached.items()}
            self._index_cache[device] = cached
        return cached

    # --- forward ----------------------------------------------------------------------------------
    def _pairs(self, topk_ids: torch.Tensor):
        """(flat pair index, local expert) of every (token, k) pair, sorted by local expert; a pair this rank
        does not compute gets local expert `len(expert_ids)` (sorted last)."""
        idx = self._indices(topk_ids.device)
        ids = topk_ids.reshape(-1)
        valid = (ids >= 0) & (ids < self.spec.num_experts)
        expert = ids.clamp(0, self.spec.num_experts - 1)
        local = torch.where(valid, idx["local"][expert], -1)
        if self._plan is not None:
            token = torch.arange(ids.numel(), device=ids.device) // topk_ids.shape[1]
            slot = idx["slot"][expert, token % idx["count"][expert]]
            local = torch.where(idx["mine"][slot], local, -1)
        local = torch.where(local >= 0, local, len(self.expert_ids))
        local, order = torch.sort(local, stable=True)
        return order, local

    def _act_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.FORMAT == "fp8_block_scales":
            x = qdq_act_groups(x)
        return x.to(torch.bfloat16)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check_inputs(hidden, topk_ids, topk_weights)
        spec = self.spec
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        if topk_ids.numel() == 0:  # a shape, known on the host
            return out.to(hidden.dtype)
        pair, local = self._pairs(topk_ids)
        n_local = len(self.expert_ids)
        token = pair // topk_ids.shape[1]
        # offs[e]: pairs of local experts 0..e; rows after offs[-1] (other ranks' pairs) are left unwritten.
        offs = torch.searchsorted(local, torch.arange(n_local, device=local.device), right=True).to(torch.int32)
        mine = local < n_local
        local = local.clamp(max=n_local - 1)

        gu = self._gemm(self._act_in(hidden[token]), "w13", offs).float()
        if spec.expert_bias:
            gu = gu + self.b13[local].float()
        gate, up = gu.split(self.inter_size, dim=1) if spec.gated else (None, gu)
        h = activations.apply(spec.activation, gate, up, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
        y = self._gemm(self._act_in(h.to(hidden.dtype)), "w2", offs).float()
        if self.adds_down_bias:
            y = y + self.b2[local].float()
        y = torch.where(mine[:, None], y * topk_weights.reshape(-1)[pair, None].float(), 0.0)
        return out.index_add_(0, token, y).to(hidden.dtype)


# The packed formats' dequantization workspace in a forward, as a fraction of the layer's packed
# weight bytes: half for the bf16 rows one GEMM call reads, half for the codecs' temporaries.
WORKSPACE_FRACTION = 1 / 16
# Bytes the codecs hold per weight element while they dequantize (they compute in fp32: int64 byte
# indices, the fp32 values, their scaled copy and the bf16 result are alive together).
DEQUANT_BYTES = 14


class _PackedGroupedMmExperts(_GroupedMmExperts):
    """MXFP4/NVFP4 weights stay packed, as loaded (uint8 codes and their scales, stacked over the
    local experts). Each GEMM runs over a chunk of output rows of every local expert at a time: the
    chunk is dequantized to bf16, one group of experts after another, just before its grouped GEMM,
    and dropped after. Chunks are sized from the shapes (no count is read back): the workspace stays
    within 1/16 of the layer's packed bytes whenever 8 rows of every local expert fit in half of that
    (gated MXFP4: a hidden size and an intermediate shard of 328 or more)."""

    def _weight_specs(self):
        n = len(self.expert_ids)
        return {f"{t.proj}_{t.kind}": ((n, *t.local_shape), t.dtype) for t in self.tensors if t.kind in WEIGHT_PARTS}

    def _convert_weights(self, stacked):
        return {f"{t.proj}_{t.kind}": stacked(t.proj, t.kind) for t in self.tensors if t.kind in WEIGHT_PARTS}

    def packed_bytes(self) -> int:
        """Bytes of the weights held (codes and scales, this rank's experts)."""
        return sum(getattr(self, name).nbytes for name in self._weight_specs())

    def _chunking(self, k: int) -> tuple[int, int]:
        """(output rows per GEMM call, experts per codec call) for a projection of input size `k`."""
        n = max(1, len(self.expert_ids))
        half = self.packed_bytes() * WORKSPACE_FRACTION / 2
        rows = max(ALIGN, int(half // (n * k * 2)) // ALIGN * ALIGN)
        return rows, max(1, int(half // (rows * k * DEQUANT_BYTES)))

    def _dequantized(self, proj: str, r0: int, r1: int, group: int) -> torch.Tensor:
        """Rows r0:r1 of `proj` for every local expert as bf16 [n, r1 - r0, k]."""
        parts = {t.kind: getattr(self, f"{proj}_{t.kind}") for t in self.tensors
                 if t.proj == proj and t.kind in WEIGHT_PARTS}
        n, k = parts["weight"].shape[0], parts["weight"].shape[2] * 2
        w = torch.empty((n, r1 - r0, k), dtype=torch.bfloat16, device=parts["weight"].device)
        for e0 in range(0, n, group):
            # weight_scale_2 is one fp32 scalar per expert: [n], not sliced by rows.
            sliced = {kind: v[e0:e0 + group] if v.dim() == 1 else v[e0:e0 + group, r0:r1] for kind, v in parts.items()}
            w[e0:e0 + group] = dequantize_canonical(self.FORMAT, sliced, torch.bfloat16)
        return w

    def _gemm(self, x, which, offs):
        projs = self.spec.projections[:-1] if which == "w13" else ("down",)
        rows = self.inter_size if which == "w13" else self.spec.hidden_size
        k = x.shape[1]
        chunk, group = self._chunking(k)
        out = torch.empty((x.shape[0], rows * len(projs)), dtype=torch.bfloat16, device=x.device)
        for p, proj in enumerate(projs):
            for r0 in range(0, rows, chunk):
                r1 = min(r0 + chunk, rows)
                w = self._dequantized(proj, r0, r1, group)
                out[:, p * rows + r0:p * rows + r1] = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
                del w
        return out


class TorchGroupedMmBf16Experts(_GroupedMmExperts):
    __doc__ = "TORCH grouped GEMM, bf16. " + _GroupedMmExperts.__doc__
    IMPL_ID = "torch.grouped_mm.grouped_gemm.bf16"
    FORMAT = "bf16"


class TorchGroupedMmFp8BlockScalesExperts(_GroupedMmExperts):
    __doc__ = ("TORCH grouped GEMM, FP8 block weights dequantized to bf16 at load, activations "
               "quantized-dequantized per 1x128 group. " + _GroupedMmExperts.__doc__)
    IMPL_ID = "torch.grouped_mm.grouped_gemm.fp8_block_scales"
    FORMAT = "fp8_block_scales"


class TorchGroupedMmW4a16Mxfp4Experts(_PackedGroupedMmExperts):
    __doc__ = ("TORCH grouped GEMM, bf16 activations. " + _PackedGroupedMmExperts.__doc__ + " "
               + _GroupedMmExperts.__doc__)
    IMPL_ID = "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"
    FORMAT = "w4a16_mxfp4"


class TorchGroupedMmW4a16Nvfp4Experts(_PackedGroupedMmExperts):
    __doc__ = ("TORCH grouped GEMM, bf16 activations. " + _PackedGroupedMmExperts.__doc__ + " "
               + _GroupedMmExperts.__doc__)
    IMPL_ID = "torch.grouped_mm.grouped_gemm.w4a16_nvfp4"
    FORMAT = "w4a16_nvfp4"
