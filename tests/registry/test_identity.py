"""Implementation identity and the registry's own checks (RULES ID1-ID4), on synthetic registries."""

from __future__ import annotations

import re

import pytest

from registry.errors import RegistryError
from registry.identity import FIELDS, SEGMENT_RE, ImplId
from registry.impls import AUTO, RUN_FORMATS, load_registry, load_registry_text
from tests.registry.helpers import BACKENDS, cupy_registry, impl_toml, real_registry, small_registry_text


def load_error(text: str) -> str:
    with pytest.raises(RegistryError) as info:
        load_registry_text(text, "test.toml")
    return str(info.value)


# --- ID1: four segments, each [a-z0-9]+(_[a-z0-9]+)*, stored lowercase, unique ------------------


def test_every_registered_id_has_four_valid_lowercase_segments():
    # RULES ID1
    for impl in real_registry().impls:
        parts = str(impl.id).split(".")
        assert len(parts) == 4
        assert all(re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", p) for p in parts)
        assert ImplId.parse(str(impl.id)) == impl.id


def test_an_id_parses_into_its_four_named_fields():
    # RULES ID1
    impl_id = ImplId.parse(" Torch.Grouped_MM.grouped_gemm.BF16 ")
    assert (impl_id.provider, impl_id.technique, impl_id.kernel_name, impl_id.quant) == ("torch", "grouped_mm", "grouped_gemm", "bf16")
    assert str(impl_id) == "torch.grouped_mm.grouped_gemm.bf16"
    assert FIELDS == ("provider", "technique", "kernel_name", "quant")


@pytest.mark.parametrize("segment", ["mma-x", "_mma", "mma_", "mma__x", "", "m a"])
def test_a_segment_outside_the_pattern_is_refused(segment):
    # RULES ID1
    assert not SEGMENT_RE.match(segment)
    with pytest.raises(RegistryError):
        ImplId.parse(f"cupy.{segment}.k.bf16")


def test_a_registry_entry_with_a_bad_segment_is_refused_naming_entry_and_segment():
    # RULES ID1
    assert load_error(small_registry_text(impl_toml("cupy.mma-x.k.bf16", "TORCH", 1))) == (
        "test.toml: impl #3 (cupy.mma-x.k.bf16): implementation id 'cupy.mma-x.k.bf16': technique segment "
        "'mma-x' must match ^[a-z0-9]+(_[a-z0-9]+)*$ (RULES ID1)"
    )


def test_a_registry_entry_with_three_segments_is_refused():
    # RULES ID1
    assert load_error(small_registry_text(impl_toml("cupy.mma.bf16", "TORCH", 1))) == (
        "test.toml: impl #3 (cupy.mma.bf16): implementation id 'cupy.mma.bf16' has 3 segments; an id has "
        "exactly four: provider.technique.kernel_name.quant (RULES ID1)"
    )


def test_a_registry_id_not_written_lowercase_is_refused_with_its_stored_form():
    # RULES ID1
    assert load_error(small_registry_text(impl_toml("Cupy.mma.k.bf16", "TORCH", 1))) == (
        "test.toml: impl #3 (Cupy.mma.k.bf16): ids are stored lowercase; write 'cupy.mma.k.bf16' (RULES ID1)"
    )


def test_a_duplicate_id_is_a_registry_error():
    # RULES ID1
    assert load_error(small_registry_text(impl_toml("torch.eager.loop.bf16", "TORCH", 1))) == (
        "test.toml: duplicate implementation id 'torch.eager.loop.bf16' (RULES ID1)"
    )


# --- ID2: the token sets of the four fields are disjoint ----------------------------------------


def test_a_token_used_in_two_fields_of_different_ids_is_refused():
    # RULES ID2: 'loop' is VANILLA's kernel_name, here a technique.
    assert load_error(small_registry_text(impl_toml("cupy.loop.k.bf16", "TORCH", 1))) == (
        "test.toml: token 'loop' is used as both technique and kernel_name; a token names exactly one field (RULES ID2)"
    )


def test_a_token_used_in_two_fields_of_one_id_is_refused():
    # RULES ID2
    assert load_error(small_registry_text(impl_toml("cupy.cupy.k.bf16", "TORCH", 1))) == (
        "test.toml: token 'cupy' is used as both provider and technique; a token names exactly one field (RULES ID2)"
    )


def test_every_token_of_the_project_registry_names_exactly_one_field():
    # RULES ID2
    registry = real_registry()
    for impl in registry.impls:
        for field in FIELDS:
            assert registry.token_field[impl.id.segment(field)] == field


# --- ID3: the SM is not a segment ----------------------------------------------------------------


def test_the_sm_is_eligibility_data_not_a_segment():
    # RULES ID3: one id serves every SM it lists; no segment names an SM.
    registry = real_registry()
    for impl in registry.impls:
        assert not any(re.fullmatch(r"sm_?\d+", impl.id.segment(f)) for f in FIELDS)
        assert impl.sms and all(isinstance(sm, int) for sm in impl.sms)
    assert registry.impl("torch.eager.loop.bf16").runs_on(80)
    assert not registry.impl("torch.grouped_mm.grouped_gemm.bf16").runs_on(80)


# --- ID4: each entry declares its data; backends are literals -------------------------------------


def test_every_entry_declares_backend_priority_format_sms_cpu_capabilities_constraints_class_and_doc():
    # RULES ID4
    registry = real_registry()
    priorities = [i.priority for i in registry.impls]
    assert priorities == sorted(priorities) and len(set(priorities)) == len(priorities)
    for impl in registry.impls:
        assert impl.backend in registry.backend_names
        assert impl.format == impl.id.quant and impl.format in RUN_FORMATS
        assert impl.cpu is (impl.backend not in ("CUPY", "TRITON"))  # TORCH and VANILLA run on the host CPU too
        assert impl.capabilities.activations
        assert impl.constraints.hidden_multiple >= 1 and impl.constraints.intermediate_multiple >= 1
        assert re.fullmatch(r"runtime\.experts\.[a-z_]+:[A-Z][A-Za-z0-9]*Experts", impl.class_path)
        assert impl.doc and "\n" not in impl.doc


def test_the_project_backends_are_torch_the_fallback_and_vanilla_which_never_degrades():
    # RULES ID4
    registry = real_registry()
    assert registry.literals == (AUTO, "CUPY", "TORCH", "TRITON", "VANILLA")
    assert registry.fallback_backend == "TORCH"
    assert registry.backend("VANILLA").never_degrades and not registry.backend("VANILLA").fallback
    assert {str(i.id).rsplit(".", 1)[0] for i in registry.impls if i.backend == "VANILLA"} == {"torch.eager.loop"}
    assert {str(i.id).rsplit(".", 1)[0] for i in registry.impls if i.backend == "TORCH"} == {"torch.grouped_mm.grouped_gemm"}
    assert {str(i.id).rsplit(".", 1)[0] for i in registry.impls if i.backend == "CUPY"} == {"cupy.mma.grouped_gemm"}


def test_the_impls_are_kept_in_global_priority_order_whatever_the_file_order():
    # RULES ID4
    text = small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1))
    assert [str(i.id) for i in load_registry_text(text).impls] == [
        "cupy.mma.k.bf16",
        "torch.grouped_mm.grouped_gemm.bf16",
        "torch.eager.loop.bf16",
    ]


