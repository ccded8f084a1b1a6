"""Routers: which experts each token goes to and with what weight, as `(topk_ids int64 [T, k], topk_weights fp32 [T, k])`.

Every experts implementation consumes the same pair (docs/runtime.md), so routing is kept apart from the
experts and written once per scoring rule. Three rules cover the supported families:

- softmax -> top-k -> optional renormalisation (Qwen3-MoE, Mixtral, Qwen3-Next);
- sigmoid, a correction bias used only to *choose*, grouped top-k, the unbiased scores as weights,
  optional normalisation and a scaling factor (DeepSeek-V3, Kimi-K2, GLM-4 MoE, Nemotron-H; MiniMax-M2
  with one group, no scaling and its bias held by the MoE block);
- gpt-oss: biased linear, top-k on the logits, softmax over the k chosen logits.

The functions take logits (pure tensor maths, CUDA-graph safe: no host syncs, no branching on values);
the modules own the router weights under the checkpoint's names (`weight`, `e_score_correction_bias`,
`bias`) and compute the logits with the precision each family's reference uses (`fp32_logits` where that is
fp32). On CUDA they route through the router kernels (runtime/kernels/router.py): `route` for bf16 decode
batches (logits included), `topk` on torch's logits for larger batches.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.kernels import router as router_kernel

def _fused(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, n_group: int = 1) -> bool:
    """A bf16 decode batch on a CUDA device goes through the fused router kernel (runtime/kernels/router.py):
    one launch instead of a dozen; the same rule and numerics, shapes fixed per call (CUDA-graph safe)."""
    return router_kernel.applies(hidden, weight, top_k, n_group)


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`hidden @ weight.T` with fp32 products and sums, as the references of the fp32-GEMM routers compute it.

    bf16 operands on CUDA take one bf16 GEMM that writes fp32: a product of two bf16 values is exact in fp32,
    so only the order of the fp32 sums differs from casting both operands first, which writes an fp32 copy of
    `hidden` and runs the GEMM off the tensor cores (torch leaves TF32 off). Everywhere else both are cast."""
    if hidden.is_cuda and hidden.dim() == 2 and hidden.dtype == weight.dtype == torch.bfloat16:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden.float(), weight.float())


