"""What the parallel tests share: the tiny runs, their checkpoints, the one-process references and the tolerances.

Every multi-rank run loads one seeded checkpoint written by the launcher's own `--tiny` path
(`generated.run.write_tiny`), so each rank reads its shard of the same full weights; the references are
one-rank (tp1) builds loading the same files in the test process.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

import generated
from generated import run
from generated._build_index import INDEX
from runtime.launch import ForwardJob

# The tiny models and the SM their targets are declared for (tiny_kimi_k3 mirrors kimi_k3's sm_100).
SM = {"tiny_qwen3_moe": 90, "tiny_kimi_k3": 100}
CHECKPOINT = {"tiny_qwen3_moe": "tiny_qwen3_moe_bf16", "tiny_kimi_k3": "tiny_kimi_k3_mxfp4"}
TOKENS = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(5))

# bf16 builds, as load_model makes them. A sharded layout rounds its partial sums (attention TP, MoE TP,
# each EP rank's experts) to bf16 before reducing them, where one rank rounds the whole sum once: most
# positions differ by 1-2 bf16 ulps of the largest logit (<= 1e-2 relative). Now and then that rounding
# flips a router's choice between two experts whose scores tie in bf16, and that token's logits move
# further (measured: one position in 16 at 0.038 under tp2). So: 90% of positions within BF16_TOL, none
# beyond BF16_FLIP_TOL. A weight read from another rank's shard, or a reduction left out, moves every
# position by the logits' own size (relative error ~1).
BF16_TOL = 1.5e-2
BF16_FLIP_TOL = 0.1
BF16_WITHIN = 0.9
# fp32 builds bound to the VANILLA reference experts (fp32 GEMMs): the sharded sum equals the whole
# one up to fp32 summation order (measured 2e-7 to 5e-7 relative).
FP32_TOL = 1e-5


def write_checkpoint(model: str, folder) -> str:
    run.write_tiny(model, SM[model], CHECKPOINT[model], folder, seed=0)
    return str(folder)


# Where the ranks find the variant builds of tests/generated/builds.variant_build (set through
# `launch(env=...)`: a rank is a fresh process that never made them).
VARIANT_PATH_ENV = "MOEGEN_TEST_VARIANT_PATH"


def generic_module(model: str):
    """The generic build of a generated model, or of a CLI-built variant (package moegen_variant_<model>)."""
    if model in INDEX["models"]:
        return importlib.import_module(INDEX["models"][model]["generic"], "generated")
    folder = os.environ.get(VARIANT_PATH_ENV)
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    package = f"moegen_variant_{model}"
    index = importlib.import_module(f"{package}._build_index").INDEX
    return importlib.import_module(index["models"][model]["generic"], package)


def load_fp32_reference(model, sm, parallel, *, checkpoint, checkpoint_name, device="cpu", mode="off", rank=0, seed=0):
    """A `load_model` stand-in: the generic build in fp32 with every MoE layer on the VANILLA experts."""
    from registry.selection import Selection

    generic = generic_module(model)
    built = generic.MODEL_CLASS(checkpoint=checkpoint_name, sm=sm, parallel=parallel, selection=Selection(backend="VANILLA"),
                                device=device, rank=rank, dtype=torch.float32)
    built.load_checkpoint(checkpoint)
    return built


def reference_logits(model: str, checkpoint: str, fp32: bool = False, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """The one-process logits: the tp1 specialized build (bf16), or the fp32 VANILLA generic build."""
    if fp32:
        whole = load_fp32_reference(model, SM[model], "tp1", checkpoint=checkpoint, checkpoint_name=CHECKPOINT[model])
    else:
        whole = generated.load_model(model, SM[model], "tp1", checkpoint=checkpoint,
                                     checkpoint_name=CHECKPOINT[model], mode="require")
    with torch.no_grad():
        return whole.eval()(tokens).float()


def job(model: str, parallel: str, checkpoint: str, mode: str, fp32: bool = False,
        tokens: torch.Tensor = TOKENS) -> ForwardJob:
    return ForwardJob(model, SM[model], parallel, checkpoint, CHECKPOINT[model], tokens, mode=mode,
                      loader=load_fp32_reference if fp32 else None)


def position_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per (row, position): the largest logit difference relative to the largest reference logit."""
    return (got - ref).abs().amax(-1) / ref.abs().max()
