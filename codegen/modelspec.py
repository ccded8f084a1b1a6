"""A declaration's HF-style config, normalized into the constants a family template inlines.

Declarations hold config.json keys as checkpoints publish them (`rope_theta`, `rope_scaling`, keys
left out when they equal the library default). This fills each family's defaults and resolves the
rotary parameters, so templates read one flat dict. A test checks every value here against the
transformers config class built from the same keys (the oracle for what the checkpoint means).
"""

from __future__ import annotations

from typing import Any

# Each family's config-class defaults for the keys its template reads (transformers 5.x).
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(rope_theta=10000.0, attention_bias=False, rope_interleave=True, norm_topk_prob=True, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1, rms_norm_eps=1e-6, q_lora_rank=1536,
                        tie_word_embeddings=False),
    "glm4_moe": dict(rope_theta=10000.0, partial_rotary_factor=0.5, attention_bias=False, use_qk_norm=False, norm_topk_prob=True,
                     n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=1, rms_norm_eps=1e-5,
                     tie_word_embeddings=False),
    "qwen3_moe": dict(rope_theta=10000.0, attention_bias=False, sliding_window=None, norm_topk_prob=False, rms_norm_eps=1e-6,
                      decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    "mixtral": dict(rope_theta=1000000.0, head_dim=None, sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "gpt_oss": dict(rope_theta=150000.0, attention_bias=True, sliding_window=128, swiglu_limit=7.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=4096)),
    "minimax_m2": dict(rope_theta=5000000.0, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def rope(config: dict, family: str, head_dim: int) -> dict:
    """Rotary constants: kind, base, rotary dim and the scaling parameters (yarn / llama3)."""
    scaling = dict(config.get("rope_scaling") or DEFAULTS[family].get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if family == "minimax_m2" and config.get("rotary_dim"):
        rotary_dim = config["rotary_dim"]
    else:
        factor = config.get("partial_rotary_factor", DEFAULTS[family].get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * factor)
    out = {"scaling": kind, "base": float(config.get("rope_theta", DEFAULTS[family]["rope_theta"])), "rotary_dim": rotary_dim}
    if kind == "yarn":
        out |= {
            "factor": float(scaling["factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            "beta_fast": float(scaling.get("beta_fast") or 32.0),
            "beta_slow": float(scaling.get("beta_slow") or 1.0),
            "truncate": bool(scaling.get("truncate", True)),
            "mscale": scaling.get("mscale"),
            "mscale_all_dim": scaling.get("mscale_all_dim"),
            "attention_factor": scaling.get("attention_factor"),
        }
    elif kind == "llama3":
        out |= {k: scaling[k] for k in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
    return out


def normalize(family: str, config: dict) -> dict:
    """Defaults filled in, head_dim and rotary parameters resolved, one layer kind per layer."""
    c = DEFAULTS[family] | {k: v for k, v in config.items()}
    c.pop("rope_scaling", None)
    if family == "deepseek_v3":
        head_dim = c["qk_rope_head_dim"]
    else:
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        c["head_dim"] = head_dim
    c["rope"] = rope(config, family, head_dim)
    if family == "gpt_oss":
        types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c["num_hidden_layers"])]
        c["sliding_windows"] = tuple(c["sliding_window"] if t == "sliding_attention" else None for t in types)
    else:
        c["sliding_windows"] = (c.get("sliding_window"),) * c["num_hidden_layers"]
    return c
