"""Routers against the transformers router modules on copied weights, plus the routing pitfalls of research §5.

Ids are compared as sets per token (the sigmoid routers use an unsorted top-k), with the weights carried
along. fp32: ids equal, weights within 1e-6. bf16 (softmax routers, whose GEMM runs in the activation
dtype): ids equal, weights within 1e-2 relative, because transformers rounds Qwen3's weights to bf16 and
gpt-oss runs its softmax in bf16 while ours stay fp32 (docs/runtime.md: weights are fp32).
"""
from __future__ import annotations

import pytest
import torch

from runtime.routing import (
    LinearTopKSoftmaxRouter,
    SigmoidTopKRouter,
    SoftmaxTopKRouter,
    sigmoid_grouped_topk,
    softmax_topk,
)

H, E = 48, 16


def _config(family, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{"hidden_size": H, **kw})


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.float().gather(-1, order)


def _assert_same_routing(ours, theirs, weight_rtol=1e-6, weight_atol=1e-6):
    our_ids, our_w = _by_id(*ours)
    ref_ids, ref_w = _by_id(*theirs)
    assert torch.equal(our_ids, ref_ids)
    torch.testing.assert_close(our_w, ref_w, rtol=weight_rtol, atol=weight_atol)


def _check_contract(ids, weights, tokens, k):
    assert ids.dtype == torch.int64 and ids.shape == (tokens, k)
    assert weights.dtype == torch.float32 and weights.shape == (tokens, k)


