"""The contract every experts implementation shares: the layer spec, this rank's parallel slice, and the base class that loads weights.

docs/runtime.md ("Experts implementations") is the specification. An implementation subclasses
`ExpertsBase` and supplies its buffer layout (`_buffer_specs`), how canonical checkpoint tensors
become those buffers (`_convert`), and `forward`. The base class validates every source tensor
before reading any, reads only this rank's slices, and swaps the new values in only once all of them
have been read and converted, so a failed load leaves the module as it was. Builds and
implementations import the contract from here: the canonical tensors (`canonical.py`) and the weight
sources (`sources.py`) are re-exported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from contract import RUN_FORMATS, MoeShape

from .canonical import (  # noqa: F401 - re-exported: the contract's names
    DIM_UNIT, PLAIN_FLOATS, SHARD_UNIT, WEIGHT_KIND, WEIGHT_PARTS, CanonicalTensor, canonical_tensors,
    dequantize_canonical,
)
from .sources import DictExpertSource, ExpertTensorSource, random_source  # noqa: F401 - re-exported

_MAX_LISTED_PROBLEMS = 20


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape or dtype; the message names each one."""



@dataclass(frozen=True)
class ExpertParallel:
    """This rank's slice of the experts: a contiguous shard of every expert's intermediate dim (MoE TP)
    of the experts its EP rank owns."""
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    expert_owner: tuple[int, ...] | None = None   # global expert -> ep rank; None = contiguous blocks

    def __post_init__(self):
        for size, rank in (("moe_tp_size", "moe_tp_rank"), ("ep_size", "ep_rank")):
            n, r = getattr(self, size), getattr(self, rank)
            if n < 1 or not 0 <= r < n:
                raise ValueError(f"ExpertParallel: {rank}={r} must lie in 0..{n - 1} ({size}={n})")
        if self.expert_owner is not None:
            bad = [e for e, rank in enumerate(self.expert_owner) if not 0 <= rank < self.ep_size]
            if bad:
                raise ValueError(f"ExpertParallel.expert_owner gives expert {bad[0]} to ep rank "
                                 f"{self.expert_owner[bad[0]]}, outside 0..{self.ep_size - 1}")

    def owner(self, expert: int, num_experts: int) -> int:
        """The ep rank that owns global expert `expert`."""
        if self.expert_owner is not None:
            if len(self.expert_owner) != num_experts:
                raise ValueError(f"ExpertParallel.expert_owner has {len(self.expert_owner)} entries for "
                                 f"{num_experts} experts")
            return self.expert_owner[expert]
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split into {self.ep_size} equal contiguous "
                             f"blocks; give ExpertParallel.expert_owner")
        return expert // (num_experts // self.ep_size)

    def local_experts(self, num_experts: int) -> tuple[int, ...]:
        """Global ids of the experts this rank holds, ascending."""
        return tuple(e for e in range(num_experts) if self.owner(e, num_experts) == self.ep_rank)

    def inter_slice(self, intermediate_size: int) -> slice:
        """This rank's contiguous shard of the intermediate dim."""
        if intermediate_size % self.moe_tp_size:
            raise ValueError(f"intermediate_size {intermediate_size} does not split into "
                             f"{self.moe_tp_size} equal MoE-TP shards")
        shard = intermediate_size // self.moe_tp_size
        return slice(self.moe_tp_rank * shard, (self.moe_tp_rank + 1) * shard)


def _fits(found: torch.dtype, want: torch.dtype) -> bool:
    """A source tensor of dtype `found` can fill a canonical tensor of dtype `want` (equal, or both plain floats)."""
    return found == want or (found in PLAIN_FLOATS and want in PLAIN_FLOATS)


def _describe(shape, dtype) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


