"""Shared builders for the registry tests: synthetic registries and small model facts.

The project registry has four backends (TORCH, the fallback; VANILLA, which never degrades; CUPY and
TRITON, GPU-only). Rules about a backend beside the base two (a literal that degrades to the fallback,
two backends serving one format) are exercised on `cupy_registry()`: the project registry with its CUPY
and TRITON backends replaced by a synthetic CUPY one whose implementations have narrow eligibility on
purpose.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from registry.declarations import load_models
from registry.eligibility import Problem
from contract import MoeShape
from registry.formats import LayerFormat
from registry.impls import DEFAULT_PATH, load_registry, load_registry_text
from registry.model import DraftFacts, ModelFacts, MoeSite

REAL_TEXT = DEFAULT_PATH.read_text(encoding="utf-8")


def _without_backend(text: str, backend: str) -> str:
    """`text` less the backend's table and its `[[impl]]` entries (blank-line separated blocks)."""
    blocks = re.split(r"\n(?=\[)", text)
    return "\n".join(b for b in blocks
                     if not b.startswith(f"[backends.{backend}]") and f'backend = "{backend}"' not in b)


# The project registry without its own CUPY backend (nor TRITON, whose classes are CUPY's with Triton
# prefill GEMMs): the synthetic one below replaces it.
REAL_TEXT_WITHOUT_CUPY = _without_backend(_without_backend(REAL_TEXT, "CUPY"), "TRITON")

_CAPS = {
    "expert_bias": "true",
    "activations": '["silu_glu", "swiglu_oai", "relu2"]',
    "router_weight_on_input": "false",
    "dynamic_eplb": "true",
    "expert_parallel": "true",
    "moe_tensor_parallel": "true",
}


def impl_toml(
    id: str,
    backend: str,
    priority: int,
    sms: str = "[90, 100]",
    cpu: str = "false",
    klass: str = "runtime.experts.fake:FakeExperts",
    doc: str = "A synthetic implementation.",
    constraints: str = "{ hidden_multiple = 1, intermediate_multiple = 1 }",
    verified_sms: str = "[]",
    weights: str | None = None,
    **caps: str,
) -> str:
    """One `[[impl]]` entry as TOML text; capability values are TOML literals. `weights` defaults to
    the value a registry entry of that format may hold ("none" for bf16, else "at_load")."""
    values = _CAPS | caps
    cap_text = ", ".join(f"{k} = {v}" for k, v in values.items())
    weights = weights or ('"none"' if id.endswith(".bf16") else '"at_load"')
    return (
        "\n[[impl]]\n"
        f'id = "{id}"\nbackend = "{backend}"\npriority = {priority}\nsms = {sms}\nverified_sms = {verified_sms}\ncpu = {cpu}\n'
        f'class = "{klass}"\ndoc = "{doc}"\nweights = {weights}\ncapabilities = {{ {cap_text} }}\nconstraints = {constraints}\n'
    )


BACKENDS = """
[backends.TORCH]
doc = "The fallback."
fallback = true

[backends.VANILLA]
doc = "The reference."
never_degrades = true
"""


def small_registry_text(*impls: str, backends: str = BACKENDS, mxfp4: str = "") -> str:
    """A minimal registry: the two base backends, the given entries, an optional FN2 table."""
    base = [
        impl_toml("torch.grouped_mm.grouped_gemm.bf16", "TORCH", 500),
        impl_toml("torch.eager.loop.bf16", "VANILLA", 900, dynamic_eplb="false"),
    ]
    table = f"\n[mxfp4_run_formats]\n{mxfp4}\n" if mxfp4 else ""
    return backends + "".join(base) + "".join(impls) + table


# A third backend. Priorities ahead of TORCH: CUPY is preferred where it is eligible.
CUPY_TEXT = (
    '\n[backends.CUPY]\ndoc = "CUDA kernels through CuPy (synthetic, for tests)."\n'
    + impl_toml(
        "cupy.mma.grouped_gemm.bf16",
        "CUPY",
        100,
        sms="[90, 100]",
        expert_bias="false",
        activations='["silu_glu"]',
        dynamic_eplb="false",
        moe_tensor_parallel="false",
        constraints="{ hidden_multiple = 128, intermediate_multiple = 64 }",
    )
    + impl_toml("cupy.mma.grouped_gemm.nvfp4", "CUPY", 101, sms="[100]")
    + impl_toml("cupy.mma.grouped_gemm.w4a8_mxfp4_mxfp8", "CUPY", 102, sms="[100]")
)


@functools.lru_cache(maxsize=None)
def cupy_registry():
    """The project registry with the synthetic CUPY backend in place of its own."""
    return load_registry_text(REAL_TEXT_WITHOUT_CUPY + CUPY_TEXT, "cupy-registry.toml")


def real_registry():
    return load_registry()


@functools.lru_cache(maxsize=None)
def project_models():
    return load_models()


def site(layer: int, fmt: str, excluded: bool = False, source: str | None = None) -> MoeSite:
    return MoeSite(layer, f"model.layers.{layer}.mlp.experts", LayerFormat(fmt, source or f"test {fmt}", excluded))


SHAPE = MoeShape(hidden_size=1024, intermediate_size=512, num_experts=8, top_k=2, activation="silu_glu", expert_bias=False)


def facts(
    *sites: MoeSite,
    shape: MoeShape = SHAPE,
    drafts: tuple[DraftFacts, ...] = (),
    excluded_layers: str = "tactic",
    model: str = "synthetic",
) -> ModelFacts:
    """A model given by its MoE sites, for rules that need no declaration file."""
    return ModelFacts(
        model=model,
        family="deepseek_v3",
        checkpoint=f"{model}_ckpt",
        shape=shape,
        sites=tuple(sites),
        excluded_layers=excluded_layers,
        drafts=drafts,
    )


def problem(fmt: str = "bf16", **kw) -> Problem:
    return Problem(format=fmt, **kw)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# A valid user declaration of a tiny mixtral-family model (file name must be mymodel.toml).
GOOD = """\
[model]
name = "mymodel"
family = "mixtral"
doc = "A user's own model."

[config]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_local_experts = 4
num_experts_per_tok = 2

[[checkpoints]]
name = "mymodel_bf16"

[[targets]]
checkpoint = "mymodel_bf16"
sm = 90
parallel = "tp1"
moe_impls_honored = ["torch.grouped_mm.grouped_gemm.bf16"]
"""
