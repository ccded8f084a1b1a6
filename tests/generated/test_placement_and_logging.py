"""A build checks where it is constructed (a GPU of its target's SM, or the host CPU when every implementation it binds runs there) and refuses anything else naming both; it logs each implementation it constructs once per process (issue 4 item 7; RULES LR6)."""
from __future__ import annotations

import logging

import pytest
import torch

from registry.impls import load_registry
from registry.selection import Selection
from runtime import build
from runtime.build import PlacementError
from tests.generated import builds

QWEN = "generated.tiny_qwen3_moe.tiny_qwen3_moe_bf16__sm_90__tp1.modeling"
IMPLS = {"torch.grouped_mm.grouped_gemm.bf16": (object, "TORCH"), "cupy.mma.grouped_gemm.bf16": (object, "CUPY")}


def test_a_gpu_only_implementation_is_refused_on_the_cpu_naming_the_build_the_sm_and_the_kernel():
    with pytest.raises(PlacementError) as refused:
        build.check_placement("m__sm_90__tp1", 90, "cpu", IMPLS, cpu_ids=("torch.grouped_mm.grouped_gemm.bf16",))
    assert str(refused.value) == (
        "m__sm_90__tp1 is built for sm_90 and binds cupy.mma.grouped_gemm.bf16, which does not run on the host CPU; "
        "construct it on an sm_90 GPU, or load through generated.load_model with a selection whose implementations "
        "run on the CPU (moe_config.backend TORCH or VANILLA)"
    )


def test_the_cpu_is_accepted_when_every_bound_implementation_runs_there():
    build.check_placement("m__sm_90__tp1", 90, "cpu", IMPLS, cpu_ids=tuple(IMPLS))


def test_a_gpu_of_another_sm_is_refused_naming_both_sms(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with pytest.raises(PlacementError) as refused:
        build.check_placement("m__sm_90__tp1", 90, "cuda:0", IMPLS, cpu_ids=())
    assert str(refused.value).startswith("m__sm_90__tp1 is built for sm_90, but cuda:0 is sm_100; ")


def test_a_gpu_of_the_target_sm_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    build.check_placement("m__sm_90__tp1", 90, "cuda:0", IMPLS, cpu_ids=())


def test_a_generated_build_checks_its_placement_before_allocating_anything(monkeypatch):
    # No GPU here: a device that got as far as allocating would fail with a CUDA error instead.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with pytest.raises(PlacementError, match=r"^tiny_qwen3_moe_bf16__sm_90__tp1 is built for sm_90, but cuda is sm_100; "):
        builds.load(QWEN).MODEL_CLASS(device="cuda")


def test_a_generated_build_bound_to_a_gpu_kernel_is_refused_on_the_cpu():
    targets = [t for m in builds.index()["models"] for t in builds.specialized(m) if not builds.runs_on_cpu(t)]
    if not targets:
        pytest.skip("no generated build binds a GPU-only implementation")
    module = builds.load("generated" + targets[0]["module"])
    with pytest.raises(PlacementError, match=rf"^{targets[0]['name']} is built for sm_{module.SM} and binds .* not run on the host CPU"):
        module.MODEL_CLASS(device="cpu")


def test_other_devices_are_refused():
    with pytest.raises(PlacementError, match="runs on an sm_90 GPU or the host CPU, not on xpu"):
        build.check_placement("m__sm_90__tp1", 90, "xpu", IMPLS, cpu_ids=tuple(IMPLS))


def _lr6(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moegen" and r.getMessage().startswith("MoE layers run ")]


def _line(impl_id: str) -> str:
    impl = load_registry().impl(impl_id)
    return f"MoE layers run {impl.class_name}, MoE implementation id {impl_id} (moe_backend {impl.backend})"


def test_each_implementation_is_logged_once_per_process_in_the_rule_s_words(caplog, monkeypatch):
    monkeypatch.setattr(build, "_LOGGED", set())  # as in a fresh process
    caplog.set_level(logging.INFO, logger="moegen")
    module = builds.load(QWEN)
    module.MODEL_CLASS(device="meta")
    module.MODEL_CLASS(device="meta")
    generic = builds.load("generated.tiny_deepseek_v3.generic.modeling")
    generic.MODEL_CLASS(checkpoint="tiny_deepseek_v3_bf16", sm=90, selection=Selection(backend="TORCH"), device="meta")
    generic.MODEL_CLASS(checkpoint="tiny_deepseek_v3_bf16", sm=90, selection=Selection(backend="VANILLA"), device="meta")
    assert _lr6(caplog) == [_line("torch.grouped_mm.grouped_gemm.bf16"), _line("torch.eager.loop.bf16")]
