"""RMS norms against the transformers norm modules of each family, on random weights and inputs.

Tolerances: bf16 outputs must be bit-identical where the formula is the same sequence of roundings
(Llama style, gpt-oss style, zero-centred); fp32 within 1e-6. The projection norm divides a sum by the
size instead of taking a mean, so it gets 1e-6 (fp32) and one bf16 ulp (bf16).
"""
from __future__ import annotations

import pytest
import torch

from runtime.ops.norms import ProjectionRMSNorm, RMSNorm

DTYPES = [torch.float32, torch.bfloat16]


def _exact_or_close(ours, theirs):
    if ours.dtype == torch.bfloat16:
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def _pair(ref_cls, ours_kwargs, size, dtype, weight_dtype=None, eps=1e-6):
    theirs = ref_cls(size, eps=eps).to(weight_dtype or dtype)
    theirs.weight.normal_(0, 0.5).add_(1.0)
    ours = RMSNorm(hidden_size=size, eps=eps, dtype=weight_dtype or dtype, **ours_kwargs)
    ours.weight.copy_(theirs.weight)
    return ours, theirs


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_llama_style_norm(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    ours, theirs = _pair(DeepseekV3RMSNorm, {}, 96, dtype)
    x = 3 * torch.randn(5, 7, 96).to(dtype)
    _exact_or_close(ours(x), theirs(x))


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_fp32_multiply_matches_gpt_oss_norm(weight_dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    ours, theirs = _pair(GptOssRMSNorm, {"multiply_in_fp32": True}, 96, torch.bfloat16, weight_dtype, eps=1e-5)
    x = 3 * torch.randn(11, 96).to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))


def test_the_weight_multiply_order_is_observable_in_bf16():
    # Why `multiply_in_fp32` exists: the two orders round differently, so a family must get its own.
    weight = (1.0 + 0.5 * torch.randn(96)).to(torch.bfloat16)
    llama = RMSNorm(hidden_size=96, eps=1e-6, dtype=torch.bfloat16)
    fp32 = RMSNorm(hidden_size=96, eps=1e-6, multiply_in_fp32=True, dtype=torch.bfloat16)
    llama.weight.data.copy_(weight)
    fp32.weight.data.copy_(weight)
    x = 3 * torch.randn(64, 96).to(torch.bfloat16)
    assert not torch.equal(llama(x), fp32(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_norm_matches_qwen3_next(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    theirs = Qwen3NextRMSNorm(64, eps=1e-6).to(dtype)
    theirs.weight.data.normal_(0, 0.3)  # stored as w - 1: around zero
    ours = RMSNorm(hidden_size=64, eps=1e-6, zero_centered=True, dtype=dtype)
    ours.weight.data.copy_(theirs.weight)
    x = 2 * torch.randn(9, 64).to(dtype)
    _exact_or_close(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_projection_norm_matches_minimax_m2_qk_norm(dtype):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    size = 4 * 16  # the whole q projection of 4 heads, one statistic
    theirs = MiniMaxM2RMSNorm(size, eps=1e-6).to(dtype)
    theirs.weight.data.normal_(1.0, 0.3)
    ours = ProjectionRMSNorm(hidden_size=size, eps=1e-6, dtype=dtype)
    ours.weight.data.copy_(theirs.weight)
    x = 2 * torch.randn(3, 5, size).to(dtype)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(ours(x), theirs(x), rtol=2**-7, atol=2**-7)
    else:
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_forward_is_the_residual_sum_and_its_norm(dtype):
    g = torch.Generator().manual_seed(11)
    norm = RMSNorm(hidden_size=96, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=g))
    x = torch.randn(3, 4, 96, generator=g).to(dtype)
    residual = (3 * torch.randn(3, 4, 96, generator=g)).to(dtype)
    normed, total = norm.add_forward(x, residual)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, norm(residual + x))
    assert not torch.equal(normed, norm(x))
