"""What the tests of generated builds share: finding the builds, writing tiny checkpoints through transformers, and measuring logits against theirs.

The checkpoints come from transformers itself (`AutoModelForCausalLM.from_config` of a declaration's
config, then `save_pretrained`), so the tensor names, layouts and config fields a build reads are
ones nobody on this team wrote. Each is written once per test session into a temporary folder.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from families import RUNTIME_FAMILIES

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "generated"
_TMP = Path(tempfile.mkdtemp(prefix="moegen-generated-tests-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)

# One tiny declared model per runtime family, `tiny_<family>`: the models the parity tests run (RULES:
# the oracle is transformers' implementation of the family; tests/test_families.py checks each is declared).
TINY = {family: f"tiny_{family}" for family in RUNTIME_FAMILIES}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def modeling_files() -> list[Path]:
    return sorted(GENERATED.glob("*/*/modeling.py"))


def draft_files() -> list[Path]:
    return sorted(GENERATED.glob("*/*/draft.py"))


def load(module: str):
    return importlib.import_module(module)


def index() -> dict:
    return load("generated._build_index").INDEX


def facts(model: str):
    return load(f"generated.{model}.facts")


def specialized(model: str) -> list[dict]:
    """The model's specialized targets, from the build index."""
    return [t for t in index()["targets"] if t["model"] == model]


def bf16_target(model: str) -> dict:
    """The model's first single-rank specialized target of a bf16 checkpoint."""
    return next(t for t in specialized(model) if single_rank(t) and t["checkpoint"].endswith("_bf16"))


def random_build(model: str, seed: int):
    """`bf16_target(model)`'s build in fp32 with seeded random weights (init_random), in eval mode."""
    built = load("generated" + bf16_target(model)["module"]).MODEL_CLASS(dtype=torch.float32)
    built.init_random(seed=seed)
    return built.eval()


@contextlib.contextmanager
def vanilla_experts(modules):
    """Every experts implementation of the generated `modules` bound to the VANILLA class (fp32 GEMMs) inside
    the block: the experts contract makes it interchangeable with the bound TORCH class, and SD1 is exact only
    where the arithmetic is."""
    import pytest

    from runtime.experts.vanilla import TorchEagerBf16Experts

    with pytest.MonkeyPatch.context() as patch:
        for module in modules:
            patch.setattr(module, "IMPLEMENTATIONS", {i: (TorchEagerBf16Experts, "VANILLA") for i in module.IMPLEMENTATIONS})
            patch.setattr(module, "CPU_IMPLS", tuple(module.IMPLEMENTATIONS))
        yield


def single_rank(target: dict) -> bool:
    """A build that runs in one process (the multi-rank layouts are tests/parallel's)."""
    module = load("generated" + target["module"])
    return module.LAYOUT.world == 1


def runs_on_cpu(target: dict) -> bool:
    """Every implementation the build binds also runs on the host CPU (else it is built for its GPU)."""
    module = load("generated" + target["module"])
    return set(module.IMPLEMENTATIONS) <= set(module.CPU_IMPLS)


def cpu_twin(impl_id: str) -> tuple[type, str]:
    """(class, backend) of the TORCH implementation of the same format as `impl_id`: the experts contract
    (docs/runtime.md) makes them interchangeable, so a test of a build's own code can run a build bound
    to a GPU-only kernel on the CPU."""
    from registry.impls import load_registry
    from runtime.build import load_class

    twin = load_registry().impl("torch.grouped_mm.grouped_gemm." + impl_id.rsplit(".", 1)[1])
    return load_class(twin.class_path), twin.backend


def tiny_models() -> list[str]:
    return sorted(m for m in index()["models"] if m.startswith("tiny_"))


@functools.lru_cache(maxsize=None)
def declarations() -> dict:
    from registry.declarations import load_models

    return load_models(None)


def declared_selection(target_name: str):
    """The Selection a target was generated under (its declaration's `selection`)."""
    for decl in declarations().values():
        for t in decl.targets:
            if t.name == target_name:
                return t.selection.selection()
    raise KeyError(target_name)


