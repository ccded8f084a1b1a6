"""The generated Eagle3 draft (`draft.py` of tiny_qwen3_moe's sm_120 target) computes the published Eagle3 head from a checkpoint in the published tensor layout, and maps its draft ids to target ids through d2t.

Oracle: the architecture written out here in float64 over the raw checkpoint tensors (vLLM
`llama_eagle3.py`: fc over the three target states; layer 0 with norm after residual: residual = fused,
x = cat(input_layernorm(embed), hidden_norm(fused)), Llama attention (half-split rotary, base 10000, GQA,
causal), + residual, + mlp(post_attention_layernorm(.)); logits = lm_head(norm(out))). The draft runs in
fp32 with no bf16 rounding anywhere (dense layer only): relative L2 error <= 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from tests.generated import builds

TARGET = "tiny_qwen3_moe_bf16__sm_120__tp1"


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, positions, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]


def _formula(t, ids, hidden, positions, head, step):
    h, heads, kv, hd = head["hidden_size"], head["num_heads"], head["num_kv_heads"], head["head_dim"]
    fused = hidden.double() @ t["fc.weight"].T if step == 0 else hidden.double()
    x = torch.cat((_rms(t["embed_tokens.weight"][ids], t["midlayer.input_layernorm.weight"]),
                   _rms(fused, t["midlayer.hidden_norm.weight"])), -1)
    b, s, _ = x.shape
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(b, s, heads, hd)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(b, s, kv, hd)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(b, s, kv, hd)
    q, k = _rotate(q, positions), _rotate(k, positions)
    k, v = k.repeat_interleave(heads // kv, 2), v.repeat_interleave(heads // kv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5
    scores = scores + torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, heads * hd)
    out = fused + attn @ t["midlayer.self_attn.o_proj.weight"].T
    m = _rms(out, t["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T))
    out = out + mlp @ t["midlayer.mlp.down_proj.weight"].T
    return _rms(out, t["norm.weight"]) @ t["lm_head.weight"].T, out


@pytest.fixture(scope="module")
def case():
    module = builds.load(f"generated.tiny_qwen3_moe.{TARGET}.draft")
    head = module.HEAD
    h, th, hd = head["hidden_size"], head["target_hidden_size"], head["head_dim"]
    gen = torch.Generator().manual_seed(11)

    def rand(*shape, norm=False):
        values = torch.randn(shape, generator=gen)
        return (1.0 + 0.2 * values if norm else 0.08 * values).to(torch.bfloat16)

    covered = torch.randperm(head["vocab_size"], generator=gen)[: head["draft_vocab_size"]].sort().values
    t2d = torch.zeros(head["vocab_size"], dtype=torch.bool)
    t2d[covered] = True
    tensors = {
        "embed_tokens.weight": rand(head["vocab_size"], h), "fc.weight": rand(h, 3 * th),
        "midlayer.input_layernorm.weight": rand(h, norm=True), "midlayer.hidden_norm.weight": rand(h, norm=True),
        "midlayer.self_attn.q_proj.weight": rand(head["num_heads"] * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(head["num_kv_heads"] * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(head["num_kv_heads"] * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, head["num_heads"] * hd),
        "midlayer.post_attention_layernorm.weight": rand(h, norm=True),
        "midlayer.mlp.gate_proj.weight": rand(head["intermediate_size"], h),
        "midlayer.mlp.up_proj.weight": rand(head["intermediate_size"], h),
        "midlayer.mlp.down_proj.weight": rand(h, head["intermediate_size"]),
        "norm.weight": rand(h, norm=True), "lm_head.weight": rand(head["draft_vocab_size"], h),
        # Published layout: d2t holds offsets (target id = draft id + d2t[draft id]); t2d marks the covered ids.
        "d2t": covered - torch.arange(head["draft_vocab_size"]), "t2d": t2d,
    }
    folder = builds.write_checkpoint(builds.tmp_folder("tiny_qwen3_moe_eagle3"), tensors, {"architectures": ["LlamaForCausalLMEagle3"]})
    draft = module.DRAFT_CLASS(dtype=torch.float32)
    report = draft.load_checkpoint(folder)
    return module, draft, report, {k: (v.double() if v.is_floating_point() else v) for k, v in tensors.items()}, covered


def test_the_draft_reads_every_published_eagle3_tensor(case):
    module, draft, report, tensors, _ = case
    assert type(draft).INPUT == "aux_hidden" and type(draft).AUX_LAYERS == module.AUX_LAYERS == (0, 0, 1)
    assert report.tensors == len(tensors) and list(report.ignored) == []


def test_the_draft_computes_the_eagle3_formula_in_float64_for_the_first_and_a_later_step(case):
    module, draft, _, t, _ = case
    head = module.HEAD
    ids, next_ids = builds.token_ids(head["vocab_size"], 2, 9), builds.token_ids(head["vocab_size"], 2, 9)
    aux = torch.randn(2, 9, 3 * head["target_hidden_size"])
    positions = torch.arange(9)
    with torch.no_grad():
        logits, hidden = draft(ids, aux, positions)
        expected, expected_hidden = _formula(t, ids, aux, positions, head, 0)
        later, _ = draft(next_ids, hidden, positions, step=1)
        expected_later, _ = _formula(t, next_ids, hidden, positions, head, 1)
        caches = draft.new_caches(2, 16)
        steps = [draft(ids[:, i:i + 1], aux[:, i:i + 1], positions[i:i + 1], caches[0])[0] for i in range(9)]
    assert logits.shape == (2, 9, head["draft_vocab_size"])
    assert builds.rel_err(logits, expected) <= 1e-5 and builds.rel_err(hidden, expected_hidden) <= 1e-5
    assert builds.rel_err(later, expected_later) <= 1e-5
    assert builds.rel_err(torch.cat(steps, 1), logits) <= 1e-5


def test_draft_ids_map_to_the_target_ids_d2t_names(case):
    module, draft, _, _, covered = case
    ids = builds.token_ids(module.HEAD["draft_vocab_size"], 2, 20)
    assert torch.equal(draft.to_target_ids(ids), covered[ids])


def test_a_head_without_its_own_embedding_reads_the_targets(case, tmp_path):
    """Published heads often ship no `embed_tokens`: after `share_embedding(target)` the draft loads such a
    checkpoint and embeds with the target build's table (the formula with the target's embedding)."""
    module, _, _, t, _ = case
    head = module.HEAD
    target = builds.load(f"generated.tiny_qwen3_moe.{TARGET}.modeling").MODEL_CLASS(dtype=torch.float32)
    target.init_random(5)
    tensors = builds.read_tensors(builds.tmp_folder("tiny_qwen3_moe_eagle3"))
    del tensors["embed_tokens.weight"]
    folder = builds.write_checkpoint(tmp_path / "no_embed", tensors, {"architectures": ["LlamaForCausalLMEagle3"]})
    draft = module.DRAFT_CLASS(dtype=torch.float32)
    draft.share_embedding(target)
    report = draft.load_checkpoint(folder)
    assert report.tensors == len(tensors) and "head.embed_tokens.weight" not in dict(draft.named_parameters())
    ids, aux = builds.token_ids(head["vocab_size"], 2, 7), torch.randn(2, 7, 3 * head["target_hidden_size"])
    with torch.no_grad():
        logits, _ = draft(ids, aux, torch.arange(7))
    shared = dict(t, **{"embed_tokens.weight": target.model.embed_tokens.weight.double()})
    expected, _ = _formula(shared, ids, aux, torch.arange(7), head, 0)
    assert builds.rel_err(logits, expected) <= 1e-5
