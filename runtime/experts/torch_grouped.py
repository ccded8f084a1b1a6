"""TORCH experts: one grouped GEMM per projection over tokens sorted by expert (`torch._grouped_mm`).

This family dequantizes: quantized weights become bf16 once, at load, and both GEMMs run on bf16
operands with fp32 accumulation. It publishes only the formats whose activations it computes
faithfully: bf16, the W4A16 formats, and fp8_block_scales, whose activations it quantizes and
dequantizes per 1x128 group before each GEMM. It also consumes dynamic EPLB plans (`set_eplb_plan`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import activations
from ..formats.fp8 import qdq_act_groups
from .base import WEIGHT_KINDS, ExpertParallel, ExpertsBase, MoeLayerSpec, dequantize_canonical

# torch._grouped_mm wants 16-byte aligned strides, on CPU as on CUDA: with bf16 operands every
# K and N of both GEMMs (hidden size, this rank's intermediate size) is a multiple of 8.
ALIGN = 8


class _GroupedMmExperts(ExpertsBase):
    """Shape constraints: hidden_size and intermediate_size / moe_tp_size multiples of 8 (16-byte
    strides for `torch._grouped_mm`). CUDA needs SM 9.0 or newer; CPU runs anywhere. CUDA-graph
    capturable: every (token, k) pair is permuted, the pairs of other ranks' experts sorted last, past
    the last group offset, and their rows masked out, so no count is read back."""

    def __init__(self, spec: MoeLayerSpec, parallel: ExpertParallel = ExpertParallel(), device=None,
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
        specs = {"w13": ((n, first * i, h), torch.bfloat16), "w2": ((n, h, i), torch.bfloat16)}
        if self.spec.expert_bias:
            specs.update(b13=((n, first * i), torch.bfloat16), b2=((n, h), torch.bfloat16))
        return specs

    def _convert(self, staged, device):
        def stacked(proj, kind):
            return torch.stack([staged[e, proj, kind] for e in self.expert_ids]).to(device)

        def weight(proj):
            parts = {t.kind: stacked(proj, t.kind) for t in self.tensors
                     if t.proj == proj and t.kind in WEIGHT_KINDS}
            return dequantize_canonical(self.FORMAT, parts, torch.bfloat16)

        first = self.spec.projections[:-1]
        new = {"w13": torch.cat([weight(p) for p in first], dim=1), "w2": weight("down")}
        if self.spec.expert_bias:
            new["b13"] = torch.cat([stacked(p, "bias") for p in first], dim=1)
            new["b2"] = stacked("down", "bias")
        return new

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

        gu = torch._grouped_mm(self._act_in(hidden[token]), self.w13.transpose(1, 2), offs=offs).float()
        if spec.expert_bias:
            gu = gu + self.b13[local].float()
        gate, up = gu.split(self.inter_size, dim=1) if spec.gated else (None, gu)
        h = activations.apply(spec.activation, gate, up, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
        y = torch._grouped_mm(self._act_in(h.to(hidden.dtype)), self.w2.transpose(1, 2), offs=offs).float()
        if self.adds_down_bias:
            y = y + self.b2[local].float()
        y = torch.where(mine[:, None], y * topk_weights.reshape(-1)[pair, None].float(), 0.0)
        return out.index_add_(0, token, y).to(hidden.dtype)


class TorchGroupedMmBf16Experts(_GroupedMmExperts):
    __doc__ = "TORCH grouped GEMM, bf16. " + _GroupedMmExperts.__doc__
    IMPL_ID = "torch.grouped_mm.grouped_gemm.bf16"
    FORMAT = "bf16"


class TorchGroupedMmFp8BlockScalesExperts(_GroupedMmExperts):
    __doc__ = ("TORCH grouped GEMM, FP8 block weights dequantized to bf16 at load, activations "
               "quantized-dequantized per 1x128 group. " + _GroupedMmExperts.__doc__)
    IMPL_ID = "torch.grouped_mm.grouped_gemm.fp8_block_scales"
    FORMAT = "fp8_block_scales"


class TorchGroupedMmW4a16Mxfp4Experts(_GroupedMmExperts):
    __doc__ = "TORCH grouped GEMM, MXFP4 weights dequantized to bf16 at load. " + _GroupedMmExperts.__doc__
    IMPL_ID = "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"
    FORMAT = "w4a16_mxfp4"


class TorchGroupedMmW4a16Nvfp4Experts(_GroupedMmExperts):
    __doc__ = "TORCH grouped GEMM, NVFP4 weights dequantized to bf16 at load. " + _GroupedMmExperts.__doc__
    IMPL_ID = "torch.grouped_mm.grouped_gemm.w4a16_nvfp4"
    FORMAT = "w4a16_nvfp4"


TORCH_EXPERTS = (TorchGroupedMmBf16Experts, TorchGroupedMmFp8BlockScalesExperts,
                 TorchGroupedMmW4a16Mxfp4Experts, TorchGroupedMmW4a16Nvfp4Experts)
