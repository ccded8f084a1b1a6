"""The activations each run format feeds its GEMMs, emulated exactly (docs/runtime.md, "Run formats").

The result is always fp32: the exact values the quantized GEMM multiplies. Formats whose activations
stay in the hidden dtype return their input's values unchanged.
"""
import torch

from . import RUN_FORMATS
from .fp8 import qdq_act_groups, qdq_act_per_token
from .mxfp8 import qdq_mxfp8
from .nvfp4 import qdq_nvfp4_activation

IDENTITY_FORMATS = ("bf16", "w4a16_mxfp4", "w4a16_nvfp4")


def quantize_dequantize_activation(x: torch.Tensor, fmt: str, input_scale=None) -> torch.Tensor:
    """fp32 values of `x` [..., K] after the activation quantization of run format `fmt`.

    `input_scale` (fp32 scalar) is required by `nvfp4`, whose global activation scale is static.
    """
    if fmt in IDENTITY_FORMATS:
        return x.float()
    if fmt == "fp8_block_scales":
        return qdq_act_groups(x)
    if fmt == "w4a8_mxfp4_fp8":
        return qdq_act_per_token(x)
    if fmt == "w4a8_mxfp4_mxfp8":
        return qdq_mxfp8(x)
    if fmt == "nvfp4":
        if input_scale is None:
            raise ValueError("run format nvfp4 quantizes activations with the checkpoint's static "
                             "input_scale; none was given")
        return qdq_nvfp4_activation(x, input_scale)
    raise ValueError(f"unknown run format {fmt!r}; known: {', '.join(RUN_FORMATS)}")
