"""Writes a one-rank build's seeded random weights as an HF checkpoint under the loader's names, so runs without a real checkpoint still load one model shard by shard; and converts a checkpoint's tensors to DeepSeek's FP8 block layout.

Random weights drawn separately on each rank would not be shards of one model, and a run that skipped
the loader would not test it; one written checkpoint serves both (`python -m generated.run --tiny` and
the parallel tests). The build is only read for names, shapes and dtypes (it may live on the meta
device, so a build whose kernels need a GPU still writes its checkpoint on a CPU host). Expert tensors
are written in the canonical per-expert form of docs/runtime.md through the storage layout of the
family, named by the same code that reads them (`experts_sources`), and a test reads every written
layout back through `experts_source`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from runtime.build import checkpoint_tensors, random_values
from runtime.checkpoint.experts_sources import GATE_UP_DOWN, W1_W3_W2, PerExpertSource
from runtime.checkpoint.loader import find_experts_modules
from runtime.checkpoint.reader import CONFIG_FILE, SINGLE_FILE
from runtime.experts.base import WEIGHT_KIND, random_source

# The experts storages a family's spec names (`experts_storage`): per-expert tensors named as in
# experts_sources.py, or one fused tensor per projection (the hub's MXFP4 blocks/scales, or what
# transformers saves for bf16), whose layout depends on the run format.
STORAGES = ("gate_up_down", "w1_w3_w2", "fused_gate_up")


def experts_layout(storage: str, fmt: str) -> str:
    """The `experts_sources.LAYOUTS` entry a checkpoint of experts `storage` keeps experts of run format `fmt` in."""
    if storage not in STORAGES:
        raise ValueError(f"no known experts storage {storage!r}; known: {', '.join(STORAGES)}")
    if storage != "fused_gate_up":
        return storage
    weight_kind = WEIGHT_KIND[fmt]
    if weight_kind not in ("bf16", "mxfp4"):
        raise ValueError(f"gpt-oss checkpoints hold bf16 or MXFP4 experts, not {fmt}")
    return "gpt_oss_mxfp4" if weight_kind == "mxfp4" else "gpt_oss_bf16"


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows 2j = gate row j, 2j+1 = up row j (gpt-oss's fused gate_up)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def stored_expert_tensors(canonical: Mapping[tuple[int, str, str], torch.Tensor], num_experts: int, layout: str,
                          prefix: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors holding `canonical` ((expert, proj, kind) -> whole canonical tensor) in `layout`."""
    if layout in ("gate_up_down", "w1_w3_w2"):
        names = PerExpertSource(None, prefix, GATE_UP_DOWN if layout == "gate_up_down" else W1_W3_W2)
        return {names.name(e, proj, kind): t.contiguous() for (e, proj, kind), t in canonical.items()}
    experts = range(num_experts)

    def stack(proj, kind):
        return torch.stack([canonical[e, proj, kind] for e in experts])

    kinds = {kind for _, _, kind in canonical}
    out = {}
    if "bias" in kinds:
        out[f"{prefix}.gate_up_proj_bias"] = torch.stack(
            [_interleave(canonical[e, "gate", "bias"], canonical[e, "up", "bias"]) for e in experts])
        out[f"{prefix}.down_proj_bias"] = stack("down", "bias")
    if layout == "gpt_oss_bf16":
        # transformers saves these input-major: [E, H, 2I] (gate/up interleaved along the last dim), [E, I, H].
        gate_up = torch.stack([_interleave(canonical[e, "gate", "weight"], canonical[e, "up", "weight"]) for e in experts])
        out[f"{prefix}.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        out[f"{prefix}.down_proj"] = stack("down", "weight").transpose(1, 2).contiguous()
        return out
    if layout == "gpt_oss_mxfp4":
        # Blocks [E, rows, in/32, 16] bytes and scales [E, rows, in/32], rows interleaved for gate_up.
        for fused, projs in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            for kind, suffix in (("weight", "blocks"), ("weight_scale", "scales")):
                if len(projs) == 2:
                    value = torch.stack([_interleave(canonical[e, "gate", kind], canonical[e, "up", kind]) for e in experts])
                else:
                    value = stack("down", kind)
                if kind == "weight":
                    value = value.reshape(*value.shape[:2], -1, 16)
                out[f"{prefix}.{fused}_{suffix}"] = value.contiguous()
        return out
    raise ValueError(f"unknown experts layout {layout!r}")


def random_tensors(model: nn.Module, storage: str, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor a one-rank build reads, random (never zeros for weights), on the CPU; routed
    experts in the family's experts `storage` (its spec's `experts_storage`)."""
    experts = find_experts_modules(model)
    for name, module in experts.items():
        parallel = getattr(module, "parallel", None)
        if getattr(parallel, "ep_size", 1) > 1 or getattr(parallel, "moe_tp_size", 1) > 1:
            raise ValueError(f"{name} holds one rank's slice of its experts; write a checkpoint from a one-rank (tp1) build")
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in checkpoint_tensors(model):
        if id(tensor) in seen or any(name.startswith(p + ".") for p in experts):
            continue  # tied tensors are written once, under their first name (the loader needs one)
        seen.add(id(tensor))
        if getattr(tensor, "shard", None) is not None:
            raise ValueError(f"{name} is a tensor-parallel shard; write a checkpoint from a one-rank (tp1) build")
        if tensor.is_floating_point():
            out[name] = random_values(name, tensor.shape, gen, std).to(tensor.dtype)
        else:
            out[name] = torch.zeros(tuple(tensor.shape), dtype=tensor.dtype)
    for prefix in sorted(experts):
        module = experts[prefix]
        spec, fmt = module.spec, module.FORMAT
        source = random_source(spec, fmt, range(spec.num_experts), gen, std=std)
        out.update(stored_expert_tensors(source.tensors, spec.num_experts, experts_layout(storage, fmt), prefix))
    return out


# DeepSeek-V3's FP8 checkpoint (research formats_configs §1): every Linear of attention, the dense MLPs and
# the shared and routed experts is float8_e4m3fn `weight` plus fp32 `weight_scale_inv` per 128x128 block;
# the router (`mlp.gate`), norms, embeddings and lm_head stay unquantized. Its config.json's
# quantization_config, exactly as DeepSeek-V3 ships it (no modules_to_not_convert):
FP8_BLOCK_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def fp8_block_quantized(name: str) -> bool:
    """Whether DeepSeek's FP8 checkpoints keep tensor `name` (a checkpoint name) in 128x128 blocks."""
    return name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")) and ".mlp.gate." not in name


def fp8_block_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (a checkpoint's, by name) in DeepSeek's FP8 layout: each `fp8_block_quantized` float weight
    as its float8_e4m3fn codes and a `weight_scale_inv` beside it (block amax / 448), the rest (codes already,
    their scales, what DeepSeek keeps unquantized) as given."""
    from runtime.formats import fp8

    out = {}
    for name, tensor in tensors.items():
        if fp8_block_quantized(name) and tensor.dtype != torch.float8_e4m3fn:
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = fp8.quantize_weight_blocks(tensor)
        else:
            out[name] = tensor
    return out


def save_checkpoint(tensors: Mapping[str, torch.Tensor], path: str | Path, config: dict | None = None) -> Path:
    """`tensors` as `model.safetensors` (and `config` as config.json) in folder `path`, created if needed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path / SINGLE_FILE))
    if config is not None:
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path

