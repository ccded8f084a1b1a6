"""The build as a whole on one H200 (PERFORMANCE.md §0): prefill and CUDA-graph decode steps of a generated
build at real layer shapes, reduced to its first decoder layers, against transformers on the same weights
(device machine; a script, not a test).

    python3 bench/build.py [--model qwen3_30b_a3b|gpt_oss_120b|deepseek_v3] [--layers 4] [--out DIR]
                           [--variants specialized,generic,torch] [--no-compile] [--hf-experts batched_mm]
                           [--no-spec] [--spec-k 1,3]

Scope: a checkpoint that transformers saves (`from_config` with random weights, `save_pretrained`) at the
model's real shapes and vocabulary, cut to `--layers` decoder layers; the specialized build, the generic
build and the TORCH-bound (generic) build load it through `generated.load_model`; transformers' own model
loads it too (bf16, its default attention; and, unless --no-compile, its static cache with
`torch.compile(mode="reduce-overhead")`, with its default experts implementation and with each one
`--hf-experts` names). Prefill: 2048 tokens, batch 1, eager. Decode: one step at batch
1, 8 and 32 with 1024 tokens in the cache; the builds replay their `runtime.decoding.Decoder` step (a CUDA
graph). Every time stands next to its parity against transformers' bf16 eager logits on the same inputs
(relative error, top-1 agreement). R_roof = bytes the step must read / copy bandwidth / step time.
Prefill is timed over PREFILL_REPS calls after a warm-up (median, min-max); its FLOPs (`prefill_flops`)
over the time, as a fraction of a bf16 matmul's rate measured in the same run. deepseek_v3 is written in
DeepSeek's FP8 128x128-block layout with a random MTP layer; transformers, which loads no FP8, runs on
the bf16 block dequantization. Speculative decoding (`speculative`): the specialized build's `generate`
with an always-agreeing drafter and, for deepseek_v3, its MTP draft, against plain decoding.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import importlib
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PREFILL = 2048
CACHED = 1024
BATCHES = (1, 8, 32)
PREFILL_REPS = 50   # eager prefill after 5 warm-up calls: 10 gave 6.7-9.5 ms spreads across runs
SPEC_PROMPT, SPEC_NEW = 128, 128


def events_stats(fn, reps: int, warmup: int = 3) -> dict:
    """Milliseconds of `fn()` over `reps` calls after `warmup` calls, each timed with CUDA events:
    median, min and max."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"median": times[len(times) // 2], "min": times[0], "max": times[-1], "reps": reps}