class ExpertsBase(torch.nn.Module):
    """Shared machinery of the experts implementations; subclasses set `IMPL_ID` and `FORMAT`."""

    IMPL_ID: ClassVar[str] = ""
    FORMAT: ClassVar[str] = ""

    def __init__(self, spec: MoeShape, parallel: ExpertParallel = ExpertParallel(), device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if self.FORMAT not in RUN_FORMATS or not self.IMPL_ID:
            raise TypeError(f"{type(self).__name__} must set IMPL_ID and a FORMAT among {RUN_FORMATS}")
        self.spec = spec
        self.parallel = parallel
        self.weight_kind = WEIGHT_KIND[self.FORMAT]
        self.inter = parallel.inter_slice(spec.intermediate_size)
        self.inter_size = self.inter.stop - self.inter.start
        self._check_sizes()
        whole = parallel.moe_tp_size == 1
        # `dtype` is the build's: an implementation that computes in fp32 keeps fp32 weights for it.
        self.dtype = dtype
        self.tensors = canonical_tensors(spec, self.FORMAT, None if whole else self.inter,
                                         self.plain_dtype(dtype))
        self.expert_ids: tuple[int, ...] = parallel.local_experts(spec.num_experts)
        # Down's bias is added once per token: by the first MoE-TP shard.
        self.adds_down_bias = spec.expert_bias and parallel.moe_tp_rank == 0
        self.weights_loaded = False
        self._allocate(device)

    # --- what a subclass provides -------------------------------------------------------------------
    @classmethod
    def plain_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        """The dtype unquantized weights and biases are kept in, in a build of `dtype`: bf16 for
        implementations whose GEMMs run on bf16 operands whatever the build's dtype."""
        return torch.bfloat16

    def _buffer_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every buffer, for `len(self.expert_ids)` experts."""
        raise NotImplementedError

    def _convert(self, staged: Mapping[tuple[int, str, str], torch.Tensor], device) -> dict[str, torch.Tensor]:
        """New buffer values from this rank's canonical slices, keyed (expert, proj, kind)."""
        raise NotImplementedError

    def _extra_size_checks(self) -> list[str]:
        """Shape constraints of the implementation itself, as messages (empty: none violated)."""
        return []

    # --- shared -------------------------------------------------------------------------------------
    def _check_sizes(self):
        spec, unit = self.spec, DIM_UNIT[self.weight_kind]
        problems = [f"{name} {size} is not a multiple of {unit}"
                    for name, size in (("hidden_size", spec.hidden_size),
                                       ("intermediate_size", spec.intermediate_size)) if size % unit]
        shard_unit = SHARD_UNIT[self.weight_kind]
        if self.parallel.moe_tp_size > 1 and self.inter_size % shard_unit:
            problems.append(f"the MoE-TP shard of {self.inter_size} intermediate channels is not a "
                            f"multiple of {shard_unit}")
        problems += self._extra_size_checks()
        if problems:
            raise ValueError(f"{self.IMPL_ID}: {'; '.join(problems)} ({self.FORMAT} scale or kernel layout)")

    def _allocate(self, device):
        for name, (shape, dtype) in self._buffer_specs().items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))

    def _device(self) -> torch.device:
        for buf in self.buffers():
            return buf.device
        return torch.device("cpu")

    def source_problems(self, source: ExpertTensorSource) -> list[str]:
        """One message per canonical tensor of this rank's experts that is missing or mismatched."""
        problems = []
        for expert in self.expert_ids:
            for t in self.tensors:
                name = source.name(expert, t.proj, t.kind)
                shape = source.shape(expert, t.proj, t.kind)
                if shape is None:
                    problems.append(f"{name}: missing from the checkpoint (expected shape "
                                    f"{_describe(t.shape, t.dtype)})")
                    continue
                dtype = source.dtype(expert, t.proj, t.kind)
                if tuple(shape) != t.shape or not _fits(dtype, t.dtype):
                    problems.append(f"{name}: expected shape {_describe(t.shape, t.dtype)}, "
                                    f"found {_describe(shape, dtype)}")
        return problems

    def load_weights(self, source: ExpertTensorSource) -> None:
        """Fill the buffers from `source`; on any error nothing changes and WeightLoadError says why."""
        device = self._device()
        if device.type == "meta":
            raise RuntimeError(f"{type(self).__name__} lives on the meta device; materialize it "
                               f"(module.to_empty(device=...)) before loading weights")
        problems = self.source_problems(source)
        if problems:
            shown = problems[:_MAX_LISTED_PROBLEMS]
            if len(problems) > len(shown):
                shown.append(f"... and {len(problems) - len(shown)} more")
            raise WeightLoadError("\n".join(shown))
        staged = {}
        for expert in self.expert_ids:
            for t in self.tensors:
                value = source.get(expert, t.proj, t.kind, rows=t.rows, cols=t.cols)
                if value.dtype != t.dtype and _fits(value.dtype, t.dtype):
                    value = value.to(t.dtype)
                if tuple(value.shape) != t.local_shape or value.dtype != t.dtype:
                    raise WeightLoadError(
                        f"{source.name(expert, t.proj, t.kind)}: the slice rows={t.rows} cols={t.cols} "
                        f"should be {_describe(t.local_shape, t.dtype)}, the source returned "
                        f"{_describe(value.shape, value.dtype)}")
                staged[expert, t.proj, t.kind] = value
        new = self._convert(staged, device) if self.expert_ids else {}
        with torch.no_grad():
            for name, value in new.items():
                old = getattr(self, name)
                if old.shape == value.shape and old.dtype == value.dtype:
                    old.copy_(value)     # keeps buffer identity (CUDA graphs, shared references)
                else:
                    setattr(self, name, value)
        self.weights_loaded = True

    def init_random(self, generator: torch.Generator) -> None:
        """Fresh random weights for this rank's experts (runs without a checkpoint; never zeros)."""
        self.load_weights(random_source(self.spec, self.FORMAT, self.expert_ids, generator))

    @classmethod
    def from_checkpoint(cls, spec: MoeShape, parallel: ExpertParallel, source: ExpertTensorSource,
                        device=None, dtype: torch.dtype = torch.bfloat16) -> "ExpertsBase":
        module = cls(spec, parallel, device=device, dtype=dtype)
        module.load_weights(source)
        return module

    def _check_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.hidden_size:
            raise ValueError(f"hidden must be [T, {self.spec.hidden_size}], got {tuple(hidden.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0] or topk_ids.dim() != 2:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                             f"must both be [T, k] with T = {hidden.shape[0]}")

    def extra_repr(self) -> str:
        p = self.parallel
        return (f"{self.IMPL_ID}, experts {len(self.expert_ids)}/{self.spec.num_experts}, "
                f"inter {self.inter.start}:{self.inter.stop}, moe_tp {p.moe_tp_rank}/{p.moe_tp_size}, "
                f"ep {p.ep_rank}/{p.ep_size}")