@torch.no_grad()
def _copy(ours, theirs):
    for name, t in theirs.named_parameters():
        getattr(ours, name).copy_(t)
    for name, t in theirs.named_buffers():
        getattr(ours, name).copy_(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_router_matches_qwen3_moe(dtype, norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = _config("qwen3_moe", num_experts=E, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(1)
    theirs = Qwen3MoeTopKRouter(config).to(dtype)
    theirs.weight.data.normal_(0, 0.2)
    ours = SoftmaxTopKRouter(hidden_size=H, num_experts=E, top_k=4, norm_topk_prob=norm_topk_prob, dtype=dtype)
    _copy(ours, theirs)
    x = torch.randn(64, H, dtype=dtype)
    _, ref_w, ref_ids = theirs(x)
    ids, w = ours(x)
    _check_contract(ids, w, 64, 4)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _assert_same_routing((ids, w), (ref_ids, ref_w), weight_rtol=tol, weight_atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_router_matches_mixtral(dtype):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = _config("mixtral", num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(2)
    theirs = MixtralTopKRouter(config).to(dtype)
    theirs.weight.data.normal_(0, 0.2)
    ours = SoftmaxTopKRouter(hidden_size=H, num_experts=8, top_k=2, norm_topk_prob=True, dtype=dtype)
    _copy(ours, theirs)
    x = torch.randn(64, H, dtype=dtype)
    _, ref_w, ref_ids = theirs(x)
    _assert_same_routing(ours(x), (ref_ids, ref_w))


def _sigmoid_oracle(family, **kw):
    """A transformers sigmoid router with random weights and a random (non-zero) correction bias."""
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as cls
    elif family == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as cls
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter as cls
    router = cls(_config(family, **kw))
    router.weight.data.normal_(0, 0.2)
    router.e_score_correction_bias.data.normal_(0, 0.1)
    return router


@pytest.mark.parametrize(
    "family,n_group,topk_group,norm,scale",
    [
        ("deepseek_v3", 4, 2, True, 2.5),  # DeepSeek-V3 shape: groups, norm, scaling
        ("deepseek_v3", 4, 2, False, 1.0),
        ("deepseek_v3", 1, 1, True, 2.827),  # Kimi-K2: one group
        ("glm4_moe", 1, 1, True, 2.5),
        ("nemotron_h", 2, 1, True, 2.5),
    ],
)
def test_sigmoid_router_matches_transformers(family, n_group, topk_group, norm, scale):
    torch.manual_seed(3)
    kw = dict(
        n_routed_experts=E, num_experts_per_tok=4, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    theirs = _sigmoid_oracle(family, **kw)
    ours = SigmoidTopKRouter(
        hidden_size=H, num_experts=E, top_k=4, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    _copy(ours, theirs)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, H).to(dtype)
        _, ref_w, ref_ids = theirs(x)
        ids, w = ours(x)
        _check_contract(ids, w, 64, 4)
        _assert_same_routing((ids, w), (ref_ids, ref_w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minimax_m2_router_takes_its_bias_from_the_block(dtype):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    config = _config("minimax_m2", num_local_experts=E, num_experts_per_tok=4)
    torch.manual_seed(4)
    theirs = MiniMaxM2TopKRouter(config).to(dtype)
    theirs.weight.data.normal_(0, 0.2)
    bias = 0.1 * torch.randn(E)
    ours = SigmoidTopKRouter(
        hidden_size=H, num_experts=E, top_k=4, norm_topk_prob=True, fp32_gemm=False, bias_on_block=True, dtype=dtype
    )
    assert ours.e_score_correction_bias is None  # the checkpoint stores it on block_sparse_moe
    _copy(ours, theirs)
    x = torch.randn(64, H, dtype=dtype)
    _, ref_w, ref_ids = theirs(x, bias)
    _assert_same_routing(ours(x, bias), (ref_ids, ref_w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_router_matches_transformers(dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = _config("gpt_oss", num_local_experts=E, num_experts_per_tok=4)
    torch.manual_seed(5)
    theirs = GptOssTopKRouter(config).to(dtype)
    theirs.weight.data.normal_(0, 0.2)
    theirs.bias.data.normal_(0, 0.2)
    ours = LinearTopKSoftmaxRouter(hidden_size=H, num_experts=E, top_k=4, dtype=dtype)
    _copy(ours, theirs)
    x = torch.randn(64, H, dtype=dtype)
    _, ref_w, ref_ids = theirs(x)
    ids, w = ours(x)
    _check_contract(ids, w, 64, 4)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _assert_same_routing((ids, w), (ref_ids, ref_w), weight_rtol=tol, weight_atol=tol)


# --- research §5.1: the fill value of masked groups ------------------------------------------------


def _crafted_group_case():
    """Two groups of 4, one group kept, top-4. Group 0 wins on its two best experts, but its other two have
    a biased score below 0; group 1 is masked. With fill -inf all four picks stay in group 0; with fill
    0.0 the masked experts (0.0) outrank the negative ones and two picks leak into group 1."""
    logits = torch.tensor([[4.0, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]])
    bias = torch.tensor([0.5, 0.5, -2.0, -2.0, 0.0, 0.0, 0.0, 0.0])
    return logits, bias


def test_masked_groups_never_win_with_the_default_fill_as_in_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    logits, bias = _crafted_group_case()
    ids, _ = sigmoid_grouped_topk(logits, bias, top_k=4, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]
    # transformers 5.x (installed) fills with -inf too: an identity weight turns the logits into its input.
    router = DeepseekV3TopkRouter(
        _config("deepseek_v3", n_routed_experts=8, num_experts_per_tok=4, n_group=2, topk_group=1, hidden_size=8)
    )
    router.weight.data.copy_(torch.eye(8))
    router.e_score_correction_bias.data.copy_(bias)
    _, _, ref_ids = router(logits)
    assert sorted(ref_ids[0].tolist()) == [0, 1, 2, 3]


def test_zero_fill_reproduces_the_older_transformers_behaviour():
    logits, bias = _crafted_group_case()
    ids, weights = sigmoid_grouped_topk(logits, bias, top_k=4, n_group=2, topk_group=1, group_mask_fill=0.0)
    # float64 reference of the 0.0-fill rule: masked experts score exactly 0, kept ones s + bias.
    s = torch.sigmoid(logits.double())
    choice = s + bias.double()
    choice[:, 4:] = 0.0
    ref = choice.topk(4).indices
    assert sorted(ids[0].tolist()) == sorted(ref[0].tolist())
    assert any(i >= 4 for i in ids[0].tolist())  # the leak the -inf fill prevents


# --- research §5.8: where the normalisation happens -------------------------------------------------


def test_sigmoid_weights_are_unbiased_scores_normalised_then_scaled():
    torch.manual_seed(6)
    logits = torch.randn(32, E)
    bias = torch.randn(E)  # large: the choice depends on it, the weights must not
    ids, weights = sigmoid_grouped_topk(logits, bias, top_k=4, n_group=4, topk_group=2, scaling_factor=2.5)
    s = torch.sigmoid(logits.double()).gather(-1, ids)
    ref = s / s.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(weights.double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.sum(-1), torch.full((32,), 2.5), rtol=1e-6, atol=1e-6)
    # Without normalisation the weights are the raw unbiased scores (times the scaling factor).
    _, raw = sigmoid_grouped_topk(logits, bias, top_k=4, n_group=4, topk_group=2, renormalize=False, scaling_factor=2.5)
    torch.testing.assert_close(raw.double(), s * 2.5, rtol=1e-6, atol=1e-7)


def test_grouped_topk_only_picks_from_kept_groups():
    torch.manual_seed(7)
    logits, bias = torch.randn(64, E), 0.1 * torch.randn(E)
    ids, _ = sigmoid_grouped_topk(logits, bias, top_k=4, n_group=4, topk_group=2)
    choice = torch.sigmoid(logits.double()) + bias.double()
    group_score = choice.view(64, 4, 4).topk(2, dim=-1).values.sum(-1)
    kept = group_score.topk(2, dim=-1).indices
    assert bool((ids // 4).unsqueeze(-1).eq(kept.unsqueeze(1)).any(-1).all())


def test_softmax_renormalisation_happens_after_topk():
    torch.manual_seed(8)
    logits = torch.randn(32, E)
    probs = torch.softmax(logits.double(), -1)
    ids, raw = softmax_topk(logits, 4, renormalize=False)
    torch.testing.assert_close(raw.double(), probs.gather(-1, ids), rtol=1e-6, atol=1e-7)
    assert bool((raw.sum(-1) < 1).all())
    _, renorm = softmax_topk(logits, 4, renormalize=True)
    torch.testing.assert_close(renorm.double(), raw.double() / raw.double().sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_gpt_oss_softmax_over_k_equals_renormalised_full_softmax():
    # research §5.8: softmax of the k chosen logits == renormalised top-k of the full softmax.
    torch.manual_seed(9)
    logits = torch.randn(32, E)
    from runtime.routing import topk_softmax

    ids_a, w_a = topk_softmax(logits, 4)
    ids_b, w_b = softmax_topk(logits, 4, renormalize=True)
    _assert_same_routing((ids_a, w_a), (ids_b, w_b))


def test_sigmoid_router_rejects_groups_it_cannot_score():
    with pytest.raises(ValueError, match="groups"):
        SigmoidTopKRouter(hidden_size=H, num_experts=10, top_k=2, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="top-2"):
        SigmoidTopKRouter(hidden_size=H, num_experts=4, top_k=2, n_group=4, topk_group=2)
