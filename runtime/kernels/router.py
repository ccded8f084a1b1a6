"""The router kernels: `moe_route`, a few tokens' logits, scores and top-k in one launch; `moe_topk`, the scores and
top-k of logits torch computed.

Used by the router modules of `runtime/routing.py` on a CUDA device. Up to `MAX_TOKENS` bf16 tokens (decode batches,
where a dozen small torch kernels cost more than the router's bytes) take `route`: one launch. Larger batches keep
torch's GEMM, which reuses the weight across tokens, and take `topk` for the rest: one launch where torch's rules
take 6 to ~15. Same rules and numerics as the torch functions: fp32 products and sums, logits rounded to bf16 where
torch's bf16 GEMM rounds them, ties to the lower expert index.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.graphs import kernel_counters

SOFTMAX, SIGMOID, LOGITS = 0, 1, 2
MAX_TOKENS = 64
MAX_K, MAX_GROUPS = 32, 64
# Dynamic shared memory of the top-k kernel: two per-expert rows, fp32, within the 48 KiB every GPU grants.
MAX_SHARED_BYTES = 48 * 1024


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _serves(device: torch.device, experts: int, top_k: int, n_group: int) -> bool:
    """Whether the top-k stage both kernels share serves this rule, and the kernels load on `device`."""
    if top_k > MAX_K or n_group > MAX_GROUPS or 8 * experts > MAX_SHARED_BYTES:
        return False
    return _kernels(device) is not None


def applies(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, n_group: int = 1) -> bool:
    """Whether `route` serves this call (else the caller computes the logits with torch)."""
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and hidden.dim() == 2 and hidden.shape[0] <= MAX_TOKENS):
        return False
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return False
    return _serves(hidden.device, weight.shape[0], top_k, n_group)


def topk_applies(logits: torch.Tensor, top_k: int, n_group: int = 1) -> bool:
    """Whether `topk` serves these logits (else the caller runs torch's rule on them)."""
    if not (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float32) and logits.dim() == 2):
        return False
    return _serves(logits.device, logits.shape[1], top_k, n_group)


_LOADED: dict = {}
# Per device: the kernel's per-token arrival counters, zero between launches (the kernel's last CTA of each
# token resets its own). Made at the first call, which a decoder's warm-up makes before any capture (inside
# one it is refused: runtime.graphs.kernel_counters; tests/gpu/conftest.py checks they end at zero). One
# set per device: two router calls must not run at once on two streams of one device (no build does that).
_COUNTERS: dict = {}


def _picks(tokens: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What both kernels write: ids int64 [T, k] and weights fp32 [T, k]."""
    return (torch.empty(tokens, top_k, dtype=torch.int64, device=device),
            torch.empty(tokens, top_k, dtype=torch.float32, device=device))


def _fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A per-expert bias as the kernels read it: fp32, contiguous."""
    return None if bias is None else bias.float().contiguous()


def _counters(device: torch.device) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = kernel_counters(MAX_TOKENS, device, "the router kernel")
    return counters


def _kernels(device: torch.device):
    """The kernel module for `device`, or None where cupy is missing (the torch path then serves)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _LOADED:
        try:
            import cupy  # noqa: F401
        except ImportError:
            _LOADED[index] = None
        else:
            from runtime import kernels

            _LOADED[index] = kernels.load((), torch.device("cuda", index))
    return _LOADED[index]


def route(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    mode: int,
    *,
    logit_bias: torch.Tensor | None = None,
    choice_bias: torch.Tensor | None = None,
    round_logits: bool,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids int64 [T, k], weights fp32 [T, k])` for `hidden [T, H]` bf16 and `weight [E, H]`."""
    tokens, hsize = hidden.shape
    experts = weight.shape[0]
    hidden = hidden.contiguous()
    ids, weights = _picks(tokens, top_k, hidden.device)
    if tokens == 0:
        return ids, weights
    lb, cb = _fp32(logit_bias), _fp32(choice_bias)
    logits = torch.empty(tokens, experts, dtype=torch.float32, device=hidden.device)
    i32, f32 = np.int32, np.float32
    kern = _kernels(hidden.device)
    stream = torch.cuda.current_stream(hidden.device).cuda_stream
    kern.launch("moe_route", ((experts + 3) // 4, tokens), (128,),
                (_ptr(hidden), _ptr(weight.contiguous()), _ptr(lb), _ptr(cb), _ptr(logits),
                 _ptr(_counters(hidden.device)), _ptr(ids), _ptr(weights), i32(hsize), i32(experts),
                 i32(weight.dtype == torch.float32), i32(round_logits), i32(top_k), i32(mode), i32(n_group),
                 i32(topk_group), i32(renormalize), f32(scale)), stream, shared_mem=8 * experts)
    return ids, weights


def topk(
    logits: torch.Tensor,
    top_k: int,
    mode: int,
    *,
    choice_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids int64 [T, k], weights fp32 [T, k])` of `logits [T, E]` (bf16 or fp32, as torch's GEMM gave them) by the
    rule `mode`, as `route` picks and weighs its own logits."""
    tokens, experts = logits.shape
    logits = logits.contiguous()
    ids, weights = _picks(tokens, top_k, logits.device)
    if tokens == 0:
        return ids, weights
    cb = _fp32(choice_bias)   # held past the launch
    i32 = np.int32
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    _kernels(logits.device).launch(
        "moe_topk", (tokens,), (128,),
        (_ptr(logits), _ptr(cb), _ptr(ids), _ptr(weights), i32(logits.dtype == torch.bfloat16), i32(experts),
         i32(top_k), i32(mode), i32(n_group), i32(topk_group), i32(renormalize), np.float32(scale)),
        stream, shared_mem=8 * experts)
    return ids, weights
