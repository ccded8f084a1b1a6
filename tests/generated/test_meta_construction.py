"""Every generated build, full-size ones included, imports and constructs on the meta device: a build can be inspected (and planned for) on a laptop, and its constructor allocates nothing before weights load (issue 4, "Done when").

Constructing them is also where each build's ignore list is checked against its own tensor names.
"""
from __future__ import annotations

import fnmatch
import time

import pytest
import torch

from tests.generated import builds

# The one real allocation construction makes: rotary inv_freq tables, computed on the CPU (a few
# hundred floats per model; runtime/ops/rotary.py).
REAL_BYTES_ALLOWED = 1 << 16


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    # Experts implementations keep their weights as buffers (quantized codes and scales), not parameters.
    return list(module.parameters()) + list(module.buffers())


def _real_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(module) if not t.is_meta)


def _elements(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in _tensors(module))


def _ignores_none_of_its_own(module, model: torch.nn.Module) -> None:
    """IGNORED_TENSORS names its draft's tensors only: the loader refuses any other unread tensor, and a
    pattern that also matched the build's own names would let a misnamed checkpoint tensor pass silently."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    hidden = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in module.IGNORED_TENSORS)]
    assert not hidden, f"IGNORED_TENSORS {module.IGNORED_TENSORS} cover the build's own tensors {hidden[:3]}"


def _generic_cases() -> list[tuple[str, str, int, str]]:
    """(model, checkpoint, sm, parallel): each declared target's key, and every checkpoint on sm_90 tp1,
    so a generic build of a model without targets is constructed too."""
    cases = set()
    for model in builds.index()["models"]:
        for t in builds.specialized(model):
            cases.add((model, t["checkpoint"], t["sm"], t["parallel"]))
        for checkpoint in builds.facts(model).FACTS:
            cases.add((model, checkpoint, 90, "tp1"))
    return sorted(cases)


SPECIALIZED = [p for p in builds.modeling_files() if p.parent.name != "generic"]


@pytest.mark.parametrize("path", SPECIALIZED, ids=lambda p: str(p.parent.relative_to(builds.GENERATED)))
def test_every_specialized_build_constructs_on_meta_without_memory(path):
    module = builds.load(builds.module_name(path))
    model = module.MODEL_CLASS(device="meta")
    assert _elements(model) > 0
    assert _real_bytes(model) <= REAL_BYTES_ALLOWED
    _ignores_none_of_its_own(module, model)


@pytest.mark.parametrize("case", _generic_cases(), ids=lambda c: f"{c[1]}@sm{c[2]}-{c[3]}")
def test_every_generic_build_constructs_on_meta(case):
    # RULES GN1: the generic build resolves its layers when constructed, through the registry.
    model, checkpoint, sm, parallel = case
    module = builds.load(f"generated.{model}.generic.modeling")
    built = module.MODEL_CLASS(checkpoint=checkpoint, sm=sm, parallel=parallel, selection=None, device="meta")
    assert all(report.winner for report in built.resolution.reports)
    assert _real_bytes(built) <= REAL_BYTES_ALLOWED
    _ignores_none_of_its_own(module, built)


@pytest.mark.parametrize("path", builds.draft_files(), ids=lambda p: str(p.parent.relative_to(builds.GENERATED)))
def test_every_draft_constructs_on_meta_without_memory(path):
    module = builds.load(builds.module_name(path))
    if path.parent.name == "generic":  # resolves its draft layers at load, for the model's first checkpoint
        from registry.selection import Selection

        facts = builds.load(f"generated.{path.parent.parent.name}.facts")
        draft = module.DRAFT_CLASS(checkpoint=next(iter(facts.FACTS)), sm=90, selection=Selection(spec_mode=module.MODE), device="meta")
        assert draft.draft_layer_ids()
    else:
        draft = module.DRAFT_CLASS(device="meta")
    assert _elements(draft) > 0
    assert _real_bytes(draft) <= REAL_BYTES_ALLOWED


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_deepseek_v3_size_build_constructs_in_little_time_and_memory():
    # The whole 671B-parameter model on one rank (tp1): 1.3 TB in bf16 if anything were allocated.
    module = builds.load("generated.deepseek_v3.generic.modeling")
    module.MODEL_CLASS(checkpoint="deepseek_v3_fp8", sm=90, parallel="tp1", device="meta")  # warm imports and caches
    before, start = _rss_bytes(), time.perf_counter()
    model = module.MODEL_CLASS(checkpoint="deepseek_v3_fp8", sm=90, parallel="tp1", device="meta")
    seconds, grown = time.perf_counter() - start, _rss_bytes() - before
    elements = _elements(model)
    assert elements > 600e9, elements
    # Measured: ~0.05 s and a few MB of module objects; the bounds leave room for a loaded CI host.
    assert seconds < 3.0, seconds
    assert grown < 128 << 20, grown