def test_a_shared_priority_is_refused():
    # RULES ID4
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 900))) == (
        "test.toml: cupy.mma.k.bf16 and torch.eager.loop.bf16 share priority 900; the priority order is one "
        "global order (RULES ID4)"
    )


def test_an_unknown_format_is_refused_with_the_run_formats():
    # RULES ID4: the format is the quant segment, from a closed set.
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.int4", "TORCH", 1))) == (
        "test.toml: impl #3 (cupy.mma.k.int4): quant 'int4' is not a run format; run formats: ['bf16', "
        "'fp8_block_scales', 'w4a16_mxfp4', 'w4a8_mxfp4_fp8', 'w4a8_mxfp4_mxfp8', 'w4a16_nvfp4', 'nvfp4']"
    )


def test_an_unknown_activation_is_refused_with_the_known_ones():
    # RULES ID4
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, activations='["gelu"]'))) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): unknown activation kinds ['gelu']; known: ['silu_glu', 'swiglu_oai', 'relu2']"
    )


def test_an_undeclared_backend_is_refused_with_the_declared_ones():
    # RULES ID4
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "CUPY", 1))) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): backend 'CUPY' is not declared; backends: ['TORCH', 'VANILLA']"
    )


@pytest.mark.parametrize("klass", ["runtime/experts:Fake", "runtime.experts.fake:fake", "Runtime.x:Fake", "runtime.experts.Fake"])
def test_a_class_path_not_of_the_form_module_colon_class_is_refused(klass):
    # RULES ID4
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, klass=klass))) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): class must read 'package.module:ClassName'"
    )


def test_a_flag_that_is_not_a_boolean_is_refused_rather_than_read_as_true():
    # RULES ID4: `cpu = "false"` once read as True through bool().
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, cpu='"false"'))) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): cpu must be true or false, not 'false'"
    )
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, dynamic_eplb="1"))) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): capabilities.dynamic_eplb must be true or false, not 1"
    )


