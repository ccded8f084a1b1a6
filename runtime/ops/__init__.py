"""Model ops that generated builds assemble: norms, rotary, attention, Mamba-2 mixers, MLPs, MoE block, MTP, Eagle3, heads.

Constructors take explicit keyword arguments (numbers, booleans, short strings), never config objects,
and name submodules and parameters as the checkpoints do (docs/runtime.md, "Model ops"). Parameters are
allocated empty with the dtype given at construction (fp32 where a reference keeps fp32: router weights
and correction biases); build a model in its final dtype rather than calling `.to(dtype)` on it.
"""
from runtime.ops.attention_core import attention
from runtime.ops.eagle3 import Eagle3Head
from runtime.ops.embedding import LMHead, VocabEmbedding
from runtime.ops.gated_deltanet import GatedDeltaNet, RecurrentState
from runtime.ops.gqa import GQAttention
from runtime.ops.kv_cache import StaticCache
from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear
from runtime.ops.mamba import Mamba2Mixer, MambaState
from runtime.ops.mla import MLAttention
from runtime.ops.mlp import MLP, SharedExpertGate
from runtime.ops.moe import MoEBlock
from runtime.ops.mtp import FcMTPPredictor, MTPBlock, PatternMTPPredictor, SharedHead
from runtime.ops.norms import GatedRMSNorm, ProjectionRMSNorm, RMSNorm
from runtime.ops.rotary import RotaryEmbedding, apply_rotary, mla_softmax_scale

__all__ = [
    "ColumnParallelLinear", "Eagle3Head", "FcMTPPredictor", "GatedDeltaNet", "GatedRMSNorm", "GQAttention", "LMHead", "MLAttention", "MLP", "Mamba2Mixer",
    "MambaState", "MoEBlock", "MTPBlock", "PatternMTPPredictor", "ProjectionRMSNorm", "RecurrentState", "RMSNorm", "RotaryEmbedding", "RowParallelLinear",
    "SharedExpertGate", "SharedHead",
    "StaticCache", "VocabEmbedding", "apply_rotary", "attention", "mla_softmax_scale",
]
