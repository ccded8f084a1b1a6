"""Which specialized builds keep their attention, dense MLP and shared-expert linears in FP8 blocks (runtime/ops/fp8_linear.py).

Those of an FP8_BLOCK_SCALES checkpoint whose exclusions leave every such linear quantized; a bf16
checkpoint, an exclusion naming one of them (or a module above it) or a generic build dequantize them.
The rendered file says which: `FP8_LINEARS` and `fp8_block=` appear exactly in the first case.
"""
from __future__ import annotations

import pytest

from codegen.modeling import render_generic, render_modeling

MODEL = "tiny_deepseek_v3"


def _plan(project, checkpoint):
    decls, registry, plans = project
    return decls[MODEL], next(p.plan for p in plans[MODEL][1] if p.plan.checkpoint == checkpoint), registry


def _with_exclusions(decl, checkpoint, exclusions):
    checkpoints = tuple(c.model_copy(update={"exclude_modules": exclusions}) if c.name == checkpoint else c
                        for c in decl.checkpoints)
    return decl.model_copy(update={"checkpoints": checkpoints})


def test_the_fp8_block_target_keeps_its_linears_in_fp8(project):
    text = render_modeling(*_plan(project, "tiny_deepseek_v3_fp8"), "cmd")
    assert "FP8_LINEARS = True" in text and text.count("fp8_block=FP8_LINEARS") == 3


def test_a_bf16_target_and_the_generic_build_are_unchanged(project):
    decl, plan, registry = _plan(project, "tiny_deepseek_v3_bf16")
    for text in (render_modeling(decl, plan, registry, "cmd"), render_generic(decl, plan, registry, "cmd")):
        assert "FP8_LINEARS" not in text and "fp8_block=" not in text


@pytest.mark.parametrize("exclusion", ["model.layers.*.self_attn", "model.layers.0.mlp.down_proj", "model.layers.*"])
def test_an_exclusion_of_one_of_those_linears_leaves_them_dequantized(project, exclusion):
    decl, plan, registry = _plan(project, "tiny_deepseek_v3_fp8")
    decl = _with_exclusions(decl, "tiny_deepseek_v3_fp8", ("lm_head", "model.layers.*.mlp.gate", exclusion))
    assert "fp8_block=" not in render_modeling(decl, plan, registry, "cmd")