def test_a_missing_key_is_named():
    # RULES ID4
    text = small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1).replace("cpu = false\n", ""))
    assert load_error(text) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): missing keys ['cpu']; an entry sets exactly ['backend', 'capabilities', "
        "'class', 'constraints', 'cpu', 'doc', 'id', 'priority', 'sms', 'verified_sms', 'weights']"
    )


def test_verified_sms_are_a_list_of_sms_the_entry_claims():
    # item 5 of issue 15: an implementation names where its tests passed, among the SMs it claims.
    entry = lambda **kw: small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, sms="[90, 100]", **kw))
    assert load_error(entry(verified_sms="[90, 120]")) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): verified_sms lists sm 120, which is not among sms [90, 100]"
    )
    for bad in ('"90"', "[true]", "[9.0]"):
        assert load_error(entry(verified_sms=bad)) == (
            "test.toml: impl #3 (cupy.mma.k.bf16): verified_sms must be a list of SM numbers such as [90] "
            "(the SMs its tests passed on)"
        )
    impl = load_registry_text(entry(verified_sms="[90]"), "test.toml").impl("cupy.mma.k.bf16")
    assert impl.verification(90) == "runs on sm_90: verified (tests passed there)"
    assert impl.verification(100) == "runs on sm_100: unverified (never run on that SM)"


def test_weights_name_where_dequantization_happens_and_bf16_alone_says_none():
    entry = lambda id, weights: small_registry_text(impl_toml(id, "TORCH", 1, weights=weights))
    assert load_error(entry("cupy.mma.k.bf16", '"somewhere"')) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): weights must be one of ['none', 'at_load', 'per_expert_group', "
        "'per_expert', 'in_kernel'], not 'somewhere'"
    )
    assert load_error(entry("cupy.mma.k.bf16", '["none"]')) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): weights must be one of ['none', 'at_load', 'per_expert_group', "
        "'per_expert', 'in_kernel'], not ['none']"
    )
    assert load_error(entry("cupy.mma.k.bf16", '"at_load"')) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): weights must be 'none' for a bf16 implementation (it holds no "
        "quantized weights)"
    )
    assert load_error(entry("cupy.mma.k.nvfp4", '"none"')) == (
        "test.toml: impl #3 (cupy.mma.k.nvfp4): weights 'none' is for bf16 implementations; say where its nvfp4 "
        "weights are dequantized: one of ['at_load', 'per_expert_group', 'per_expert', 'in_kernel']"
    )
    impl = load_registry_text(entry("cupy.mma.k.nvfp4", '"per_expert_group"'), "test.toml").impl("cupy.mma.k.nvfp4")
    assert impl.weights_text == "kept packed, dequantized per expert group in the forward"


def test_no_implementation_of_the_project_claims_a_gpu_it_has_not_run_on():
    # item 5 of issue 15: the project's GPU tests have run on sm_90 (H200) alone (BENCHMARKS.md, issue notes).
    registry = load_registry()
    assert {sm for impl in registry.impls for sm in impl.verified_sms} == {90}
    assert sorted(str(i.id) for i in registry.impls if i.verified_sms) == [
        "cupy.mma.grouped_gemm.bf16", "cupy.mma.grouped_gemm.fp8_block_scales", "cupy.mma.grouped_gemm.w4a16_mxfp4",
        "cupy.mma.grouped_gemm.w4a16_nvfp4", "cupy.mma.grouped_gemm.w4a8_mxfp4_fp8", "torch.eager.loop.bf16",
        "torch.grouped_mm.grouped_gemm.bf16", "torch.grouped_mm.grouped_gemm.fp8_block_scales",
        # the packed 4-bit forward: tests/gpu/test_packed_experts_memory.py and test_experts_torch_gpu.py on an H200
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4", "torch.grouped_mm.grouped_gemm.w4a16_nvfp4",
        # tests/gpu/test_triton_experts.py on an H200 (BENCHMARKS.md, 2026-12-01; MXFP4 2026-12-02)
        "triton.wgmma.grouped_gemm.bf16", "triton.wgmma.grouped_gemm.fp8_block_scales",
        "triton.wgmma.grouped_gemm.w4a16_mxfp4",
        # tests/gpu/test_triton_experts.py on an H100 (BENCHMARKS.md, 2026-12-07)
        "triton.wgmma.grouped_gemm.w4a16_nvfp4", "triton.wgmma.grouped_gemm.w4a8_mxfp4_fp8",
    ]
    packed = {str(i.id): i.weights for i in registry.impls if i.format in ("w4a16_mxfp4", "w4a16_nvfp4")}
    assert packed == {
        "cupy.mma.grouped_gemm.w4a16_mxfp4": "in_kernel", "cupy.mma.grouped_gemm.w4a16_nvfp4": "in_kernel",
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4": "per_expert_group",
        "torch.grouped_mm.grouped_gemm.w4a16_nvfp4": "per_expert_group",
        "torch.eager.loop.w4a16_mxfp4": "per_expert", "torch.eager.loop.w4a16_nvfp4": "per_expert",
        "triton.wgmma.grouped_gemm.w4a16_mxfp4": "in_kernel", "triton.wgmma.grouped_gemm.w4a16_nvfp4": "in_kernel",
    }


