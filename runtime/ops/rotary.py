"""Rotary position embeddings: the frequency tables (default, YaRN, Llama-3) and their application to q/k.

One `RotaryEmbedding` per model turns positions into `(cos, sin)` once per forward; every attention layer
then rotates its own q and k with `apply_rotary`. The families differ in three independent choices,
each a constructor argument rather than a family name so a template inlines exactly what a checkpoint's
config says:

- how many leading dims of a head rotate (`rotary_dim`: all of them, half for GLM-4 MoE, `rotary_dim`
  for MiniMax-M2, `qk_rope_head_dim` for MLA);
- the frequency scaling (`default`, `yarn` for DeepSeek-V3/Kimi/gpt-oss, `llama3`);
- the pair layout: half-split pairs `(x[i], x[i + d/2])` (Llama/NeoX style: Qwen3, Mixtral, GLM, MiniMax,
  gpt-oss) or interleaved pairs `(x[2i], x[2i+1])` (DeepSeek-V3/Kimi MLA weights).

YaRN's attention factor multiplies cos and sin, as transformers does (gpt-oss: ~1.35; DeepSeek-V3: 1.0,
its correction goes into the MLA softmax scale instead, see `yarn_mscale`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from runtime.kernels import rotary as rotary_kernel


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/d) for i < d/2, in fp32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (base**exponents)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when the context is not stretched)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
    """The cos/sin multiplier: `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are given
    (DeepSeek-V3: 1.0), otherwise `mscale(factor)` (gpt-oss)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_inv_freq(
    rotary_dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN "NTK-by-parts": fast-rotating dims keep their frequency, slow ones are divided by `factor`,
    with a linear blend between the dims that complete `beta_fast` and `beta_slow` turns over the
    original context."""

    def dim_for_turns(turns: float) -> float:
        # The (fractional) dim index whose wavelength fits `turns` times into the original context.
        return rotary_dim * math.log(original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for_turns(beta_fast), dim_for_turns(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width blend would divide by zero
    half = rotary_dim // 2
    blend = ((torch.arange(half, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0.0, 1.0)
    wavelength_base = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim)
    kept = 1.0 / wavelength_base
    stretched = 1.0 / (factor * wavelength_base)
    # blend 0 -> keep the frequency (extrapolate), blend 1 -> divide it by `factor` (interpolate).
    return stretched * blend + kept * (1.0 - blend)


def llama3_inv_freq(
    rotary_dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    theta = default_inv_freq(rotary_dim, base)
    wavelen = 2 * math.pi / theta
    long_edge = original_max_position_embeddings / low_freq_factor
    short_edge = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * theta / factor + smooth * theta
    out = torch.where(wavelen > long_edge, theta / factor, blended)
    return torch.where(wavelen < short_edge, theta, out)


def mla_softmax_scale(qk_head_dim: int, rope_scaling: str = "default", factor: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """DeepSeek MLA: `qk_head_dim^-0.5`, times `yarn_mscale(factor, mscale_all_dim)^2` under YaRN when
    `mscale_all_dim` is set (DeepSeek-V3: factor 40, mscale_all_dim 1.0 -> x1.874)."""
    scale = qk_head_dim**-0.5
    if rope_scaling != "default" and mscale_all_dim:
        m = yarn_mscale(factor, mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Positions -> `(cos, sin)`, each `[*positions.shape, rotary_dim / 2]` fp32, shared by a model's layers.

    Computed per call from `inv_freq` (a few hundred multiplies per token) instead of a max-length table:
    no length limit to declare, nothing to rebuild after a move, and no host sync. `inv_freq` is computed
    on the CPU at construction and placed on the device the module is constructed on (under
    `with torch.device(...)`), so a CUDA forward reads no host tensor and a decode step captures in a
    CUDA graph; under a meta-device context it stays on the CPU (meta tensors hold no values). It
    follows the module on `.to()`.
    """

    def __init__(
        self,
        *,
        rotary_dim: int,
        base: float,
        scaling: str = "default",
        factor: float = 1.0,
        original_max_position_embeddings: int | None = None,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        truncate: bool = True,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        attention_factor: float | None = None,
        low_freq_factor: float | None = None,
        high_freq_factor: float | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        if scaling == "default":
            inv_freq, attn = default_inv_freq(rotary_dim, base), 1.0
        elif scaling == "yarn":
            inv_freq = yarn_inv_freq(
                rotary_dim, base, factor, original_max_position_embeddings, beta_fast, beta_slow, truncate
            )
            attn = yarn_attention_factor(factor, mscale, mscale_all_dim)
        elif scaling == "llama3":
            inv_freq = llama3_inv_freq(
                rotary_dim, base, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
            )
            attn = 1.0
        else:
            raise ValueError(f"unsupported rotary scaling {scaling!r}; expected default, yarn or llama3")
        self.attention_scaling = float(attention_factor) if attention_factor is not None else float(attn)
        device = torch.get_default_device()
        if device.type != "meta":
            inv_freq = inv_freq.to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # `.to` is a no-op on the construction device; it only moves a table of a meta-constructed build.
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` dims of each head of `x [B, S, heads, D]`; the rest pass through.

    `cos`/`sin` are `[S, rotary_dim / 2]`. They are cast to `x.dtype` first and the rotation runs in that
    dtype, as in transformers, so bf16 builds round where the reference rounds.
    On CUDA, half-split pairs run as one Triton kernel (`runtime.kernels.rotary`) with the same rounding.
    """
    if rotary_kernel.applies(x, cos, interleaved):
        return rotary_kernel.apply(x, cos, sin, interleaved)
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    c = cos.to(x.dtype)[:, None, :]
    s = sin.to(x.dtype)[:, None, :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rotated = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    if rest.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, rest), dim=-1)
