"""Expert activations: SiLU-GLU, gpt-oss clamped SwiGLU, and non-gated relu².

Gate and up arrive as separate tensors whatever the checkpoint layout (gpt-oss interleaves their
rows; its checkpoint source splits them), so every function here is elementwise.
"""
import torch
import torch.nn.functional as F

from contract import ACTIVATIONS, GATED


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss: gate clamped above at `limit`, up clamped to +-limit, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)², Nemotron-H's non-gated expert activation."""
    r = F.relu(x)
    return r * r


def apply(kind: str, gate: torch.Tensor | None, up: torch.Tensor, *, alpha: float = 1.702,
          limit: float = 7.0) -> torch.Tensor:
    """The activation `kind` of (gate, up); `gate` is None exactly for the non-gated kinds."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {kind!r}; known: {', '.join(ACTIVATIONS)}")
    if (gate is None) == (kind in GATED):
        raise ValueError(f"activation {kind} {'needs a' if kind in GATED else 'takes no'} gate projection")
    if kind == "silu_glu":
        return silu_glu(gate, up)
    if kind == "swiglu_oai":
        return swiglu_oai(gate, up, alpha=alpha, limit=limit)
    return relu2(up)
