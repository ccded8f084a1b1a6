"""Writes tiny checkpoints for the checkpoint tests: models of the six families saved by transformers itself, and quantized checkpoints in the hub layouts written with our codecs.

Saving through transformers makes the names, orientations and config fields something nobody on this
team wrote; the quantized checkpoints start from such a saved model and replace its linear weights
the way the real producers do (DeepSeek FP8 blocks, the gpt-oss MXFP4 converter, ModelOpt NVFP4), so
the tests can read them back through independent oracles. Every builder is seeded and cached per
process: each checkpoint is written once per test session into a temporary folder.
"""
from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from runtime.formats import fp8, mxfp4, nvfp4

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "minimax_m2")
HIDDEN = 64
MOE_INTER = 32
EXPERTS = 4
LAYERS = 2

_ROOT = Path(tempfile.mkdtemp(prefix="moegen-ckpt-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def tiny_config(family: str, *, hidden: int = HIDDEN, moe_inter: int = MOE_INTER, dense_inter: int = 96):
    """A transformers config of `family` small enough to build in milliseconds."""
    import transformers

    common = dict(vocab_size=64, hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, intermediate_size=dense_inter, moe_intermediate_size=moe_inter, n_routed_experts=EXPERTS,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, intermediate_size=dense_inter, moe_intermediate_size=moe_inter, n_routed_experts=EXPERTS,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
            head_dim=16)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=dense_inter, moe_intermediate_size=moe_inter,
                                           num_experts=EXPERTS, num_experts_per_tok=2, head_dim=16)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=moe_inter, num_local_experts=EXPERTS,
                                          num_experts_per_tok=2, head_dim=16)
    if family == "minimax_m2":
        return transformers.MiniMaxM2Config(**common, intermediate_size=moe_inter, num_local_experts=EXPERTS,
                                            num_experts_per_tok=2, head_dim=16)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, intermediate_size=moe_inter, num_local_experts=EXPERTS,
                                         num_experts_per_tok=2, head_dim=16)
    raise ValueError(f"unknown family {family!r}")


def moe_layers(family: str) -> tuple[int, ...]:
    # DeepSeek-V3 and GLM-4 MoE start with first_k_dense_replace (here 1) dense layers.
    return (1,) if family in ("deepseek_v3", "glm4_moe") else tuple(range(LAYERS))


def experts_prefix(family: str, layer: int) -> str:
    """Where a family's checkpoint keeps layer `layer`'s routed experts."""
    block = "block_sparse_moe" if family in ("mixtral", "minimax_m2") else "mlp"
    return f"model.layers.{layer}.{block}.experts"


def activation(family: str) -> str:
    return "swiglu_oai" if family == "gpt_oss" else "silu_glu"


@dataclass
class SavedModel:
    """A checkpoint folder and the values it was written from."""

    path: Path
    family: str
    config: dict
    # The transformers model's own state (its run-time names and layouts), the oracle for loads.
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    # Unquantized values of every tensor a quantized fixture replaced, by checkpoint name.
    originals: dict[str, torch.Tensor] = field(default_factory=dict)