def hf_config(model: str, **overrides):
    """transformers' config of a declared model, built from the declaration's own keys."""
    from transformers import AutoConfig

    data = facts(model)
    config = {k: v for k, v in data.CONFIG.items() if k != "architectures"} | overrides
    return AutoConfig.for_model(data.FAMILY, **config)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, std: float = 0.08, device: str = "cpu") -> None:
    """Distinct random values in every tensor: transformers initialises norms to 1 and biases (expert,
    correction, sinks) to 0, which would hide a weight loaded into the wrong place. Norms 1 + 0.2 N(0, 1),
    the rest `std` N(0, 1) (real layer shapes want a smaller `std` than tiny ones), drawn on `device`."""
    gen = torch.Generator(device).manual_seed(seed)
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        if not t.is_floating_point():
            continue
        values = torch.randn(t.shape, generator=gen, device=device)
        values = 1.0 + 0.2 * values if "norm" in name else std * values
        t.copy_(values.to(t.dtype))


@functools.lru_cache(maxsize=None)
def transformers_checkpoint(model: str, seed: int = 0) -> Path:
    """A bf16 checkpoint of `model` saved by transformers (`save_pretrained`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config(model), dtype=torch.bfloat16)
    randomize(hf, seed)
    folder = _TMP / f"{model}-{seed}"
    hf.save_pretrained(folder)
    return folder


def transformers_model(folder: Path, dtype: torch.dtype):
    """transformers' model of a checkpoint folder in eval mode, on its reference paths: eager attention
    (gpt-oss sinks need it) and the per-expert loop (grouped_mm, its default, has no float64)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """A one-file checkpoint folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def tmp_folder(name: str) -> Path:
    return _TMP / name


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| over the whole tensor, in float64."""
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm())