# transformers adds this to the normaliser of the sigmoid routers; the DeepSeek reference adds nothing.
# It only matters when every chosen score underflows, and keeps the weights finite there.
NORM_EPS = 1e-20


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, the k most probable, optionally renormalised to sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        # After top-k (Qwen3 `norm_topk_prob`, Mixtral always): the k chosen probabilities sum to 1.
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    group_mask_fill: float = float("-inf"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing: the bias steers the choice, the unbiased sigmoid scores are the weights."""
    scores = torch.sigmoid(logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_experts = choice.shape[-1]
    if topk_group < n_group:
        # A group's score is the sum of its two best (biased) experts; only the best `topk_group` groups
        # stay eligible. With topk_group >= n_group every group is kept, so the step is skipped statically.
        per_group = num_experts // n_group
        grouped = choice.view(*choice.shape[:-1], n_group, per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
        # Fill value: -inf (transformers >= 5.x, DeepSeek's inference/model.py) never lets a masked expert
        # win; 0.0 (older transformers) lets one outrank kept experts whose biased score is <= 0.
        choice = grouped.masked_fill(~keep.unsqueeze(-1), group_mask_fill).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        # Normalisation happens after the gather, over the unbiased scores, and before the scaling.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return ids, weights


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: top-k on the raw logits, then a softmax over the k chosen ones (in fp32)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(values.float(), dim=-1)


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE / Mixtral / Qwen3-Next gate: `weight [E, H]`, softmax top-k, optional renormalisation.

    transformers runs this GEMM in the activation dtype and the softmax in fp32; `fp32_gemm=True` runs
    the GEMM in fp32 as well (more accurate, not bit-matching transformers in bf16).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        fp32_gemm: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.fp32_gemm = fp32_gemm
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if _fused(hidden, self.weight, self.top_k) and (self.fp32_gemm or self.weight.dtype == hidden.dtype):
            return router_kernel.route(
                hidden, self.weight, self.top_k, router_kernel.SOFTMAX, round_logits=not self.fp32_gemm,
                renormalize=self.norm_topk_prob,
            )
        if self.fp32_gemm:
            logits = fp32_logits(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight.to(hidden.dtype))
        if router_kernel.topk_applies(logits, self.top_k):
            return router_kernel.topk(logits, self.top_k, router_kernel.SOFTMAX, renormalize=self.norm_topk_prob)
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)


class SigmoidTopKRouter(nn.Module):
    """DeepSeek-V3 / Kimi / GLM-4 MoE / Nemotron-H / MiniMax-M2 gate: sigmoid, correction bias, grouped top-k.

    `weight [E, H]` and, unless `bias_on_block`, `e_score_correction_bias [E]` (fp32, as the checkpoints
    store it). MiniMax-M2 keeps that bias on the MoE block (`block_sparse_moe.e_score_correction_bias`),
    so with `bias_on_block=True` the router has no bias of its own and the block passes its bias in.
    The GEMM is fp32 by default, as transformers does for DeepSeek/GLM; MiniMax-M2 in transformers runs
    it in the weight dtype (`fp32_gemm=False`).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        fp32_gemm: bool = True,
        bias_on_block: bool = False,
        group_mask_fill: float = float("-inf"),
        dtype: torch.dtype | None = torch.float32,
    ) -> None:
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        if n_group > 1 and num_experts // n_group < 2:
            raise ValueError("grouped top-k scores a group by its top-2 experts: it needs >= 2 experts per group")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group {topk_group} must be in 1..n_group ({n_group})")
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.fp32_gemm = fp32_gemm
        self.bias_on_block = bias_on_block
        self.group_mask_fill = float(group_mask_fill)
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        if bias_on_block:
            self.e_score_correction_bias = None
        else:
            # Kept fp32 whatever the model dtype: a bf16 bias would move the choice between experts.
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(
        self, hidden: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.e_score_correction_bias if correction_bias is None else correction_bias
        # the kernels mask left-out groups with -inf only
        kernel_rule = self.topk_group >= self.n_group or self.group_mask_fill == float("-inf")
        if (
            kernel_rule
            and _fused(hidden, self.weight, self.top_k, self.n_group)
            and (self.fp32_gemm or self.weight.dtype == hidden.dtype)
        ):
            return router_kernel.route(
                hidden, self.weight, self.top_k, router_kernel.SIGMOID, choice_bias=bias, round_logits=not self.fp32_gemm,
                n_group=self.n_group, topk_group=self.topk_group, renormalize=self.norm_topk_prob,
                scale=self.routed_scaling_factor,
            )
        if self.fp32_gemm:
            logits = fp32_logits(hidden, self.weight)
        else:
            logits = F.linear(hidden.to(self.weight.dtype), self.weight)
        if kernel_rule and router_kernel.topk_applies(logits, self.top_k, self.n_group):
            return router_kernel.topk(
                logits, self.top_k, router_kernel.SIGMOID, choice_bias=bias, n_group=self.n_group,
                topk_group=self.topk_group, renormalize=self.norm_topk_prob, scale=self.routed_scaling_factor,
            )
        return sigmoid_grouped_topk(
            logits,
            bias,
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            renormalize=self.norm_topk_prob,
            scaling_factor=self.routed_scaling_factor,
            group_mask_fill=self.group_mask_fill,
        )


class LinearTopKSoftmaxRouter(nn.Module):
    """gpt-oss router: `weight [E, H]` and `bias [E]`, top-k on the logits, softmax over the k.

    The GEMM runs in the activation dtype as in transformers and the original gpt-oss code; the softmax
    over the k chosen logits runs in fp32 (transformers runs it in the logits dtype).
    """

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if _fused(hidden, self.weight, self.top_k) and self.weight.dtype == hidden.dtype == self.bias.dtype:
            return router_kernel.route(
                hidden, self.weight, self.top_k, router_kernel.LOGITS, logit_bias=self.bias, round_logits=True
            )
        logits = F.linear(hidden, self.weight.to(hidden.dtype), self.bias.to(hidden.dtype))
        if router_kernel.topk_applies(logits, self.top_k):
            return router_kernel.topk(logits, self.top_k, router_kernel.LOGITS)
        return topk_softmax(logits, self.top_k)