def test_a_value_of_the_wrong_type_is_a_registry_error_not_a_traceback():
    # RULES ID4
    text = small_registry_text(impl_toml("x", "TORCH", 1).replace('id = "x"', "id = 5"))
    assert load_error(text) == "test.toml: impl #3 (5): id must be a string"
    assert load_error(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, sms='"90"'))) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): sms must be a list of SM numbers such as [90, 100]"
    )


@pytest.mark.parametrize("name", ["Cupy", "AUTO", "9CUPY"])
def test_a_backend_name_is_an_upper_case_literal_other_than_auto(name):
    # RULES ID4
    backends = BACKENDS + f'\n[backends.{name}]\ndoc = "z"\n'
    assert load_error(small_registry_text(backends=backends)) == (
        f"test.toml: backend {name}: a backend name is an upper-case literal other than AUTO (RULES ID4)"
    )


@pytest.mark.parametrize(
    "backends",
    [
        '[backends.TORCH]\ndoc = "x"\n[backends.VANILLA]\ndoc = "y"\n',
        '[backends.TORCH]\ndoc = "x"\nfallback = true\n[backends.VANILLA]\ndoc = "y"\nfallback = true\n',
    ],
)
def test_exactly_one_backend_is_the_fallback(backends):
    # RULES ID4 (RQ1 needs one fallback backend)
    assert load_error(small_registry_text(backends=backends)) == "test.toml: exactly one backend must declare fallback = true"


def test_a_table_the_registry_does_not_hold_is_refused_by_name():
    # RULES ID4: the backends table was once called `families`; no old spelling is read as anything.
    old = small_registry_text().replace("[backends.", "[families.")
    assert load_error(old) == (
        "test.toml: unknown tables ['families']; a registry holds ['backends', 'impl', 'mxfp4_run_formats']"
    )
    entry = impl_toml("cupy.mma.k.bf16", "TORCH", 1).replace('backend = "TORCH"', 'family = "TORCH"')
    assert load_error(small_registry_text(entry)) == (
        "test.toml: impl #3 (cupy.mma.k.bf16): missing keys ['backend'], unknown keys ['family']; an entry sets exactly "
        "['backend', 'capabilities', 'class', 'constraints', 'cpu', 'doc', 'id', 'priority', 'sms', 'verified_sms', 'weights']"
    )


@pytest.mark.parametrize(
    "table, message",
    [
        ('sm90 = ["w4a16_mxfp4"]', "test.toml: mxfp4_run_formats key 'sm90' must be an SM number"),
        (
            '90 = ["bf16"]',
            "test.toml: mxfp4_run_formats.90 must list distinct MXFP4 run formats from ['w4a16_mxfp4', "
            "'w4a8_mxfp4_fp8', 'w4a8_mxfp4_mxfp8']",
        ),
        (
            '90 = ["w4a16_mxfp4", "w4a16_mxfp4"]',
            "test.toml: mxfp4_run_formats.90 must list distinct MXFP4 run formats from ['w4a16_mxfp4', "
            "'w4a8_mxfp4_fp8', 'w4a8_mxfp4_mxfp8']",
        ),
    ],
)
def test_the_fn2_preference_table_lists_distinct_mxfp4_run_formats_per_sm(table, message):
    # RULES ID4, FN2
    assert load_error(small_registry_text(mxfp4=table)) == message


def test_invalid_toml_is_a_registry_error():
    # RULES ID4
    assert load_error("[[impl]\n") == "test.toml: not valid TOML: Expected ']]' at the end of an array declaration (at line 1, column 7)"


def test_a_third_backend_loads_next_to_the_project_ones():
    # RULES ID4: a backend is named by its literal; new ones are data.
    registry = cupy_registry()
    assert registry.literals == (AUTO, "CUPY", "TORCH", "VANILLA")
    assert [str(i.id) for i in registry.impls[:3]] == [
        "cupy.mma.grouped_gemm.bf16",
        "cupy.mma.grouped_gemm.nvfp4",
        "cupy.mma.grouped_gemm.w4a8_mxfp4_mxfp8",
    ]