def per_position_err(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each position's logits `[..., V]`, flattened, in float64."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()


def largest_diff(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The largest logit difference at each position, relative to the largest reference logit, in float64."""
    ours, ref = ours.double(), ref.double()
    return (ours - ref).abs().amax(-1).flatten() / ref.abs().max()


def token_ids(vocab_size: int, batch: int = 2, length: int = 12, seed: int | None = None) -> torch.Tensor:
    """Random token ids; a fresh draw per call unless a seed is given."""
    gen = torch.Generator()
    gen.manual_seed(seed) if seed is not None else gen.seed()
    return torch.randint(0, vocab_size, (batch, length), generator=gen)


# -- quantized checkpoints in the producers' hub layouts, written with our codecs ----------------------


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The DeepSeek recipe, written out here (not runtime.formats): fp8 value times its 128x128 block's
    `weight_scale_inv`, in float64."""
    rows, cols = q.shape
    full = scale_inv.double().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.double() * full


@functools.lru_cache(maxsize=None)
def deepseek_fp8_checkpoint(model: str = "tiny_deepseek_v3", seed: int = 0) -> Path:
    """The transformers checkpoint of `model` in DeepSeek's hub FP8 layout: `weight` float8_e4m3fn plus
    fp32 `weight_scale_inv` per 128x128 block, and config.json's quantization_config exactly as
    DeepSeek-V3 ships it (no modules_to_not_convert): the conversion bench/build.py writes with too."""
    return fp8_block_checkpoint(transformers_checkpoint(model, seed), _TMP / f"{model}-fp8-{seed}")


def fp8_block_checkpoint(source: Path, folder: Path, device: str = "cpu") -> Path:
    """The checkpoint folder `source` (bf16, as transformers saved it) in DeepSeek's FP8 layout, in `folder`
    (quantized on `device`)."""
    from runtime.checkpoint.writer import FP8_BLOCK_QUANTIZATION, fp8_block_tensors

    tensors = {}
    for name, value in read_tensors(source).items():
        tensors.update((k, v.cpu()) for k, v in fp8_block_tensors({name: value.to(device)}).items())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(FP8_BLOCK_QUANTIZATION)
    return write_checkpoint(folder, tensors, config)


@functools.lru_cache(maxsize=None)
def gpt_oss_mxfp4_checkpoint(model: str = "tiny_gpt_oss", seed: int = 0) -> Path:
    """The transformers checkpoint of a gpt-oss model in the hub MXFP4 layout: experts as
    `*_blocks` [E, rows, H/32, 16] / `*_scales` [E, rows, H/32] with rows out-major (gate/up
    interleaved, as transformers keeps them), biases bf16, quantization_config as gpt-oss ships it."""
    return mxfp4_checkpoint(transformers_checkpoint(model, seed), _TMP / f"{model}-mxfp4-{seed}")


def mxfp4_checkpoint(source: Path, folder: Path, device: str = "cpu") -> Path:
    """The gpt-oss checkpoint folder `source` (bf16, as transformers saved it) in the hub MXFP4 layout, in
    `folder` (quantized on `device`)."""
    from runtime.formats import mxfp4

    tensors = read_tensors(source)
    for name in sorted(n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        # transformers' layout is input-major [E, in, out]; the hub's is out-major.
        packed, scales = mxfp4.quantize_mxfp4(tensors.pop(name).to(device).transpose(1, 2).contiguous().float())
        tensors[name + "_blocks"] = mxfp4.canonical_to_gpt_oss_blocks(packed).cpu()
        tensors[name + "_scales"] = scales.cpu()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    return write_checkpoint(folder, tensors, config)


def checkpoint_for(target: dict) -> Path | None:
    """A checkpoint folder in the format of a tiny target's checkpoint, when these helpers write one."""
    name = target["checkpoint"]
    if name.endswith("_bf16"):
        return transformers_checkpoint(target["model"])
    if target["model"] == "tiny_deepseek_v3" and name.endswith("_fp8"):
        return deepseek_fp8_checkpoint()
    if target["model"] == "tiny_gpt_oss" and name.endswith("_mxfp4"):
        return gpt_oss_mxfp4_checkpoint()
    return None


@functools.lru_cache(maxsize=None)
def mtp_checkpoint(model: str, seed: int = 0) -> Path:
    """The transformers checkpoint of `model` plus its MTP layer (`with_mtp_layers`)."""
    return with_mtp_layers(transformers_checkpoint(model, seed), _TMP / f"{model}-mtp-{seed}", 1, seed)


def with_mtp_layers(source: Path, folder: Path, count: int, seed: int = 0) -> Path:
    """A copy of the checkpoint `source` plus `count` MTP layers where DeepSeek-V3 and GLM-4.5 keep them,
    `model.layers.<num_hidden_layers + k>.*` (research formats_configs §4): enorm, hnorm, eh_proj [H, 2H],
    shared_head.{norm,head}, its own embed_tokens copy and a full (MoE) decoder layer. Every tensor
    gets fresh values, unlike the hub's copies of the main embedding and head: a draft that read the
    main model's tensors (or another MTP layer's) instead of its own would then compute something else."""
    tensors = read_tensors(source)
    config = json.loads((source / "config.json").read_text())
    hidden, vocab, last = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"] - 1
    shapes = {}
    for k in range(count):
        prefix = f"model.layers.{last + 1 + k}."
        shapes |= {prefix + name[len(f"model.layers.{last}."):]: t for name, t in tensors.items() if name.startswith(f"model.layers.{last}.")}
        shapes |= {
            prefix + "enorm.weight": torch.empty(hidden, dtype=torch.bfloat16),
            prefix + "hnorm.weight": torch.empty(hidden, dtype=torch.bfloat16),
            prefix + "eh_proj.weight": torch.empty(hidden, 2 * hidden, dtype=torch.bfloat16),
            prefix + "shared_head.norm.weight": torch.empty(hidden, dtype=torch.bfloat16),
            prefix + "shared_head.head.weight": torch.empty(vocab, hidden, dtype=torch.bfloat16),
            prefix + "embed_tokens.weight": torch.empty(vocab, hidden, dtype=torch.bfloat16),
        }
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, like in sorted(shapes.items()):
        values = torch.randn(like.shape, generator=gen)
        tensors[name] = (1.0 + 0.2 * values if "norm" in name else 0.08 * values).to(like.dtype)
    config["num_nextn_predict_layers"] = count
    return write_checkpoint(folder, tensors, config)


def with_mtp_tree(source: Path, folder: Path, copies: dict[str, str], extra: dict[str, tuple], config: dict,
                  seed: int = 0) -> Path:
    """A copy of the checkpoint `source` plus an MTP predictor kept as its own tree (Qwen3-Next's, Nemotron-H's
    `mtp.*`): each `copies` entry `mtp prefix -> target layer prefix` gets that layer's tensor names and shapes,
    each `extra` name its shape; `config` is merged into config.json. Every new tensor gets fresh values (norms
    around 1), so a draft that read a target layer instead of its own would compute something else."""
    tensors = read_tensors(source)
    shapes = {}
    for mtp, layer in copies.items():
        shapes |= {mtp + name[len(layer):]: t for name, t in tensors.items() if name.startswith(layer)}
    shapes |= {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in extra.items()}
    gen = torch.Generator().manual_seed(seed + 2000)
    for name, like in sorted(shapes.items()):
        values = torch.randn(like.shape, generator=gen)
        tensors[name] = (1.0 + 0.2 * values if "norm" in name else 0.08 * values).to(like.dtype)
    return write_checkpoint(folder, tensors, json.loads((source / "config.json").read_text()) | config)


def assert_greedy_equal_up_to_ties(model, tokens: torch.Tensor, reference: torch.Tensor, tol: float = 2e-2) -> None:
    """`tokens` equal the greedy `reference` row by row, except from a position where the model's two top
    logits over the shared prefix lie within `tol` of the largest logit (bf16 rounding of the TORCH
    experts decides such a tie differently between a decode step and a full forward; RULES SD1)."""
    device = next(model.parameters()).device
    for row in range(tokens.shape[0]):
        differ = (tokens[row] != reference[row]).nonzero()
        if not len(differ):
            continue
        col = int(differ[0])
        with torch.no_grad():
            logits = model(tokens[row:row + 1, :col].to(device))[0, -1].float()
        top = logits.topk(2).values
        assert top[0] - top[1] <= tol * logits.abs().max(), f"row {row} position {col}: no tie explains it"


def tie_free_run(target, run, batch: int, length: int, draws: int = 3):
    """(prompt, out) of the first of up to `draws` fresh prompts `[batch, length]` whose greedy speculative run
    `run(prompt)` kept no near-tie token: SD1 is exact there, so callers assert its tokens and counts. A run that
    kept one (a tie within fp32 rounding breaks either way between a verify block and a one-token step) must
    still be the target's greedy reference up to that tie."""
    from runtime.speculative import vocab_size

    for _ in range(draws):
        prompt = token_ids(vocab_size(target), batch, length)
        out = run(prompt)
        if out.near_ties == 0:
            return prompt, out
        new_tokens = out.tokens.shape[1] - length
        assert_greedy_equal_up_to_ties(target, out.tokens, greedy_reference(target, prompt, new_tokens), tol=1e-5)
    raise AssertionError(f"each of {draws} fresh prompts kept a near-tie token")


def greedy_reference(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """`prompt` continued by `n` argmax ids, each from a full forward over everything so far (no cache)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids


@contextlib.contextmanager
def no_host_sync():
    """Any host sync on CUDA inside the block raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


_VARIANT_TARGET = """
[[targets]]
checkpoint = "{name}"
sm = 90
parallel = "tp1"
moe_impls_honored = ["torch.eager.loop.bf16"]
selection = {{ backend = "VANILLA" }}
"""


@functools.lru_cache(maxsize=None)
def variant_build(name: str, model: str, **overrides) -> tuple[object, Path]:
    """(the generated package, its checkpoint folder) of a variant of a tiny model that no declaration holds
    (`overrides` on its transformers config): transformers writes the checkpoint, and the build is made the
    way a user makes one, `python -m codegen import-checkpoint` then `generate --models DIR --out OUT`,
    with one VANILLA target (fp32-exact reference experts). The package `moegen_variant_<name>` is
    importable from here on (and from processes given `variant_path()` on their PYTHONPATH)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(model, **overrides), dtype=torch.bfloat16)
    randomize(hf, 0)
    folder = _TMP / "variant-checkpoints" / name
    hf.save_pretrained(folder)
    declaration = _TMP / "variant-models" / name / f"{name}.toml"
    codegen_cli("import-checkpoint", folder, "--out", declaration)
    declaration.write_text(declaration.read_text() + _VARIANT_TARGET.format(name=name))
    package = f"moegen_variant_{name}"
    codegen_cli("generate", "--models", declaration.parent, "--model", name, "--out", variant_path() / package)
    if str(variant_path()) not in sys.path:
        sys.path.insert(0, str(variant_path()))
    return importlib.import_module(package), folder


def variant_path() -> Path:
    """The folder that holds the variant packages."""
    return _TMP / "variant-builds"


def codegen_run(*args) -> subprocess.CompletedProcess:
    """`python -m codegen ARGS` in a fresh process from the repository root, as a user runs it (text output
    captured); its exit code is the caller's to check."""
    return subprocess.run([sys.executable, "-m", "codegen", *map(str, args)], cwd=ROOT, capture_output=True, text=True)


def codegen_cli(*args) -> str:
    """`python -m codegen ARGS` that must succeed (codegen_run); its stdout."""
    done = codegen_run(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout

