"""VANILLA experts: the per-expert loop reference that every other implementation is tested against.

It keeps the canonical checkpoint tensors, dequantizes an expert's weights to fp32 when it runs it,
and computes both GEMMs in fp32. Activations are emulated exactly: the input and the intermediate are
quantized and dequantized as the run format's kernels would (formats.act_quant); the intermediate is
first rounded to the hidden dtype, as a bf16 activation would be. Slow by design; runs anywhere.
"""
import torch

from .. import activations
from ..formats.act_quant import quantize_dequantize_activation
from .base import ExpertsBase
from .canonical import WEIGHT_PARTS, dequantize_canonical


class _EagerLoopExperts(ExpertsBase):

    @classmethod
    def plain_dtype(cls, dtype):
        # Both GEMMs run in fp32: an fp32 build keeps its unquantized weights exact.
        return torch.float32 if dtype == torch.float32 else torch.bfloat16

    def _buffer_specs(self):
        n = len(self.expert_ids)
        return {f"{t.proj}_{t.kind}": ((n, *t.local_shape), t.dtype) for t in self.tensors}

    def _convert(self, staged, device):
        return {f"{t.proj}_{t.kind}": torch.stack([staged[e, t.proj, t.kind] for e in self.expert_ids]).to(device)
                for t in self.tensors}

    def _weight(self, i: int, proj: str) -> torch.Tensor:
        parts = {t.kind: getattr(self, f"{proj}_{t.kind}")[i]
                 for t in self.tensors if t.proj == proj and t.kind in WEIGHT_PARTS}
        return dequantize_canonical(self.FORMAT, parts, torch.float32)

    def _input_scale(self, i: int, *projs: str):
        # One activation quantization feeds gate and up together, so they share the larger of their
        # static scales (as vLLM's NVFP4 MoE does: w13_input_scale.max over gate and up).
        if self.FORMAT != "nvfp4":
            return None
        return torch.stack([getattr(self, f"{p}_input_scale")[i] for p in projs]).max()

    def _linear(self, x: torch.Tensor, i: int, proj: str, with_bias: bool = True) -> torch.Tensor:
        y = x @ self._weight(i, proj).T
        if self.spec.expert_bias and with_bias:
            y = y + getattr(self, f"{proj}_bias")[i].float()
        return y

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check_inputs(hidden, topk_ids, topk_weights)
        spec, fmt = self.spec, self.FORMAT
        first = ("gate", "up") if spec.gated else ("up",)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for i, expert in enumerate(self.expert_ids):
            token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
            if token.numel() == 0:
                continue
            x = quantize_dequantize_activation(hidden[token], fmt, self._input_scale(i, *first))
            gate = self._linear(x, i, "gate") if spec.gated else None
            up = self._linear(x, i, "up")
            h = activations.apply(spec.activation, gate, up, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
            h = quantize_dequantize_activation(h.to(hidden.dtype), fmt, self._input_scale(i, "down"))
            y = self._linear(h, i, "down", with_bias=self.adds_down_bias)
            out.index_add_(0, token, y * topk_weights[token, slot, None].float())
        return out.to(hidden.dtype)


class TorchEagerBf16Experts(_EagerLoopExperts):
    """VANILLA reference, bf16 weights and activations."""
    IMPL_ID = "torch.eager.loop.bf16"
    FORMAT = "bf16"


class TorchEagerFp8BlockScalesExperts(_EagerLoopExperts):
    """VANILLA reference, FP8 128x128 block weights, FP8 1x128 dynamic activations."""
    IMPL_ID = "torch.eager.loop.fp8_block_scales"
    FORMAT = "fp8_block_scales"


class TorchEagerW4a16Mxfp4Experts(_EagerLoopExperts):
    """VANILLA reference, MXFP4 weights, bf16 activations."""
    IMPL_ID = "torch.eager.loop.w4a16_mxfp4"
    FORMAT = "w4a16_mxfp4"


class TorchEagerW4a8Mxfp4Fp8Experts(_EagerLoopExperts):
    """VANILLA reference, MXFP4 weights, FP8 per-token dynamic activations."""
    IMPL_ID = "torch.eager.loop.w4a8_mxfp4_fp8"
    FORMAT = "w4a8_mxfp4_fp8"


class TorchEagerW4a8Mxfp4Mxfp8Experts(_EagerLoopExperts):
    """VANILLA reference, MXFP4 weights, MXFP8 activations (E8M0 per 32, floor rule)."""
    IMPL_ID = "torch.eager.loop.w4a8_mxfp4_mxfp8"
    FORMAT = "w4a8_mxfp4_mxfp8"


class TorchEagerW4a16Nvfp4Experts(_EagerLoopExperts):
    """VANILLA reference, NVFP4 weights, bf16 activations."""
    IMPL_ID = "torch.eager.loop.w4a16_nvfp4"
    FORMAT = "w4a16_nvfp4"


class TorchEagerNvfp4Experts(_EagerLoopExperts):
    """VANILLA reference, NVFP4 weights, NVFP4 activations with the static input_scale as global scale."""
    IMPL_ID = "torch.eager.loop.nvfp4"
    FORMAT = "nvfp4"