def events_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` over `reps` calls, timed with CUDA events."""
    return events_stats(fn, reps, warmup)["median"]


def copy_bandwidth() -> float:
    """Device copy bytes (read + written) per second, eager `copy_` of 2 GiB."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 10)
    return 2 * src.nbytes / (ms * 1e-3)


def matmul_peak() -> float:
    """bf16 FLOP/s of one large matmul (8192^3, random operands), the prefill ceiling measured in this run."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = events_ms(lambda: a @ b, 30, warmup=5)
    return 2 * n**3 / (ms * 1e-3)


def parity(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative error over all logits and top-1 agreement; with several rows also the range of the rows'
    own relative errors (how far one row, as at B=1, may sit from the whole's figure)."""
    ours, ref = ours.float().reshape(-1, ours.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    rel = float((ours - ref).norm() / ref.norm())
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    out = {"rel_err": rel, "top1": top1}
    if ours.shape[0] > 1:
        rows = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
        out["row_rel_err_range"] = [float(rows.min()), float(rows.max())]
    return out


# -- the checkpoint -----------------------------------------------------------------------------------


# transformers' config key of the routed experts' count, per family (for --experts).
EXPERTS_KEY = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"}


def hf_config(model: str, layers: int, experts: int | None = None):
    from transformers import AutoConfig

    facts = importlib.import_module(f"generated.{model}.facts")
    config = {k: v for k, v in facts.CONFIG.items() if k != "architectures"}
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    if experts is not None:
        config[EXPERTS_KEY[facts.FAMILY]] = experts
    return AutoConfig.for_model(facts.FAMILY, **config), facts


def save_checkpoint(model: str, layers: int, folder: Path, device: str = "cuda", experts: int | None = None):
    """transformers' model of `model` cut to `layers`, random weights, saved to `folder`: by
    `save_pretrained` for bf16 models; gpt-oss in its hub MXFP4 layout (experts as `*_blocks`/`*_scales`,
    quantized by runtime.formats.mxfp4, and transformers' copy holding the dequantized values, so both
    sides compute with the same weights); deepseek_v3 in DeepSeek's FP8 block layout (`save_fp8_checkpoint`)."""
    from transformers import AutoModelForCausalLM

    config, facts = hf_config(model, layers, experts)
    torch.manual_seed(0)
    extra = {"attn_implementation": "eager"} if facts.FAMILY == "gpt_oss" else {}  # sinks need eager
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **extra)
    with torch.no_grad():  # transformers leaves norms at 1 and biases at 0: give every tensor values
        for name, t in hf.state_dict().items():
            if not t.is_floating_point():
                continue
            # a tensor at a time, except deepseek_v3's fused experts, an expert at a time: in fp32 the whole is
            # 28 GiB, which an H100 holding the bf16 model lacks
            for part in t.split(1) if t.numel() * 4 > 16 << 30 else (t,):
                part.copy_((1.0 + 0.1 * torch.randn_like(part, dtype=torch.float32)) if "norm" in name
                           else 0.02 * torch.randn_like(part, dtype=torch.float32))
    if facts.FAMILY == "deepseek_v3":
        save_fp8_checkpoint(hf, folder, facts.CONFIG["num_hidden_layers"])  # the MTP layer's index in the hub's
        return hf.eval()
    if facts.FAMILY != "gpt_oss":
        hf.save_pretrained(folder)
        return hf.eval()
    from safetensors.torch import save_file

    from runtime.formats import mxfp4

    tensors = {}
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = t.contiguous().cpu()
                continue
            blocks, scales = [], []
            for e in range(0, t.shape[0], 8):  # transformers' layout is input-major [E, in, out]; the hub's out-major
                packed, bits = mxfp4.quantize_mxfp4(t[e:e + 8].transpose(1, 2).contiguous().float())
                t[e:e + 8].copy_(mxfp4.dequantize_mxfp4(packed, bits, torch.bfloat16).transpose(1, 2))
                blocks.append(mxfp4.canonical_to_gpt_oss_blocks(packed).cpu())
                scales.append(bits.cpu())
            tensors[name + "_blocks"], tensors[name + "_scales"] = torch.cat(blocks), torch.cat(scales)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return hf.eval()


def _fp8_held(name: str) -> bool:
    """transformers' own names of the tensors DeepSeek keeps in FP8 blocks (its fused experts too)."""
    from runtime.checkpoint.writer import fp8_block_quantized

    return fp8_block_quantized(name) or name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def save_fp8_checkpoint(hf, folder: Path, mtp_layer: int) -> None:
    """`hf` (deepseek_v3, bf16) as DeepSeek stores it: float8_e4m3fn `weight` + fp32 `weight_scale_inv` per
    128x128 block (runtime.checkpoint.writer.fp8_block_tensors, the tests' conversion too), plus a random
    MTP layer at `model.layers.<mtp_layer>` (the whole model's layer count, where the hub and the build's
    draft keep it; transformers has no MTP: the last layer's tensor shapes with fresh values, and the MTP
    head's own tensors).

    transformers' deepseek_v3 does not load FP8 weights, so `hf` first gets each FP8 weight's block
    dequantization in place: it computes with the values the checkpoint holds (bf16-rounded), whose
    re-quantization below gives back the same codes (their scales within bf16 rounding)."""
    from safetensors.torch import load_file

    from runtime.checkpoint.writer import FP8_BLOCK_QUANTIZATION, fp8_block_tensors, save_checkpoint as write
    from runtime.formats import fp8

    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if _fp8_held(name):
                for part in (t.unsqueeze(0) if t.dim() == 2 else t).split(16):  # experts 16 at a time: fp32 copies
                    q, scale = fp8.quantize_weight_blocks(part)
                    part.copy_(fp8.dequantize_weight_blocks(q, scale, t.dtype))
    staging = folder.with_name(folder.name + "-bf16")
    hf.save_pretrained(staging)
    tensors = {}
    for file in sorted(staging.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    config = json.loads((staging / "config.json").read_text())
    shutil.rmtree(staging)
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    mtp = f"model.layers.{mtp_layer}."
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = {mtp + n[len(last):]: t.shape for n, t in tensors.items() if n.startswith(last)}
    shapes |= {mtp + n: (hidden,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    shapes |= {mtp + "eh_proj.weight": (hidden, 2 * hidden), mtp + "shared_head.head.weight": (vocab, hidden),
               mtp + "embed_tokens.weight": (vocab, hidden)}
    device = hf.device
    gen = torch.Generator(device).manual_seed(2)
    for name, shape in sorted(shapes.items()):
        values = torch.randn(shape, device=device, generator=gen)
        tensors[name] = (1.0 + 0.1 * values if "norm" in name else 0.02 * values).to(torch.bfloat16)
    out = {}
    for name in sorted(tensors):  # on hf's device (the GPU), one tensor at a time
        for key, value in fp8_block_tensors({name: tensors.pop(name).to(device)}).items():
            out[key] = value.cpu()
    config["quantization_config"] = dict(FP8_BLOCK_QUANTIZATION)
    write(out, folder, config)


# -- the builds ---------------------------------------------------------------------------------------


def load_build(model: str, sm: int, layers: int, folder: Path, variant: str, device: str = "cuda", mtp: bool = False,
               experts: int | None = None, parallel: str = "tp1", rank: int = 0):
    """The build's first `layers` decoder layers (`load_model(num_layers=...)`), rank `rank` of layout `parallel`.
    `variant`: specialized (mode require), generic (mode off), torch (generic, backend TORCH), auto (the
    specialized build where one is declared, else the generic); `mtp`: also its embedded MTP draft
    (`speculative_config` mode mtp, read from the same checkpoint); `experts`: a bench-only smoke option, the
    specialized builds' routed experts cut to that many (it changes the model, so the product has no such
    option; the generic build keeps its own)."""
    from generated import load_model
    from generated._build_index import INDEX

    kwargs = {"specialized": dict(mode="require"), "generic": dict(mode="off"),
              "torch": dict(mode="off", moe_config={"backend": "TORCH"}), "auto": dict(mode="auto")}[variant]
    if mtp:
        kwargs["speculative_config"] = {"mode": "mtp"}
    saved = {}
    if experts is not None:
        # Bench-only: the specialized modules' experts constants (read when a build is constructed), restored below.
        for module in (importlib.import_module("generated" + t["module"]) for t in INDEX["targets"] if t["model"] == model):
            saved[module] = (module.NUM_EXPERTS, module.EXPERTS_SPEC)
            module.NUM_EXPERTS = experts
            module.EXPERTS_SPEC = dataclasses.replace(module.EXPERTS_SPEC, num_experts=experts)
    try:
        built = load_model(model, sm, parallel, checkpoint=str(folder), device=device, num_layers=layers, rank=rank,
                           **kwargs)
    finally:
        for module, (count, spec) in saved.items():
            module.NUM_EXPERTS, module.EXPERTS_SPEC = count, spec
    return built.eval()


def decode_bytes(config, batch: int, kv_len: int, seqs: int | None = None) -> int:
    """Bytes one decode step of `batch` tokens over `seqs` sequences (default: one token each; a
    speculative verify is k+1 tokens of one sequence) must read: every weight it touches, the active
    experts for uniform routing
    (bf16; MXFP4 at 0.53125 bytes per weight for gpt-oss, its biases bf16; FP8 at 1 byte plus fp32 128x128
    block scales for deepseek_v3, whose other linears the loader dequantizes to bf16), the embedding rows,
    and the KV cache (a sliding layer's window only; MLA's latent and rotated key), all else bf16."""
    c = config
    h = c.hidden_size
    seqs = batch if seqs is None else seqs
    if c.model_type == "deepseek_v3":
        heads, ql, kl, r = c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
        attn = 2 * (h * ql + ql * heads * (c.qk_nope_head_dim + r) + h * (kl + r)
                    + kl * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h + ql + kl + 2 * h)
        experts, mi = c.n_routed_experts, c.moe_intermediate_size
        active = experts * (1 - (1 - c.num_experts_per_tok / experts) ** batch)
        moe = 2 * experts * h + 4 * experts + active * 3 * h * mi * (1 + 4 / 128**2) + c.n_shared_experts * 3 * h * mi * 2
        dense = min(c.first_k_dense_replace, c.num_hidden_layers)
        layers = c.num_hidden_layers * attn + dense * 3 * h * c.intermediate_size * 2 + (c.num_hidden_layers - dense) * moe
        cache = c.num_hidden_layers * seqs * kv_len * (kl + r) * 2
        return int(layers + 2 * (c.vocab_size * h + h + batch * h) + cache)
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    gpt_oss = c.model_type == "gpt_oss"
    attn = 2 * (h * heads * d * 2 + h * kv * d * 2 + 2 * d + h)  # q, o; k, v; q/k norms; input norm
    experts = c.num_local_experts if gpt_oss else c.num_experts
    inter = c.intermediate_size if gpt_oss else c.moe_intermediate_size
    active = experts * (1 - (1 - c.num_experts_per_tok / experts) ** batch)
    per_expert = 3 * h * inter * 0.53125 + 2 * (3 * inter + h) if gpt_oss else 3 * h * inter * 2
    layer = attn + 2 * (experts * h + h) + active * per_expert
    windows = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    cache = sum(seqs * (min(kv_len, c.sliding_window) if t == "sliding_attention" else kv_len) * kv * d * 2 * 2
                for t in windows)
    return int(c.num_hidden_layers * layer + 2 * (c.vocab_size * h + h + batch * h) + cache)


def prefill_flops(config, seq: int = PREFILL) -> int:
    """Floating-point operations of a prefill of `seq` tokens (batch 1): every matmul (attention projections,
    router, the top-k experts each token is routed to, shared experts, dense MLPs, lm_head over every
    position) and causal attention (QK^T and PV over the keys each query sees: a sliding window's at most).
    Norms, rotary, softmax and activations are left out (elementwise, under 1 %)."""
    c, s, h = config, seq, config.hidden_size
    full_pairs = s * (s + 1) // 2
    if c.model_type == "deepseek_v3":
        heads, ql, kl, r, n, v = (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim,
                                  c.qk_nope_head_dim, c.v_head_dim)
        attn = 2 * s * (h * ql + ql * heads * (n + r) + h * (kl + r) + kl * heads * (n + v) + heads * v * h)
        attn += 2 * full_pairs * heads * (n + r + v)
        moe = 2 * s * h * c.n_routed_experts + 6 * s * h * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts)
        dense = min(c.first_k_dense_replace, c.num_hidden_layers)
        total = c.num_hidden_layers * attn + dense * 6 * s * h * c.intermediate_size + (c.num_hidden_layers - dense) * moe
        return int(total + 2 * s * h * c.vocab_size)
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    gpt_oss = c.model_type == "gpt_oss"
    experts = c.num_local_experts if gpt_oss else c.num_experts
    inter = c.intermediate_size if gpt_oss else c.moe_intermediate_size
    windows = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    total = 0
    for kind in windows[: c.num_hidden_layers]:
        w = c.sliding_window if kind == "sliding_attention" else s
        pairs = sum(min(i + 1, w) for i in range(s))
        total += 2 * s * h * (2 * heads * d + 2 * kv * d) + 4 * pairs * heads * d
        total += 2 * s * h * experts + 6 * s * h * inter * c.num_experts_per_tok
    return int(total + 2 * s * h * c.vocab_size)


# -- measurements -------------------------------------------------------------------------------------


def bench_build(model, name, ids, hf_ref, results):
    from runtime.decoding import Decoder

    kept = {}
    with torch.no_grad():
        logits = model(ids[:1])
        # what the build bound (a generic build resolves at load): the experts classes' implementation ids
        binds = sorted({type(m).IMPL_ID for m in model.modules() if getattr(type(m), "IMPL_ID", "")})
        row = {"variant": name, "build": type(model).__module__, "binds": binds,
               "prefill": parity(logits[0], hf_ref["prefill"])}
        kept["prefill"] = logits[0].cpu()
        del logits
        row["prefill_stats"] = events_stats(lambda: model(ids[:1]), PREFILL_REPS, warmup=5)
        row["prefill_ms"] = row["prefill_stats"]["median"]
        for batch in BATCHES:
            decoder = Decoder(model, batch, CACHED + 64)
            decoder.prefill(ids[:batch, :CACHED])
            step_ids = ids[:batch, CACHED]
            logits = decoder.step(step_ids).clone()  # captures
            row[f"decode_b{batch}"] = parity(logits, hf_ref[f"decode_b{batch}"])
            kept[f"decode_b{batch}"] = logits.cpu()

            def replay():
                decoder.position.fill_(CACHED)
                decoder.graph.replay()

            row[f"decode_b{batch}_ms"] = events_ms(replay, 50, warmup=5)
            del decoder
    results.append(row)
    print(json.dumps(row), flush=True)
    return kept


def fp32_parity(hf, ids, refs, kept_by_variant, report):
    """Parity against transformers in fp32 (same bf16 weights, upcast): the noise floor of bf16 itself
    (transformers' own bf16 logits against it) next to each build's."""
    hf = hf.float()
    out = {}
    with torch.no_grad():
        truth = {"prefill": hf(ids[:1]).logits[0]}
        for batch in BATCHES:
            from transformers import DynamicCache

            cache = DynamicCache(config=hf.config)
            hf(ids[:batch, :CACHED], past_key_values=cache, use_cache=True)
            truth[f"decode_b{batch}"] = hf(ids[:batch, CACHED:CACHED + 1], past_key_values=cache, use_cache=True).logits[:, -1]
            del cache
    out["transformers_bf16"] = {k: parity(refs[k], v) for k, v in truth.items()}
    for variant, kept in kept_by_variant.items():
        out[variant] = {k: parity(kept[k].cuda(), v) for k, v in truth.items()}
    report["fp32_parity"] = out
    print(json.dumps({"fp32_parity": out}), flush=True)


def transformers_refs(hf, ids):
    """transformers bf16 eager: prefill logits, and one decode step after CACHED tokens at each batch."""
    from transformers import DynamicCache

    refs, times = {}, {}
    with torch.no_grad():
        refs["prefill"] = hf(ids[:1]).logits[0]
        times["prefill_stats"] = events_stats(lambda: hf(ids[:1]), PREFILL_REPS, warmup=5)
        times["prefill_ms"] = times["prefill_stats"]["median"]
        for batch in BATCHES:
            cache = DynamicCache(config=hf.config)
            hf(ids[:batch, :CACHED], past_key_values=cache, use_cache=True)
            step = ids[:batch, CACHED:CACHED + 1]
            refs[f"decode_b{batch}"] = hf(step, past_key_values=cache, use_cache=True).logits[:, -1]

            def one():  # the cache grows by one token a call: 1024 -> 1047 over the timed calls
                hf(step, past_key_values=cache, use_cache=True)

            times[f"decode_b{batch}_ms"] = events_ms(one, 20)
    return refs, times


def transformers_compiled(hf, ids, refs, experts: str | None = None):
    """transformers with its static cache and `torch.compile(mode="reduce-overhead")` on the decode step;
    `experts`: the experts implementation to compile with (`set_experts_implementation`, restored after;
    None keeps the model's own; transformers' documentation calls `batched_mm`, which gathers each token's
    expert weights, the fastest for small inputs under compilation)."""
    from transformers import StaticCache

    caches = {}
    with torch.no_grad():
        # The caches are filled by the model's own experts path: batched_mm's per-token copies of the expert
        # weights for a 1024-token prompt do not fit (deepseek_v3: 448 GiB asked, this session's run).
        for batch in BATCHES:
            caches[batch] = StaticCache(config=hf.config, max_cache_len=CACHED + 64)
            hf(ids[:batch, :CACHED], past_key_values=caches[batch], use_cache=True,
               cache_position=torch.arange(CACHED, device="cuda"))
    before = getattr(hf.config, "_experts_implementation", None)
    if experts is not None:
        hf.set_experts_implementation(experts)
    out = {"experts_implementation": getattr(hf.config, "_experts_implementation", None)}
    compiled = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    try:
        with torch.no_grad():
            for batch, cache in caches.items():
                step = ids[:batch, CACHED:CACHED + 1].clone()
                pos = torch.tensor([CACHED], device="cuda")

                def one():
                    return compiled(input_ids=step, past_key_values=cache, use_cache=True, cache_position=pos,
                                    position_ids=pos[None].expand(batch, 1)).logits

                t0 = time.perf_counter()
                logits = one()
                logits = one()
                torch.cuda.synchronize()
                out[f"compile_b{batch}_s"] = time.perf_counter() - t0
                out[f"decode_b{batch}"] = parity(logits[:, -1], refs[f"decode_b{batch}"])
                out[f"decode_b{batch}_ms"] = events_ms(one, 50, warmup=5)
    finally:
        if experts is not None:
            hf.set_experts_implementation(before)
    return out


class ReplayDrafter:
    """A drafter that always agrees and costs almost nothing: it proposes the target's own greedy
    continuation, recorded by an earlier speculative run at the same k (`tokens`, prompt included, on the
    device), read at the positions the round asks for. It measures the speculative loop itself (verify, accept, host sync per round) with
    the drafter's cost taken out: the best any drafter could do with this target. Bench-only: no user has
    the continuation before decoding it."""

    INPUT = "tokens"

    def __init__(self, tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> None:
        self.tokens, self.vocab, self.dtype = tokens, vocab, dtype

    def new_caches(self, batch_size, max_seq_len):
        return [[]]

    def prefill(self, input_ids, target_hidden, caches):
        pass

    def forward(self, next_token_ids, target_hidden, positions, cache, step=0):
        # Entry i (at position i, reading the token at i + 1) predicts the token at position i + 2.
        ahead = self.tokens[:, (positions + 2).clamp(max=self.tokens.shape[1] - 1)]
        ahead = ahead.expand(next_token_ids.shape[0], -1)
        logits = torch.zeros(*ahead.shape, self.vocab, dtype=self.dtype, device=ahead.device)
        return logits.scatter_(-1, ahead[..., None], 1.0), logits[..., :1]  # no hidden state: a stand-in


def speculative(model, ids, ks, config, draft=None) -> dict:
    """Plain greedy decoding (the build's `generate`) against `generate(..., speculative=Speculation(k, d))`
    for each k in `ks`, from one SPEC_PROMPT-token prompt to SPEC_NEW new tokens, the second call of each
    timed (graphs captured by the first). Drafters: the target's own build as an external drafter (it always
    agrees, up to bf16 near-ties), `ReplayDrafter` (always agrees, costs a gather: the loop's ceiling) and `draft` (the build's MTP draft with random weights: honest acceptance,
    the cost of rejected proposals). Per run: rounds, proposed, accepted, acceptance length, tokens/s, the
    ratio to plain decoding and to the §0 goal (0.8 (k+1) x plain), where it first differs from plain
    greedy (SD1; bf16 near-ties), and the draft and verify phases' graph replays timed alone.

    `free_draft_ceiling`: the ratio to plain decoding that a drafter costing nothing and always agreeing
    would reach if the verify of k+1 tokens ran at the plain step's bytes per second: (k+1) x the bytes of a
    one-token step / the bytes of the k+1-token verify (its tokens reach more experts than one token does)."""
    from runtime.drafts import vocab_size
    from runtime.speculative import ExternalDrafter, Speculation, speculative_decoder

    prompt = ids[:1, :SPEC_PROMPT]
    model.generate(prompt, SPEC_NEW)
    plain = model.generate(prompt, SPEC_NEW)
    at = SPEC_PROMPT + SPEC_NEW // 2  # the cache length halfway through the run
    out = {"prompt": SPEC_PROMPT, "new_tokens": SPEC_NEW, "plain_tokens_s": plain.tokens_per_s,
           "plain_step_ms": 1e3 * plain.decode_s / plain.decode_steps}
    print(json.dumps({"speculative": out}), flush=True)
    drafters = {"agreeing": ExternalDrafter(model, model), "replay": None}
    if draft is not None:
        drafters["mtp_random"] = draft
    continuation = {}
    for label, drafter in drafters.items():
        for k in ks:
            if label == "replay":
                # The continuation of the agreeing run at this k: verify blocks of k+1 tokens round near-ties
                # unlike one-token steps (bf16), so plain greedy output can part from it (SD1 holds up to ties).
                drafter = ReplayDrafter(continuation[k].to(prompt.device), vocab_size(model), model.dtype)
            spec = Speculation(k, drafter)
            model.generate(prompt, SPEC_NEW, speculative=spec)
            run = model.generate(prompt, SPEC_NEW, speculative=spec)
            if label == "agreeing":
                continuation[k] = run.tokens
            differs = (run.tokens != plain.tokens)[0].nonzero()
            ratio = run.tokens_per_s / plain.tokens_per_s
            row = {"k": k, "rounds": run.rounds, "proposed": run.proposed, "accepted": run.accepted,
                   "acceptance_length": run.acceptance_length, "tokens_s": run.tokens_per_s, "x_plain": ratio,
                   "goal_x_plain": 0.8 * (k + 1), "of_goal": ratio / (0.8 * (k + 1)),
                   "free_draft_ceiling": (k + 1) * decode_bytes(config, 1, at) / decode_bytes(config, k + 1, at, seqs=1),
                   "round_ms": 1e3 * run.decode_s / max(1, run.rounds), "near_ties": run.near_ties,
                   "first_differs_at": int(differs[0]) - SPEC_PROMPT if len(differs) else None}
            decoder = speculative_decoder(model, drafter, k, 1, SPEC_PROMPT + SPEC_NEW)
            if set(decoder.graphs) == {"draft", "verify"}:
                pos = decoder.pos.clone()

                def verify():  # a verify advances the position: each replay starts from the same one
                    decoder.pos.copy_(pos)
                    decoder.graphs["verify"].replay()

                row["draft_phase_ms"] = events_ms(decoder.graphs["draft"].replay, 20)
                row["verify_phase_ms"] = events_ms(verify, 20)
            out[f"{label}_k{k}"] = row
            print(json.dumps({f"{label}_k{k}": row}), flush=True)
    return out


def graph_us(fn, replays: int = 20) -> float:
    """Microseconds of one `fn()` captured in a CUDA graph (median over batches of `replays` replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def batch():
        for _ in range(replays):
            graph.replay()

    return 1e3 * events_ms(batch, 10) / replays


def _bmm_folded(q, k, v, qp, kp, scale):
    from runtime.ops.attention_core import allowed_keys

    b, s, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.view(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * s, d)
    logits = torch.matmul(qf, k.transpose(-1, -2)).float() * scale
    logits = logits.masked_fill(~allowed_keys(qp, kp, None).repeat(g, 1), float("-inf"))
    return torch.matmul(torch.softmax(logits, -1).to(v.dtype), v)


def kernel_times(fn, calls: int = 3, top: int = 14) -> dict:
    """Device time per kernel name over `calls` calls of `fn` (torch.profiler), per call; `nccl_us`: NCCL's."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / calls, e.count // calls, e.key[:90]))
    rows.sort(reverse=True)
    return {"total_us": sum(r[0] for r in rows), "kernels_per_call": sum(r[1] for r in rows),
            "nccl_us": sum(r[0] for r in rows if r[2].startswith("nccl")),
            "top": [f"{t:8.1f} us x{c:3d} {k}" for t, c, k in rows[:top]]}


def profile_step(model, ids, batch: int) -> dict:
    """Kernel times of one eager decode step (the kernels a replay runs)."""
    from runtime.decoding import Decoder

    decoder = Decoder(model, batch, CACHED + 64)
    with torch.no_grad():
        decoder.prefill(ids[:batch, :CACHED])
        decoder.ids.copy_(ids[:batch, CACHED:CACHED + 1])
        decoder._step()

        def step():
            decoder.position.fill_(CACHED)
            decoder._step()

        return kernel_times(step)


def profile_prefill(model, ids, calls: int = 10) -> dict:
    """Where an eager prefill's time goes: the host's time to enqueue one call (no sync) against its wall
    time (enqueue + drain), medians over `calls`; when they are close the call is host-bound, and the
    kernels' own device time (`kernels`) says how much of the wall the GPU is busy; `host_3_calls`: the
    Python functions the host spends that time in (cProfile over 3 calls, by own time); `host_ops`: the
    torch ops one call dispatches, nested ones included, by their own host time (torch.profiler's CPU side:
    calls and self µs)."""
    from torch.profiler import ProfilerActivity, profile

    enqueue, wall = [], []
    with torch.no_grad():
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids[:1])
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            enqueue.append(1e3 * (t1 - t0))
            wall.append(1e3 * (time.perf_counter() - t0))
        kernels = kernel_times(lambda: model(ids[:1]))
        host = cProfile.Profile()
        host.runcall(lambda: [model(ids[:1]) for _ in range(3)])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as ops:
            model(ids[:1])
            torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(18)
    by_host = sorted(ops.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"enqueue_ms": sorted(enqueue)[calls // 2], "wall_ms": sorted(wall)[calls // 2], "kernels": kernels,
            "host_3_calls": [line[:160] for line in text.getvalue().splitlines() if line.strip()][-20:],
            "host_ops": {"calls": sum(e.count for e in by_host),
                         "top": [{"op": e.key, "calls": e.count, "self_us": round(e.self_cpu_time_total, 1)}
                                 for e in by_host[:25]]}}


def attention_micro():
    """Decode attention alone at qwen3 shapes (Hq 32, Hkv 4, D 128) over 1088 cached slots: the folded
    fused path, SDPA with enable_gqa and a [S, L] mask, the eager reference."""
    import torch.nn.functional as F

    from runtime.ops import attention_fused
    from runtime.ops.attention_core import allowed_keys, eager_attention

    rows = {}
    length = CACHED + 64
    for batch in BATCHES:
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, 4, length, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qp, kp = torch.tensor([CACHED], device="cuda"), torch.arange(length, device="cuda")
        rows[f"b{batch}_folded_us"] = graph_us(lambda: attention_fused.attention(q, k, v, qp, kp, 0.088))
        rows[f"b{batch}_gqa_mask_us"] = graph_us(
            lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=allowed_keys(qp, kp, None),
                                                   enable_gqa=True))
        rows[f"b{batch}_bmm_folded_us"] = graph_us(lambda: _bmm_folded(q, k, v, qp, kp, 0.088))
        rows[f"b{batch}_eager_us"] = graph_us(lambda: eager_attention(q, k, v, qp, kp, 0.088))
        sinks = torch.randn(32, device="cuda", dtype=torch.bfloat16)
        rows[f"b{batch}_folded_sinks_us"] = graph_us(lambda: attention_fused.attention(q, k, v, qp, kp, 0.088, None, sinks))
        rows[f"b{batch}_kv_bytes"] = k.nbytes + v.nbytes
    q = torch.randn(1, PREFILL, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, PREFILL, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(PREFILL, device="cuda")
    rows["prefill_causal_us"] = 1e3 * events_ms(lambda: attention_fused.attention(q, k, k, pos, pos, 0.088, self_keys=True), 20)
    rows["prefill_eager_us"] = 1e3 * events_ms(lambda: eager_attention(q, k, k, pos, pos, 0.088), 5)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3_30b_a3b")
    parser.add_argument("--sm", type=int, default=90)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variants", default="specialized,generic,torch")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--hf-experts", default="", help="also compile transformers with these experts "
                        "implementations (comma-separated, e.g. batched_mm), each timed as its own row")
    parser.add_argument("--profile", action="store_true",
                        help="each build's kernel times (decode steps at B=1, 8 and 32, prefill) and prefill's host time")
    parser.add_argument("--no-spec", action="store_true", help="leave out the speculative decoding timings")
    parser.add_argument("--spec-k", default="1,3", help="draft tokens per round to time (comma-separated)")
    parser.add_argument("--no-micro", action="store_true", help="leave out the attention micro-benchmark")
    parser.add_argument("--experts", type=int, help="routed experts cut to this many (a smoke run of the script, "
                        "specialized builds only; not the §0 scope)")
    parser.add_argument("--fp32-parity", action="store_true",
                        help="also compare every build and transformers' bf16 logits with transformers in fp32")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "layers": args.layers, "experts": args.experts, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report["copy_tb_s"] = copy_bandwidth() / 1e12
    report["bf16_matmul_tflop_s"] = matmul_peak() / 1e12
    print(json.dumps(report), flush=True)
    if not args.no_micro:
        try:
            report["attention_micro"] = attention_micro()
            print(json.dumps(report["attention_micro"]), flush=True)
        except Exception:  # noqa: BLE001 - a failed section is reported, the others still run
            report["attention_micro_error"] = traceback.format_exc()
            print(report["attention_micro_error"], flush=True)

    folder = Path(tempfile.mkdtemp(prefix="moegen-bench-"))
    t0 = time.perf_counter()
    hf = save_checkpoint(args.model, args.layers, folder, experts=args.experts)
    report["checkpoint_s"] = time.perf_counter() - t0
    config = hf.config
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (max(BATCHES), PREFILL), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    refs, hf_times = transformers_refs(hf, ids)
    report["transformers_eager"] = hf_times
    print(json.dumps({"transformers_eager": hf_times}), flush=True)
    report["bytes"] = {f"decode_b{b}": decode_bytes(config, b, CACHED + 1) for b in BATCHES}
    report["prefill_flops"] = prefill_flops(config)
    if config.model_type == "deepseek_v3":
        report["transformers_weights"] = "bf16 block dequantization of the FP8 checkpoint (transformers loads no FP8)"

    results, kept = [], {}
    for variant in args.variants.split(","):
        try:
            spec = variant == "specialized" and not args.no_spec
            mtp = spec and config.model_type == "deepseek_v3"
            model = load_build(args.model, args.sm, args.layers, folder, variant, mtp=mtp, experts=args.experts)
            kept[variant] = bench_build(model, variant, ids, refs, results)
            if spec:
                try:
                    report["speculative"] = speculative(model, ids, [int(k) for k in args.spec_k.split(",")], config,
                                                        getattr(model, "draft", None) if mtp else None)
                except Exception:  # noqa: BLE001
                    report["speculative_error"] = traceback.format_exc()
                    print(report["speculative_error"], flush=True)
            if args.profile:
                profiled = {f"b{b}": profile_step(model, ids, b) for b in BATCHES}
                profiled["prefill"] = profile_prefill(model, ids)
                report.setdefault("profile", {})[variant] = profiled
                print(json.dumps({"profile": {variant: profiled}}, indent=1), flush=True)
            del model
        except Exception:  # noqa: BLE001
            results.append({"variant": variant, "error": traceback.format_exc()})
            print(results[-1]["error"], flush=True)
        torch.cuda.empty_cache()
    report["builds"] = results
    if not args.no_compile:
        for experts in [None] + [e for e in args.hf_experts.split(",") if e]:
            key = "transformers_compiled" + (f"_{experts}" if experts else "")
            try:
                report[key] = transformers_compiled(hf, ids, refs, experts)
            except Exception:  # noqa: BLE001
                report[key + "_error"] = traceback.format_exc()
                print(report[key + "_error"], flush=True)
            torch._dynamo.reset()   # the next implementation compiles afresh
    if args.fp32_parity:
        try:
            fp32_parity(hf, ids, refs, kept, report)
        except Exception:  # noqa: BLE001
            report["fp32_parity_error"] = traceback.format_exc()
            print(report["fp32_parity_error"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"build_{args.model}.json").write_text(json.dumps(report, indent=1))

    bw = report["copy_tb_s"] * 1e12
    peak = report["bf16_matmul_tflop_s"] * 1e12
    print(f"\n{args.model}, {args.layers} layers, {report['gpu']}, copy {report['copy_tb_s']:.2f} TB/s, "
          f"bf16 matmul {report['bf16_matmul_tflop_s']:.0f} TFLOP/s, prefill {report['prefill_flops'] / 1e12:.2f} TFLOP"
          + (f"; transformers on the {report['transformers_weights']}" if "transformers_weights" in report else ""))
    print(f"| variant | prefill 2048 ms [min-max of {PREFILL_REPS}] (of bf16 peak; rel, top1) | "
          + " | ".join(f"decode B={b} ms (R_roof; rel, top1)" for b in BATCHES) + " |")
    rows = [{"variant": "transformers eager", **hf_times}] + results
    for key, value in report.items():
        if key.startswith("transformers_compiled") and not key.endswith("_error"):
            rows.append({"variant": f"transformers static+compile ({value.get('experts_implementation') or 'default'} experts)", **value})
    for row in rows:
        if "error" in row:
            print(f"| {row['variant']} | error: {row['error'].strip().splitlines()[-1]} |")
            continue
        cells = [row["variant"] + (f" ({', '.join(row['binds'])})" if row.get("binds") else "")]
        p = row.get("prefill")
        if "prefill_ms" in row:
            st = row.get("prefill_stats", {})
            frac = report["prefill_flops"] / (row["prefill_ms"] * 1e-3) / peak
            cells.append(f"{row['prefill_ms']:.2f}" + (f" [{st['min']:.2f}-{st['max']:.2f}]" if st else "")
                         + f" ({frac:.2f}" + (f"; {p['rel_err']:.3f}, {p['top1']:.3f})" if p else ")"))
        else:
            cells.append("-")
        for b in BATCHES:
            ms = row[f"decode_b{b}_ms"]
            roof = report["bytes"][f"decode_b{b}"] / bw / (ms * 1e-3)
            d = row.get(f"decode_b{b}")
            cells.append(f"{ms:.3f} ({roof:.2f}" + (f"; {d['rel_err']:.3f}, {d['top1']:.3f})" if d else ")"))
        print("| " + " | ".join(cells) + " |")
    spec = report.get("speculative")
    if spec:
        print(f"\nspeculative (greedy, B=1, {spec['prompt']}-token prompt, {spec['new_tokens']} new): plain "
              f"{spec['plain_tokens_s']:.0f} tokens/s ({spec['plain_step_ms']:.3f} ms a step)")
        print("| drafter | k | accepted / proposed | acceptance length | tokens/s | x plain | of goal 0.8(k+1) | "
              "round ms (draft, verify phases) | first differs at | free-draft ceiling |")
        for name, r in spec.items():
            if isinstance(r, dict):
                phases = f" ({r['draft_phase_ms']:.3f}, {r['verify_phase_ms']:.3f})" if "draft_phase_ms" in r else ""
                print(f"| {name.rsplit('_k', 1)[0]} | {r['k']} | {r['accepted']} / {r['proposed']} | "
                      f"{r['acceptance_length']:.2f} | {r['tokens_s']:.0f} | {r['x_plain']:.2f} | {r['of_goal']:.2f} | "
                      f"{r['round_ms']:.3f}{phases} | {r['first_differs_at']} ({r['near_ties']} near-ties) | "
                      f"{r['free_draft_ceiling']:.2f} |")


if __name__ == "__main__":
    main()
