"""The driver launch path of the CUPY kernels (runtime/kernels/driver.py) on a machine without a GPU: its
ctypes structures against cuda.h as the host C compiler lays them out, the packing of kernel arguments, a
launch with the driver call replaced by a recorder, and the kernels' side of programmatic dependent launch:
every kernel waits for its predecessor in the source and, where cuobjdump is (the GPU machine), in SASS."""
import ctypes
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

from runtime.kernels import SOURCE, driver
from runtime.kernels.build import compile_cubin, nvcc


@pytest.mark.skipif(nvcc() is None, reason="nvcc is not on PATH: install the CUDA toolkit (its cuda.h is the oracle)")
def test_the_ctypes_structures_lay_out_as_cuda_h(tmp_path):
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\n"
        "int main(void) {\n"
        '  printf("%zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes),\n'
        "         offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),\n"
        "         sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),\n"
        "         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
        "  return 0;\n}\n")
    exe = tmp_path / "layout"
    # nvcc compiles host C with cuda.h on its include path
    subprocess.run([nvcc(), str(src), "-o", str(exe)], check=True, capture_output=True)
    c_layout = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    config, attribute = driver._Config, driver._Attribute
    ours = [ctypes.sizeof(config), config.shared_mem.offset, config.stream.offset, config.attrs.offset,
            config.num_attrs.offset, ctypes.sizeof(attribute), attribute.value.offset,
            driver.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert ours == c_layout


def test_arguments_pack_with_c_alignment_and_point_at_their_bytes():
    rng = np.random.default_rng(7)
    args = (np.int32(rng.integers(-2**31, 2**31)), np.uint64(rng.integers(0, 2**63)), np.float32(rng.standard_normal()),
            np.int32(rng.integers(-2**31, 2**31)), np.int32(5), np.uint64(rng.integers(0, 2**63)))
    buffer, pointers = driver.pack(args)
    base = ctypes.addressof(buffer)
    # int32 at 0, uint64 padded to 8, float32 at 16, int32 at 20 and 24, uint64 padded to 32
    assert [p - base for p in pointers] == [0, 8, 16, 20, 24, 32]
    raw = bytes(buffer)
    for arg, offset in zip(args, [0, 8, 16, 20, 24, 32]):
        code = {np.int32: "i", np.uint64: "Q", np.float32: "f"}[type(arg)]
        assert struct.unpack_from("@" + code, raw, offset)[0] == arg


def test_a_launch_hands_the_driver_its_grid_stream_pdl_attribute_and_arguments(monkeypatch):
    """cuLaunchKernelEx replaced by a recorder: what launch() passes it, twice (the buffers are reused)."""
    seen = []

    def recorder(config, function, params, extra):
        config = config._obj   # the byref() handed to the driver
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        seen.append({"grid": list(config.grid), "block": list(config.block), "shared": config.shared_mem,
                     "stream": config.stream, "attrs": [(config.attrs[i].id, config.attrs[i].value.i32)
                                                        for i in range(config.num_attrs)],
                     "function": function, "extra": extra,
                     "args": (ctypes.c_int32.from_address(pointers[0]).value,
                              ctypes.c_uint64.from_address(pointers[1]).value,
                              ctypes.c_float.from_address(pointers[2]).value)})
        return 0

    monkeypatch.setattr(driver, "_LAUNCH", [recorder])
    rng = np.random.default_rng(11)
    calls = [((np.int64(rng.integers(1, 1000)), 3), (128,), (np.int32(rng.integers(-99, 99)),
              np.uint64(rng.integers(0, 2**63)), np.float32(rng.standard_normal())), 4096, 8 * 128),
             ((7,), (256, 2), (np.int32(5), np.uint64(1), np.float32(0.25)), 0, 0)]
    for grid, block, args, stream, shared in calls:
        driver.launch(0xABC, grid, block, args, stream, shared, "k")
    for (grid, block, args, stream, shared), got in zip(calls, seen):
        assert got == {"grid": [int(g) for g in grid] + [1] * (3 - len(grid)), "block": list(block) + [1] * (3 - len(block)),
                       "shared": shared, "stream": stream or None, "attrs": [(driver.PROGRAMMATIC_STREAM_SERIALIZATION, 1)],
                       "function": 0xABC, "extra": None, "args": (int(args[0]), int(args[1]), float(args[2]))}


def test_a_failed_launch_names_the_kernel_and_the_error(monkeypatch):
    monkeypatch.setattr(driver, "_LAUNCH", [lambda *a: 1])   # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError) as err:
        driver.launch(1, (2,), (128,), (np.int32(1),), 0, 0, "moe_combine")
    assert str(err.value) == "cuLaunchKernelEx of moe_combine (grid (2,), block (128,)) failed: CUDA error 1"


def test_a_python_int_argument_is_refused_by_name():
    with pytest.raises(TypeError) as err:
        driver.pack((np.int32(1), 3, 2.0))
    assert str(err.value) == "kernel arguments must be numpy uint64, int32 or float32 scalars, not int, float"


def _kernel_bodies(text: str) -> dict:
    """name -> body of every `extern "C" __global__` function written out in the source (the GEMM entry
    macros call moe_gemm_impl)."""
    bodies = {}
    for m in re.finditer(r'extern "C" __global__ void __launch_bounds__\([^)]*\)\s*(\w+)\(', text):
        start = text.index("{", m.end())
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        bodies[m.group(1)] = text[start:i]
    return bodies


def test_every_kernel_waits_for_its_predecessor_before_reading_its_inputs():
    text = SOURCE.read_text()
    bodies = _kernel_bodies(text)
    assert {"moe_align", "moe_align_count", "moe_align_scatter", "quant_fp8_rows", "gather_rows", "act_rows",
            "moe_combine", "moe_route"} <= set(bodies)
    for name, body in bodies.items():
        if "moe_gemm_impl<" in body:
            continue   # a GEMM entry point: the template's wait is checked below
        assert "wait_then_release();" in body, f"{name} does not wait for the previous kernel"
        # nothing but declarations of its own indices before the wait
        before = body[1:body.index("wait_then_release();")]
        assert not re.search(r"\[|->", before), (name, before)
    staged_start = text.index("// the staged decode GEMM")
    impl = text[text.index("__device__ __forceinline__ void moe_gemm_impl("):staged_start]
    impl = impl[:impl.rindex("// ----")]
    # GEMM1 waits before its item loop; GEMM2 issues its first weight loads, then waits, then loads the
    # activations GEMM1 wrote; a thread with no item waits before it exits
    loop = impl.index("for (int item = blockIdx.x;")
    assert "bool waited = EPI != EPI_DOWN;\n  if (waited) wait_then_release();" in impl[:loop]
    first = impl.index("load_weights(kc0, wA, sA);")
    assert loop < first < impl.index("wait_then_release();", first) < impl.index("load_acts(kc0, aA);")
    assert impl.rstrip().endswith("if (!waited) grid_dependency_wait();   // no item here: still never complete "
                                  "ahead of the previous kernel\n}")
    # the staged GEMM: every warp waits before it reads the tile count, the tiles or (through its copies) a row
    staged = text[text.index("__device__ __forceinline__ void moe_gemm_staged_impl("):text.index("#define MOE_GEMM_KERNEL(")]
    wait = staged.index("wait_then_release();")
    assert wait < staged.index("num_tiles[0]") < staged.index("for (int item = blockIdx.x;")
    assert not re.search(r"tile_expert\[|sorted_pair\[|offs\[|bulk_copy\(", staged[:wait])


@pytest.mark.skipif(nvcc() is None or shutil.which("cuobjdump") is None,
                    reason="needs nvcc and cuobjdump (the GPU machine has both; CI has no cuobjdump)")
def test_no_kernel_loads_a_previous_kernels_output_before_its_wait_in_sass(tmp_path):
    """ptxas may move read-only (.nc) loads above griddepcontrol.wait (ACQBULK in SASS): in every kernel as
    compiled for sm_90, nothing is loaded before it but, in GEMM2 (epilogue 2), its weights and scales, its
    tiles and the pairs' ids; never a 128-bit token row (which a GEMM2 with .nc activation loads showed)."""
    sass = subprocess.run(["cuobjdump", "-sass", str(compile_cubin(90, tmp_path))], check=True, capture_output=True,
                          text=True).stdout
    functions = re.split(r"Function : ", sass)[1:]
    assert len(functions) > 100
    for fn in functions:
        name = fn.split("\n", 1)[0].strip()
        lines = [line for line in fn.split("\n") if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
        wait = next((i for i, line in enumerate(lines) if "ACQBULK" in line), None)
        assert wait is not None, f"{name} has no griddepcontrol.wait"
        early = [line.split(";")[0].split("*/", 1)[1].strip() for line in lines[:wait] if re.search(r"\bLDG?\.", line)]
        if re.match(r"moe_gemm_\d_\d_2_", name):
            # the weights stream with L1::no_allocate (.NA); a 128-bit load without it is a token row
            assert not [ins for ins in early if ".128" in ins and ".NA." not in ins], (name, early)
        else:
            assert not early, (name, early)
