"""Every runtime family's checkpoint as transformers saves it (fp32, its default, and bf16; one file and sharded) goes through README's "Your own checkpoint" path and computes transformers' logits (issue 10, "Done when").

The path is the README's, command for command: `python -m codegen import-checkpoint DIR --name mine
--out mymodels/mine.toml`, a `[[targets]]` entry added by hand, `python -m codegen generate --models
mymodels --model mine --sm 90 --parallel tp1 --out out/mybuilds`, then `mybuilds.load_model("mine",
90, checkpoint=DIR, ...)` from `out` on the path, asking for fp32 and the VANILLA backend (the
target honors VANILLA's bf16 id, so its specialized build serves). VANILLA computes in fp32 and keeps
fp32 expert weights in an fp32 build, so the oracle, transformers' own model of the same folder in
fp32, is matched to <= 1e-5 relative (observed <= 1e-6).

The four saves of one family hold the same model, so their imported declarations must be the same
text; the package is generated once per family from that declaration.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from tests.generated import builds

# (save dtype, sharded) of each checkpoint folder a family's model is saved as.
SAVES = {"fp32": (torch.float32, False), "fp32_sharded": (torch.float32, True),
         "bf16": (torch.bfloat16, False), "bf16_sharded": (torch.bfloat16, True)}
TARGET = """
[[targets]]
checkpoint = "mine"
sm = 90
parallel = "tp1"
moe_impls_honored = ["torch.eager.loop.bf16"]
"""


def _save(model: torch.nn.Module, folder: Path, sharded: bool) -> None:
    # Half the model's bytes per shard: transformers then writes at least two shards and an index.
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=f"{total // 2 // 1000}KB" if sharded else "1GB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if sharded:
        assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file(), shards
    else:
        assert shards == ["model.safetensors"]


@pytest.fixture(scope="module", params=sorted(builds.TINY))
def family_package(request):
    """(family, {save: checkpoint folder}, the generated package's name, its parent folder on sys.path)."""
    from transformers import AutoModelForCausalLM

    family, tiny = request.param, builds.TINY[request.param]
    work = builds.tmp_folder(f"readme-path-{family}")
    # The config is the tiny declaration's (registry/models/tiny_<family>.toml), read by transformers.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(builds.hf_config(tiny))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    builds.randomize(model, seed=11)
    folders = {}
    for save, (dtype, sharded) in SAVES.items():
        # Every folder is named `mine` so the imported declarations can be compared as text.
        folders[save] = work / save / "mine"
        _save(model.to(dtype), folders[save], sharded)

    declarations = {}
    for save, folder in folders.items():
        out = work / save / "mymodels" / "mine.toml"
        assert builds.codegen_cli("import-checkpoint", str(folder), "--name", "mine", "--out", str(out)).startswith(f"wrote {out}: ")
        declarations[save] = out.read_text()
    assert len(set(declarations.values())) == 1, "the four saves of one model import differently"

    mymodels = work / "mymodels"
    mymodels.mkdir()
    (mymodels / "mine.toml").write_text(declarations["fp32"] + TARGET)
    package = f"mybuilds_{family}"
    out = work / "out" / package
    builds.codegen_cli("generate", "--models", str(mymodels), "--model", "mine", "--sm", "90", "--parallel", "tp1", "--out", str(out))
    sys.path.insert(0, str(out.parent))
    try:
        yield family, folders, package
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


@pytest.mark.parametrize("save", sorted(SAVES))
def test_a_transformers_checkpoint_loads_through_the_readme_path_with_transformers_logits(family_package, save):
    family, folders, package = family_package
    folder = folders[save]
    ours = importlib.import_module(package).load_model(
        "mine", 90, checkpoint=folder, dtype=torch.float32, moe_config={"backend": "VANILLA"})
    assert type(ours).__module__ == f"{package}.mine.mine__sm_90__tp1.modeling"
    # VANILLA computes in fp32: in an fp32 build it keeps the checkpoint's expert weights in fp32.
    experts = [m for m in ours.modules() if type(m).__name__ == "TorchEagerBf16Experts"]
    assert experts and all(e.up_weight.dtype == torch.float32 for e in experts)   # every activation has an up projection

    reference = builds.transformers_model(folder, torch.float32)
    ids = builds.token_ids(reference.config.vocab_size, batch=2, length=8)
    with torch.no_grad():
        err = builds.rel_err(ours(ids), reference(ids).logits)
    assert err <= 1e-5, f"{family} {save}: relative error {err:.2e}"