def _randomize(model: nn.Module, seed: int) -> None:
    """Distinct random values everywhere (init leaves norms at 1 and biases at 0, which would hide
    a swapped name), in each tensor's own dtype."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(model.state_dict(keep_vars=True).items()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)


def _build_model(family: str, seed: int, **config_kw):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **config_kw), dtype=torch.bfloat16)
    _randomize(model, seed)
    return model


@functools.lru_cache(maxsize=None)
def saved_model(family: str, *, sharded: bool = False, seed: int = 0) -> SavedModel:
    """A tiny `family` model saved with transformers' save_pretrained (sharded with an index if asked)."""
    path = _ROOT / f"{family}{'-sharded' if sharded else ''}-{seed}"
    model = _build_model(family, seed)
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "1GB")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return SavedModel(path, family, json.loads((path / "config.json").read_text()), state)


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (test helper; tiny checkpoints only)."""
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k).clone()
    return out


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict, *, shards: int = 1,
                     hf_quant_config: dict | None = None) -> Path:
    """A checkpoint folder: config.json, one model.safetensors or `shards` files and an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if hf_quant_config is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    names = sorted(tensors)
    contiguous = {k: tensors[k].contiguous() for k in names}
    if shards == 1:
        save_file(contiguous, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: contiguous[k] for k in names[i * per:(i + 1) * per]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in contiguous.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


# -- DeepSeek FP8 blocks (+ MTP) ----------------------------------------------------------------------

FP8_HIDDEN = 192      # not a multiple of 128: every weight has partial edge blocks
FP8_MOE_INTER = 160
FP8_DENSE_INTER = 288


def _is_fp8_linear(name: str) -> bool:
    # DeepSeek-V3 quantizes every Linear in attention, dense MLP, shared and routed experts; the
    # router (mlp.gate), norms, embeddings and lm_head stay unquantized (research note §1.5).
    return (name.endswith("_proj.weight") or name.endswith("proj_with_mqa.weight")) and ".mlp.gate." not in name


def _mtp_tensors(tensors: dict[str, torch.Tensor], hidden: int, layer: int, gen) -> dict[str, torch.Tensor]:
    """MTP layer `layer` (research note §4): enorm, hnorm, eh_proj [H, 2H], shared_head, embedding, and
    a full decoder layer (a copy of the last main layer's tensors under the new index)."""
    last = layer - 1
    out = {}
    for name, t in tensors.items():
        if name.startswith(f"model.layers.{last}."):
            out[name.replace(f"model.layers.{last}.", f"model.layers.{layer}.", 1)] = t.clone()
    p = f"model.layers.{layer}."
    bf = torch.bfloat16
    out[p + "enorm.weight"] = torch.randn(hidden, generator=gen).to(bf)
    out[p + "hnorm.weight"] = torch.randn(hidden, generator=gen).to(bf)
    out[p + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.05).to(bf)
    out[p + "shared_head.norm.weight"] = torch.randn(hidden, generator=gen).to(bf)
    out[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    out[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    return out


@functools.lru_cache(maxsize=None)
def deepseek_fp8(*, mtp: bool = False, seed: int = 1) -> SavedModel:
    """A DeepSeek-V3 checkpoint in its hub FP8 layout (`weight` + fp32 `weight_scale_inv` per 128x128)."""
    path = _ROOT / f"deepseek_fp8{'-mtp' if mtp else ''}-{seed}"
    model = _build_model("deepseek_v3", seed, hidden=FP8_HIDDEN, moe_inter=FP8_MOE_INTER,
                         dense_inter=FP8_DENSE_INTER)
    src = path.with_name(path.name + "-bf16")
    model.save_pretrained(src)
    tensors = read_all(src)
    config = json.loads((src / "config.json").read_text())
    originals = {}
    for name in sorted(tensors):
        if _is_fp8_linear(name):
            w = tensors.pop(name)
            originals[name] = w
            q, scale = fp8.quantize_weight_blocks(w)
            tensors[name] = q
            tensors[name[: -len("weight")] + "weight_scale_inv"] = scale
    if mtp:
        gen = torch.Generator().manual_seed(seed + 100)
        tensors.update(_mtp_tensors(tensors, FP8_HIDDEN, config["num_hidden_layers"], gen))
        config["num_nextn_predict_layers"] = 1
    else:
        config["num_nextn_predict_layers"] = 0
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    write_checkpoint(path, tensors, config, shards=2)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return SavedModel(path, "deepseek_v3", config, state, originals)


# -- gpt-oss MXFP4 ------------------------------------------------------------------------------------


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., I, X] gate and up -> [..., 2I, X] with row 2j = gate_j, 2j+1 = up_j (gpt-oss)."""
    return torch.stack((gate, up), dim=-2).reshape(*gate.shape[:-2], 2 * gate.shape[-2], gate.shape[-1])


@functools.lru_cache(maxsize=None)
def gpt_oss_mxfp4(*, seed: int = 2) -> SavedModel:
    """A gpt-oss checkpoint in the hub MXFP4 layout: experts as `*_blocks`/`*_scales` [E, rows, G, 16],
    rows out-major with gate/up interleaved, biases bf16; everything else as transformers saved it."""
    base = saved_model("gpt_oss", seed=seed)
    tensors = read_all(base.path)
    originals = {}
    for layer in moe_layers("gpt_oss"):
        p = experts_prefix("gpt_oss", layer)
        # transformers' layout is input-major [E, H, 2I] / [E, I, H]; the hub's is out-major.
        for proj in ("gate_up_proj", "down_proj"):
            w = tensors.pop(f"{p}.{proj}")
            originals[f"{p}.{proj}"] = w
            packed, scales = mxfp4.quantize_mxfp4(w.transpose(1, 2).contiguous().float())
            tensors[f"{p}.{proj}_blocks"] = mxfp4.canonical_to_gpt_oss_blocks(packed)
            tensors[f"{p}.{proj}_scales"] = scales
    config = dict(base.config)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    path = write_checkpoint(_ROOT / f"gpt_oss_mxfp4-{seed}", tensors, config)
    return SavedModel(path, "gpt_oss", config, base.state, originals)


# -- ModelOpt NVFP4 -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def qwen3_moe_nvfp4(*, seed: int = 3) -> SavedModel:
    """A Qwen3-MoE checkpoint as ModelOpt exports NVFP4: per-expert and attention Linears as
    `weight` uint8 + `weight_scale` e4m3 + `weight_scale_2` + `input_scale`, gate and up of an expert
    sharing `weight_scale_2`; routers, norms, embeddings and lm_head unquantized; hf_quant_config.json."""
    base = saved_model("qwen3_moe", seed=seed)
    tensors = read_all(base.path)
    gen = torch.Generator().manual_seed(seed + 100)
    originals = {}
    linears = sorted(n for n in tensors if n.endswith("_proj.weight"))
    shared_scale_2 = {}
    for name in linears:
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            # ModelOpt forces gate and up to one weight_scale_2: the larger amax of the two.
            expert = name.rsplit(".", 2)[0]
            if expert not in shared_scale_2:
                pair = [tensors[f"{expert}.{p}.weight"] for p in ("gate_proj", "up_proj")]
                shared_scale_2[expert] = torch.stack([nvfp4.weight_scale_2(w) for w in pair]).max()
            scale_2 = shared_scale_2[expert]
        else:
            scale_2 = None
        w = tensors.pop(name)
        originals[name] = w
        packed, scale, s2 = nvfp4.quantize_nvfp4_weight(w.float(), scale_2)
        stem = name[: -len("weight")]
        tensors[stem + "weight"] = packed
        tensors[stem + "weight_scale"] = scale
        tensors[stem + "weight_scale_2"] = s2.reshape(()).float().clone()
        tensors[stem + "input_scale"] = (torch.rand((), generator=gen) * 0.01 + 0.001).float()
    exclude = ["lm_head", "model.layers.*.mlp.gate"]
    hf_quant = {"producer": {"name": "modelopt", "version": "0.39.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": exclude}}
    config = dict(base.config)
    config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4",
        "config_groups": {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"]}},
        "ignore": exclude, "producer": {"name": "modelopt", "version": "0.39.0"}}
    path = write_checkpoint(_ROOT / f"qwen3_moe_nvfp4-{seed}", tensors, config, hf_quant_config=hf_quant)
    return SavedModel(path, "qwen3_moe", config, base.state, originals)


# -- builds to load into ------------------------------------------------------------------------------


class Mirror(nn.Module):
    """A stand-in for a build: parameters under checkpoint names, experts modules under their prefixes."""


def mirror(params: dict[str, tuple[tuple[int, ...], torch.dtype]], experts: dict[str, nn.Module] | None = None,
           fill: float = 0.0) -> Mirror:
    root = Mirror()
    for name, (shape, dtype) in sorted(params.items()):
        *path, leaf = name.split(".")
        mod = _module_at(root, path)
        mod.register_parameter(leaf, nn.Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False))
    for prefix, module in sorted((experts or {}).items()):
        *path, leaf = prefix.split(".")
        _module_at(root, path).add_module(leaf, module)
    return root


def _module_at(root: nn.Module, path: list[str]) -> nn.Module:
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = Mirror()
            mod.add_module(part, child)
        mod = child
    return mod


# -- float64 decoders, the oracles of the quantized fixtures ------------------------------------------
# Written from the format definitions (research note §1) with ml_dtypes' code tables, independently
# of runtime/formats: element 2i of a byte row is its low nibble.


def _np(t: torch.Tensor):
    return t.contiguous().view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.contiguous().numpy()


def e2m1_f64(packed: torch.Tensor) -> torch.Tensor:
    import ml_dtypes
    import numpy as np

    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    b = _np(packed)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.float64)
    out[..., 0::2] = table[b & 0x0F]
    out[..., 1::2] = table[b >> 4]
    return torch.from_numpy(out)


def e4m3_f64(t: torch.Tensor) -> torch.Tensor:
    import ml_dtypes
    import numpy as np

    return torch.from_numpy(_np(t).view(ml_dtypes.float8_e4m3fn).astype(np.float64))


def e8m0_f64(bits: torch.Tensor) -> torch.Tensor:
    import ml_dtypes
    import numpy as np

    return torch.from_numpy(_np(bits).view(ml_dtypes.float8_e8m0fnu).astype(np.float64))


def _per_group(scale: torch.Tensor, group: int) -> torch.Tensor:
    return scale.repeat_interleave(group, dim=-1)


def mxfp4_f64(packed: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    return e2m1_f64(packed) * _per_group(e8m0_f64(scale_bits), 32)


def nvfp4_f64(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    return e2m1_f64(packed) * _per_group(e4m3_f64(scale), 16) * scale_2.double()


def fp8_block_f64(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = q.shape[-2:]
    full = scale.double().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return e4m3_f64(q) * full[..., :rows, :cols]
