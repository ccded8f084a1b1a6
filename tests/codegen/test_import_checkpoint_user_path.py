"""A Mixtral saved by transformers goes the README's user path (issue 10 §2): transformers writes
`"head_dim": null` and `"sliding_window": null`, import-checkpoint reads them as transformers does, the
target it suggests runs where the README's snippet runs (the host CPU), the build's header names the
`--models` folder it came from (RULES GN2), and a build refused on the CPU names the package the user
loaded it from. The oracle is transformers' Mixtral on the same checkpoint.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from runtime.build import PlacementError
from tests.generated import builds


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Mixtral saved by transformers (bf16 weights; config.json as transformers 5 writes it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    builds.randomize(model, seed=7)
    folder = tmp_path_factory.mktemp("ckpt") / "My-Mixtral"
    model.save_pretrained(folder)
    return folder


def _import_package(out: Path, name: str):
    sys.path.insert(0, str(out.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(out.parent))


@pytest.fixture
def forget():
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in ("userbuilds", "gpubuilds")]:
        del sys.modules[name]


def test_a_mixtral_with_null_head_dim_imports_generates_and_loads_on_the_cpu_with_transformers_logits(saved, tmp_path, forget):
    written = json.loads((saved / "config.json").read_text())
    assert written["head_dim"] is None and written["sliding_window"] is None   # what transformers writes
    declaration = tmp_path / "mymodels" / "mine.toml"
    assert builds.codegen_cli("import-checkpoint", saved, "--out", declaration) == f"wrote {declaration}: layers 0-1: bf16\n"
    text = declaration.read_text()
    # The suggested target, uncommented as the README says to add it.
    suggested = text[text.index("# [[targets]]"):]
    assert suggested == (
        '# [[targets]]\n# checkpoint = "mine"\n# sm = 90\n# parallel = "tp1"\n'
        '# moe_impls_honored = ["torch.grouped_mm.grouped_gemm.bf16"]\n# selection = { backend = "TORCH" }\n'
    )
    declaration.write_text(text + re.sub(r"(?m)^# ", "", suggested))
    out = tmp_path / "out" / "userbuilds"
    builds.codegen_cli("generate", "--models", declaration.parent, "--model", "mine", "--sm", "90", "--parallel", "tp1", "--out", out)
    header = (out / "mine" / "mine__sm_90__tp1" / "modeling.py").read_text().splitlines()[1]
    assert header == f"# Regenerate: python -m codegen generate --model mine --sm 90 --parallel tp1 --models {declaration.parent}"

    package = _import_package(out, "userbuilds")
    # The README's snippet, on the CPU, with the selection the suggested target declares.
    ours = package.load_model("mine", 90, checkpoint=saved, moe_config={"backend": "TORCH"}, dtype=torch.float32)
    assert type(ours).__module__ == "userbuilds.mine.mine__sm_90__tp1.modeling"
    reference = builds.transformers_model(saved, torch.float32)
    ids = builds.token_ids(96, batch=3, length=16)
    with torch.no_grad():
        got, ref = ours(ids).double(), reference(ids).logits.double()
    errors = (got - ref).norm(dim=-1).flatten() / ref.norm(dim=-1).flatten()
    assert errors.median() <= 8e-3, errors.median()
    assert (errors <= 1e-2).float().mean() >= 0.9, errors


GPU_TARGET = """
[[targets]]
checkpoint = "gpu"
sm = 90
parallel = "tp1"
moe_impls_honored = ["cupy.mma.grouped_gemm.bf16"]
"""


def test_a_build_refused_on_the_cpu_names_the_package_it_was_loaded_from(saved, tmp_path, forget):
    declaration = tmp_path / "models" / "gpu.toml"
    builds.codegen_cli("import-checkpoint", saved, "--out", declaration)
    declaration.write_text(declaration.read_text() + GPU_TARGET)
    out = tmp_path / "out" / "gpubuilds"
    builds.codegen_cli("generate", "--models", declaration.parent, "--model", "gpu", "--sm", "90", "--parallel", "tp1", "--out", out)
    module = _import_package(out, "gpubuilds.gpu.gpu__sm_90__tp1.modeling")
    with pytest.raises(PlacementError) as refused:
        module.MODEL_CLASS(device="cpu")
    assert str(refused.value) == (
        "gpu__sm_90__tp1 is built for sm_90 and binds cupy.mma.grouped_gemm.bf16, which does not run on the host CPU; "
        "construct it on an sm_90 GPU, or load through gpubuilds.load_model with a selection whose implementations "
        "run on the CPU (moe_config.backend TORCH or VANILLA)"
    )
