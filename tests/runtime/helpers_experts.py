"""Test data for experts: random canonical tensors per run format, routing, and a float64 MoE reference.

The reference shares nothing with the implementations under test but the activation quantizers
(checked against oracles in test_formats.py): it dequantizes in float64 from the raw codes and
scales, runs every token through every expert, and combines with a dense routing matrix.
"""
import math

import torch

from runtime.formats import fp4, fp8, mxfp4, nvfp4
from runtime.formats.act_quant import quantize_dequantize_activation

WEIGHT_KIND = {"bf16": "bf16", "fp8_block_scales": "fp8", "w4a16_mxfp4": "mxfp4", "w4a8_mxfp4_fp8": "mxfp4",
                 "w4a8_mxfp4_mxfp8": "mxfp4", "w4a16_nvfp4": "nvfp4", "nvfp4": "nvfp4"}
FP4_MAX_X_FP8_MAX = 6 * 448


def registry_classes(backend: str | None = None) -> tuple[type, ...]:
    """The runtime classes of a registry backend's entries (None: every entry's), in priority order:
    registry/impls.toml is the one list of implementations (test_registry_agreement.py checks it against
    the classes under runtime/experts/, both ways)."""
    from registry.impls import load_registry
    from runtime.build import load_class

    return tuple(load_class(i.class_path) for i in load_registry().impls if backend in (None, i.backend))


def projections(spec):
    return ("gate", "up", "down") if spec.activation != "relu2" else ("up", "down")


def make_expert_tensors(spec, fmt, seed, weight_std=1.0, bias_std=0.5, input_amax=(4.5, 4.0, 3.0)):
    """Full canonical tensors {(expert, proj, kind): tensor} of random weights quantized to `fmt`.

    Weights are N(0, weight_std^2 / in) with a random magnitude per row (so block scales differ);
    NVFP4 gate and up share weight_scale_2 as ModelOpt writes them, and get distinct input scales.
    """
    g = torch.Generator().manual_seed(seed)
    weight_kind = WEIGHT_KIND[fmt]
    h, i = spec.hidden_size, spec.intermediate_size
    out = {}
    for e in range(spec.num_experts):
        raw = {}
        for proj in projections(spec):
            rows, cols = (h, i) if proj == "down" else (i, h)
            row_mag = torch.exp2(torch.empty(rows, 1).uniform_(-1, 1, generator=g))
            raw[proj] = torch.randn(rows, cols, generator=g) * row_mag * weight_std / math.sqrt(cols)
        shared_scale_2 = max(nvfp4.weight_scale_2(raw[p]) for p in projections(spec) if p != "down")
        for proj, w in raw.items():
            key = lambda kind: (e, proj, kind)   # noqa: E731
            if weight_kind == "bf16":
                out[key("weight")] = w.bfloat16()
            elif weight_kind == "fp8":
                out[key("weight")], out[key("weight_scale_inv")] = fp8.quantize_weight_blocks(w)
            elif weight_kind == "mxfp4":
                out[key("weight")], out[key("weight_scale")] = mxfp4.quantize_mxfp4(w)
            else:
                scale_2 = None if proj == "down" else shared_scale_2
                out[key("weight")], out[key("weight_scale")], out[key("weight_scale_2")] = \
                    nvfp4.quantize_nvfp4_weight(w, scale_2)
                if fmt == "nvfp4":
                    # calibrated amax of this projection's input (defaults: hidden ~ N(0, 1), SiLU-GLU)
                    amax = dict(zip(("gate", "up", "down"), input_amax))[proj] * (1 + 0.1 * e)
                    out[key("input_scale")] = torch.tensor(amax / FP4_MAX_X_FP8_MAX, dtype=torch.float32)
            if spec.expert_bias:
                out[key("bias")] = (torch.randn(w.shape[0], generator=g) * bias_std).bfloat16()
    return out


