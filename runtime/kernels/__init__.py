"""CUDA kernels of the CUPY backend's experts, compiled on first use for the GPU that runs them.

cupy is imported only inside `load` and `launch`, so the runtime (and every class that uses these
kernels) imports and constructs on machines without it. A module is compiled through CuPy's NVRTC
backend (CuPy caches the binary on disk), or, when `MOEGEN_CUBIN_DIR` holds a cubin built from the
very same source for this SM (`python -m runtime.kernels.build`), loaded from there without
compiling. Launches go to torch's current stream through the driver (driver.py: programmatic dependent
launch, so each kernel's start overlaps its predecessor's end), take raw device pointers (zero copy),
allocate nothing and never synchronize, so they are captured by CUDA graphs like torch's own kernels.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from . import driver

SOURCE = Path(__file__).with_name("moe_kernels.cu")
SOURCES = (SOURCE,)
NVRTC_OPTIONS = ("-std=c++17",)

# Weight formats (WF_*), activation quantization (AQ_*) and GEMM epilogues (EPI_*) of moe_kernels.cu.
WF = {"bf16": 0, "fp8_block_scales": 1, "w4a16_mxfp4": 2, "w4a8_mxfp4_fp8": 2, "w4a16_nvfp4": 3}
AQ = {"bf16": 0, "fp8_block_scales": 1, "w4a16_mxfp4": 0, "w4a8_mxfp4_fp8": 2, "w4a16_nvfp4": 0}
EPI_GATED, EPI_RELU2, EPI_DOWN = 0, 1, 2
# Warp tiles (m-tiles of 16 weight rows, n-fragments of 8 tokens), smallest first: the token tile
# of a CTA is 8 * NT rows of one expert. Small tiles stream weights for decode batches; the last one
# reuses each (dequantized) weight fragment over many tokens for prefill. The prefill tiles are the
# fastest of a sweep on an H200 (bench/moe_layer.py --sweep, Q and D shapes at 2048 tokens,
# 2026-11-30; BENCHMARKS.md): FP8 formats keep a second accumulator set for the block scales and
# spill beyond (2, 4).
TILES = {
    "bf16": ((1, 1), (1, 2), (2, 4), (1, 8)),
    "fp8_block_scales": ((1, 1), (1, 2), (2, 4)),
    "w4a16_mxfp4": ((1, 1), (1, 2), (2, 4), (4, 4)),
    "w4a16_nvfp4": ((1, 1), (1, 2), (2, 4), (2, 8)),
    "w4a8_mxfp4_fp8": ((1, 1), (1, 2), (2, 4), (4, 4)),
}
# Split-K factors (the GEMM's SK: warps of a CTA sharing an m-tile group, each on 1/SK of K) of the decode
# tile, in every format, for calls whose items leave SMs idle (cupy_mma.py: _split). Timed per format at
# the Q and G decode cells (BENCHMARKS.md, "4-bit decode GEMMs" and "Split K for every format", eleventh
# session).
SPLITS = (2, 4)
SPLIT_TILE = (1, 1)
# Further tiles the sweep times (compiled only when asked for: `extra_tiles`).
EXTRA_TILES = ((1, 4), (1, 8), (2, 8), (4, 4))
# The staged decode GEMM (moe_gemm_staged_impl: a producer warp bulk-copies weights, scales and token rows into
# a ring of shared-memory stages ahead of four consumer warps) of the W4A16 formats: its configurations
# (NT, KC, ST), the (1, NT) tile with KC 64-chunks of K a stage and ST stages, and its threads.
# 8 chunks and 2 stages (4 CTAs an SM) were the fastest of (KC, ST) = (2, 8), (4, 3), (4, 4), (8, 2), (8, 3), (12, 2),
# (16, 2) at the gpt-oss and Qwen3 decode cells (BENCHMARKS.md, fifteenth session); (4, 4) stays compiled for the
# tests of a ring of more stages.
STAGED = {fmt: ((1, 8, 2), (2, 8, 2), (1, 4, 4)) for fmt in ("w4a16_mxfp4", "w4a16_nvfp4")}
STAGED_THREADS = 160
# Block-scale bytes of one weight row per 64-element chunk of K (moe_kernels.cu ScaleBytes), by weight format: NVFP4
# one E4M3 per 16 elements, MXFP4 one E8M0 per 32; the scales are tiled by 16 rows x one chunk (layouts.tile_rows).
SCALE_BYTES = {WF["w4a16_mxfp4"]: 2, WF["w4a16_nvfp4"]: 4}
# What the W4A16 classes' `plan` stages: the decode tiles, 8 chunks a stage and 2 stages for both GEMMs (the layer under
# CUDA graphs 15-30 % faster than on the register GEMM at the gpt-oss and Qwen3 cells of 8-256 tokens that plan these
# tiles, BENCHMARKS.md, fifteenth session).
W4A16_STAGED_PLAN = {(1, 1): ((8, 2), (8, 2)), (1, 2): ((8, 2), (8, 2))}


def tiles(fmt: str) -> tuple[tuple[int, int], ...]:
    return TILES[fmt]


def splits(tile) -> tuple[int, ...]:
    """The split-K factors compiled for `tile` (ascending; empty: none)."""
    return SPLITS if tuple(tile[:2]) == SPLIT_TILE else ()


def staged_smem(wf: int, nt: int, kc: int, st: int) -> int:
    """Dynamic shared memory of a staged GEMM of weight format `wf` (a WF value; moe_kernels.cu `Stage`): ST
    stages of 4 m-tiles' weights (512 bytes a chunk) and scales, and 8 * NT token rows of KC * 128 bytes
    padded by 16; then 2 ST barriers of 8 bytes (the kernel stops itself when launched with less)."""
    stage = 4 * kc * 512 + 4 * kc * 16 * SCALE_BYTES[wf] + 8 * nt * (kc * 128 + 16)
    return st * stage + 2 * st * 8


def staged_pair(fmt: str, tile, staging, planned):
    """(GEMM1's, GEMM2's) (KC, ST) of the staged GEMMs of `tile` of `fmt` (None where that GEMM runs the register
    kernel): `staging` for both, else `planned` (the class's STAGED_PLAN entry), else the first compiled for the
    tile's NT for both; None when one of them is not compiled."""
    configs = [(kc, st) for nt, kc, st in STAGED.get(fmt, ()) if (1, nt) == tuple(tile)]
    pair = (tuple(staging),) * 2 if staging is not None else planned
    if pair is None:
        return (configs[0], configs[0]) if configs else None
    if all(s is None or tuple(s) in configs for s in pair):
        return tuple(None if s is None else tuple(s) for s in pair)
    return None


def gemm_name(fmt: str, epi: int, tile, pairs: bool = False, staging=None) -> str:
    """Kernel name of a warp tile (MT, NT) or (MT, NT, SK); SK = 1 is the plain kernel. `pairs`: the
    pair-tile kernel (no sort: cupy_plan.CupyPlan._pairs_pay) of the split-K tile (1, 1[, SK]). `staging`
    (KC, ST): the staged kernel of the (1, NT) tile."""
    if staging is not None:
        return f"moe_gemm_{WF[fmt]}_{AQ[fmt]}_{epi}_{tile[0]}_{tile[1]}_s{staging[0]}x{staging[1]}"
    if pairs:
        return f"moe_gemm_{WF[fmt]}_{AQ[fmt]}_{epi}_1_1_{tile[2] if len(tile) > 2 else 1}_pairs"
    split = f"_{tile[2]}" if len(tile) > 2 and tile[2] > 1 else ""
    return f"moe_gemm_{WF[fmt]}_{AQ[fmt]}_{epi}_{tile[0]}_{tile[1]}{split}"


def gemm_instances(fmt: str, epis=(EPI_GATED, EPI_RELU2, EPI_DOWN), extra_tiles=()) -> tuple[tuple, ...]:
    """(WF, AQ, EPI, MT, NT[, SK]) of every tile of `fmt` for `epis`, then the pair-tile kernels,
    (WF, AQ, EPI, 1, 1, SK, "pairs") for SK = 1 and the split-K factors of the (1, 1) tile."""
    all_tiles = tiles(fmt) + tuple(t for t in extra_tiles if t not in tiles(fmt))
    all_tiles += tuple((*t, sk) for t in tiles(fmt) for sk in splits(t))
    pair_splits = (1,) + SPLITS
    return (tuple((WF[fmt], AQ[fmt], epi, *tile) for epi in epis for tile in all_tiles)
            + tuple((WF[fmt], AQ[fmt], epi, 1, 1, sk, "pairs") for epi in epis for sk in pair_splits)
            + tuple((WF[fmt], AQ[fmt], epi, 1, nt, f"s{kc}x{st}") for epi in epis
                    for nt, kc, st in STAGED.get(fmt, ())))


def all_instances() -> tuple[tuple[int, ...], ...]:
    """Every GEMM variant any CUPY class can ask for (what CI compiles and cubins hold)."""
    seen = []
    for fmt in WF:
        for inst in gemm_instances(fmt, extra_tiles=EXTRA_TILES):
            if inst not in seen:
                seen.append(inst)
    return tuple(seen)


def _staging_of(inst) -> tuple[int, int] | None:
    """(KC, ST) of a staged GEMM instance (WF, AQ, EPI, 1, NT, "s<KC>x<ST>"); None for the other kernels."""
    last = inst[-1]
    return tuple(map(int, last[1:].split("x"))) if isinstance(last, str) and last.startswith("s") else None


def _instance_line(inst) -> str:
    if inst[-1] == "pairs":
        wf, aq, epi, _, _, sk, _ = inst
        return f"MOE_GEMM_INSTANCE_PAIRS({wf}, {aq}, {epi}, {sk})\n"
    staging = _staging_of(inst)
    if staging is not None:
        return f"MOE_GEMM_INSTANCE_STAGED({inst[0]}, {inst[2]}, {inst[4]}, {staging[0]}, {staging[1]})\n"
    return f"MOE_GEMM_INSTANCE{'_SPLIT' if len(inst) > 5 else ''}({', '.join(map(str, inst))})\n"


def source_text(instances) -> str:
    lines = "".join(_instance_line(inst) for inst in instances)
    return SOURCE.read_text() + "\n// ---- instances ----\n" + lines


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cubin_name(sm: int) -> str:
    return f"moe_kernels.{source_hash(source_text(all_instances()))}.sm_{sm}.cubin"


_MODULES: dict = {}


class Kernels:
    """The compiled kernels of one module on one device."""

    def __init__(self, module, device_index: int, sm_count: int):
        self._module = module
        self._fns: dict = {}
        self._ptrs: dict = {}
        self._resident: dict = {}   # (name, threads, dynamic shared memory) -> CTAs an SM holds
        self.device_index = device_index
        self.sm_count = sm_count

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self._module.get_function(name)
        return f

    def ptr(self, name: str) -> int:
        """The CUfunction handle of kernel `name`."""
        ptr = self._ptrs.get(name)
        if ptr is None:
            ptr = self._ptrs[name] = self.fn(name).kernel.ptr
        return ptr

    def persistent_grid(self, name: str, items: int, threads: int = 128, shared_mem: int = 0) -> int:
        """CTAs for a grid-stride kernel: all resident at once (no tail), never more than the items. The driver's
        occupancy answer is asked once per kernel and launch shape (every call launches with this grid)."""
        key = (name, threads, shared_mem)
        per_sm = self._resident.get(key)
        if per_sm is None:
            import cupy

            with cupy.cuda.Device(self.device_index):
                per_sm = self._resident[key] = max(1, driver.resident_blocks(self.ptr(name), threads, shared_mem))
        return max(1, min(items, per_sm * self.sm_count))

    def launch(self, name: str, grid, block, args, stream_ptr: int, shared_mem: int = 0) -> None:
        """Launch on the CUDA stream `stream_ptr` (torch's current one), with programmatic dependent launch
        (driver.py): no sync, no allocation."""
        import cupy

        with cupy.cuda.Device(self.device_index):
            driver.launch(self.ptr(name), grid, block, tuple(args), stream_ptr, shared_mem, name)


def load(instances, device) -> Kernels:
    """The kernels module holding the helper kernels and `instances`, for torch `device` (cached)."""
    import torch

    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    key = (index, tuple(instances))
    kernels = _MODULES.get(key)
    if kernels is not None:
        return kernels
    import cupy

    major, minor = torch.cuda.get_device_capability(index)
    sm = major * 10 + minor
    props = torch.cuda.get_device_properties(index)
    with cupy.cuda.Device(index):
        cubin_dir = os.environ.get("MOEGEN_CUBIN_DIR")
        cubin = Path(cubin_dir) / cubin_name(sm) if cubin_dir else None
        if cubin is not None and cubin.is_file():
            module = cupy.RawModule(path=str(cubin))
        else:
            module = cupy.RawModule(code=source_text(instances), options=NVRTC_OPTIONS)
        kernels = Kernels(module, index, props.multi_processor_count)
        for inst in instances:      # compile (or load) now, never during a CUDA-graph capture
            name = "moe_gemm_" + "_".join(map(str, inst))
            kernels.fn(name)
            staging = _staging_of(inst)
            if staging is not None:   # its ring of stages, above the 48 KB a launch gets unasked
                driver.allow_dynamic_shared(kernels.ptr(name), staged_smem(inst[0], inst[4], *staging))
        for helper in ("moe_align", "moe_align_count", "moe_align_scatter", "quant_fp8_rows", "gather_rows", "act_rows",
                       "moe_combine", "moe_route", "moe_topk"):
            kernels.fn(helper)
    _MODULES[key] = kernels
    return kernels
