"""Names of the draft (MTP) tensors a checkpoint carries beside the main model, for a build without a draft to ignore on purpose.

The loader refuses checkpoint tensors that nothing reads, so a build that does not run the draft must
say which tensors those are; deriving the patterns from config.json keeps that list exact (ignoring
a broader pattern could hide a real naming mistake in the main layers).
"""
from __future__ import annotations

# Families that store their MTP layers as extra decoder layers after the main ones (DeepSeek-V3
# README_WEIGHTS: layer id num_hidden_layers + k; GLM-4.5 the same; Kimi declares DeepseekV3).
_LAYER_AFTER_MAIN = ("deepseek_v3", "kimi_k2", "glm4_moe")
# Families whose MTP weights live under a top-level `mtp.` prefix (Qwen3-Next, Nemotron-H).
_MTP_PREFIX = ("qwen3_next", "nemotron_h")


def mtp_tensor_patterns(config: dict) -> tuple[str, ...]:
    """fnmatch patterns of the MTP tensors of a checkpoint with this config.json (empty if none known).

    transformers 5.x writes `num_nextn_predict_layers` into config.json even when it saved no MTP
    weights, so these are patterns to ignore, not tensors to expect.
    """
    model_type = config.get("model_type")
    if model_type in _LAYER_AFTER_MAIN:
        first = int(config["num_hidden_layers"])
        count = int(config.get("num_nextn_predict_layers") or 0)
        return tuple(f"model.layers.{first + k}.*" for k in range(count))
    if model_type in _MTP_PREFIX:
        return ("mtp.*",)
    # MiniMax-M2 declares MTP modules (num_mtp_modules), but its published checkpoints ship no MTP tensors
    # (MiniMax-M2 issue #47, MiniMax-M2.7 issue #16): nothing to ignore.
    return ()