def dequantize64(tensors, spec, fmt):
    """{(expert, proj): float64 [out, in]} straight from codes and scales."""
    weight_kind = WEIGHT_KIND[fmt]
    e2m1 = fp4.e2m1_table(torch.float64)
    out = {}
    for e in range(spec.num_experts):
        for proj in projections(spec):
            t = lambda kind: tensors[e, proj, kind]   # noqa: E731
            if weight_kind == "bf16":
                w = t("weight").double()
            elif weight_kind == "fp8":
                q = t("weight").double()
                s = t("weight_scale_inv").double()
                s = s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
                w = q * s
            elif weight_kind == "mxfp4":
                values = e2m1[fp4.unpack_fp4(t("weight")).long()]
                scale = torch.exp2(t("weight_scale").double() - 127)
                w = values * scale.repeat_interleave(32, 1)
            else:
                values = e2m1[fp4.unpack_fp4(t("weight")).long()]
                w = values * t("weight_scale").double().repeat_interleave(16, 1) * t("weight_scale_2").double()
            out[e, proj] = w
    return out


def random_routing(tokens, spec, seed, experts=None):
    """(topk_ids int64 [T, k] distinct per token, topk_weights fp32 [T, k] summing to 1)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else range(spec.num_experts))
    choice = torch.rand(tokens, len(pool), generator=g).topk(spec.top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, spec.top_k, generator=g), dim=1)
    return pool[choice], weights


def random_hidden(tokens, spec, seed, dtype=torch.bfloat16, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, spec.hidden_size, generator=g) * std).to(dtype)


def _activation64(spec, gate, up):
    if spec.activation == "silu_glu":
        return gate / (1 + torch.exp(-gate)) * up
    if spec.activation == "swiglu_oai":
        gate = torch.minimum(gate, torch.tensor(spec.swiglu_limit, dtype=gate.dtype))
        up = torch.clamp(up, -spec.swiglu_limit, spec.swiglu_limit)
        return (up + 1) * gate / (1 + torch.exp(-spec.swiglu_alpha * gate))
    return torch.clamp(up, min=0) ** 2


def reference_moe(hidden, topk_ids, topk_weights, tensors, spec, fmt, grouped_bf16=False):
    """float64 output [T, H] of the whole MoE layer (all experts, unsharded).

    grouped_bf16 models the TORCH backend's documented rounding points: weights rounded to bf16 at
    load, GEMM operands bf16, GEMM outputs rounded to bf16 before the bias.
    """
    bf16 = (lambda t: t.to(torch.bfloat16).double()) if grouped_bf16 else (lambda t: t)
    weights = {k: bf16(w) for k, w in dequantize64(tensors, spec, fmt).items()}
    tokens = hidden.shape[0]
    combine = torch.zeros(tokens, spec.num_experts, dtype=torch.float64)
    combine.scatter_add_(1, topk_ids, topk_weights.double())
    out = torch.zeros(tokens, spec.hidden_size, dtype=torch.float64)
    first = [p for p in projections(spec) if p != "down"]
    for e in range(spec.num_experts):
        scale_in = scale_down = None
        if fmt == "nvfp4":
            scale_in = max(tensors[e, p, "input_scale"] for p in first)
            scale_down = tensors[e, "down", "input_scale"]
        x = bf16(quantize_dequantize_activation(hidden, fmt, scale_in).double())

        def linear(a, proj):
            y = bf16(a @ weights[e, proj].T)
            return y + tensors[e, proj, "bias"].double() if spec.expert_bias else y

        gate = linear(x, "gate") if "gate" in first else None
        h = _activation64(spec, gate, linear(x, "up"))
        h = bf16(quantize_dequantize_activation(h.to(hidden.dtype), fmt, scale_down).double())
        out += combine[:, e:e + 1] * linear(h, "down")
    return out


def assert_rel_close(actual, expected, rms, peak):
    """Relative errors within bounds: RMS ||a - e|| / ||e|| and max max|a - e| / max|e|."""
    actual, expected = actual.double(), expected.double()
    err_rms = ((actual - expected).norm() / expected.norm()).item()
    err_max = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert err_rms <= rms and err_max <= peak, \
        f"relative error rms {err_rms:.3g} (limit {rms}), max {err_max:.3g} (limit {peak})"
