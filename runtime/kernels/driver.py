"""Kernel launches through the CUDA driver's `cuLaunchKernelEx` (ctypes) with programmatic dependent launch on.

CuPy's launcher takes no launch attributes, and the one this module sets,
`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, lets a kernel start while the previous kernel of
the stream is still running, once every CTA of that kernel has executed `griddepcontrol.launch_dependents`.
The kernels of moe_kernels.cu are written for it: each waits (`griddepcontrol.wait`) before it reads what
an earlier kernel wrote, so starting early overlaps with the previous kernel's tail only its launch and
what comes before its wait (GEMM2's first weight loads). A CUDA-graph capture
records the overlap as a programmatic edge, so a replayed decode step gets it too. The arguments are the
numpy scalars the callers pass (pointers as uint64, int32, float32), packed with C alignment as the kernel's
parameters.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID, cuda.h
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8       # CUfunction_attribute, cuda.h
_CODES = {np.uint64: "Q", np.int32: "i", np.float32: "f"}


class _AttributeValue(ctypes.Union):
    # CUlaunchAttributeValue: 64 bytes, pointer-aligned
    _fields_ = [("pad", ctypes.c_char * 64), ("pointer", ctypes.c_void_p), ("i32", ctypes.c_int)]


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_ATTRIBUTE = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
_ATTRIBUTE.value.i32 = 1
_LAYOUTS: dict = {}
_LIBCUDA: list = []   # libcuda, loaded on first use
_LAUNCH: list = []    # its cuLaunchKernelEx, typed


class _Reused(threading.local):
    """Per thread (the driver call releases the GIL): one launch configuration and, per argument types, one
    parameter buffer with its pointer array, rewritten at each launch. The driver copies the parameters when
    it launches or captures, so they may change once the call returns; allocating them per launch cost
    about half of the launch's host time."""

    def __init__(self):
        self.config = _Config(attrs=ctypes.pointer(_ATTRIBUTE), num_attrs=1)
        self.config_ref = ctypes.byref(self.config)
        self.params: dict = {}


_REUSED = _Reused()


def _layout(types: tuple) -> tuple:
    """(struct packer, byte offset of each parameter, pointer-array type) for kernel parameters of `types`."""
    layout = _LAYOUTS.get(types)
    if layout is None:
        unknown = [t.__name__ for t in types if t not in _CODES]
        if unknown:
            raise TypeError(f"kernel arguments must be numpy uint64, int32 or float32 scalars, not {', '.join(unknown)}")
        offsets, end = [], 0
        for t in types:
            size = struct.calcsize(_CODES[t])
            end = -(-end // size) * size   # C alignment: each scalar at a multiple of its size
            offsets.append(end)
            end += size
        packer = struct.Struct("@" + "".join(_CODES[t] for t in types))
        layout = _LAYOUTS[types] = (packer, tuple(offsets), ctypes.c_void_p * max(1, len(types)))
    return layout


def pack(args: tuple) -> tuple[ctypes.Array, ctypes.Array]:
    """(the parameter bytes, the array of pointers to each parameter) that cuLaunchKernelEx reads: this
    thread's buffers for these argument types, valid until its next launch with the same types."""
    types = tuple(map(type, args))
    held = _REUSED.params.get(types)
    if held is None:
        packer, offsets, pointers = _layout(types)
        buffer = ctypes.create_string_buffer(max(1, packer.size))
        base = ctypes.addressof(buffer)
        held = _REUSED.params[types] = (packer, buffer, pointers(*(base + o for o in offsets)))
    held[0].pack_into(held[1], 0, *args)
    return held[1], held[2]


def _libcuda():
    if not _LIBCUDA:
        _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
    return _LIBCUDA[0]


def _launch_fn():
    if not _LAUNCH:
        fn = _libcuda().cuLaunchKernelEx
        fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _LAUNCH.append(fn)
    return _LAUNCH[0]


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed: CUDA error {status}")


def allow_dynamic_shared(function_ptr: int, nbytes: int) -> None:
    """Let the CUfunction `function_ptr` launch with `nbytes` of dynamic shared memory (above 48 KB it must be
    asked for)."""
    _check(_libcuda().cuFuncSetAttribute(ctypes.c_void_p(function_ptr), MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         ctypes.c_int(nbytes)), f"cuFuncSetAttribute (dynamic shared memory {nbytes})")


def resident_blocks(function_ptr: int, threads: int, shared_mem: int) -> int:
    """CTAs of `threads` threads and `shared_mem` bytes of dynamic shared memory that one SM holds at once
    (the driver's occupancy calculator: registers, shared memory, warps)."""
    blocks = ctypes.c_int()
    _check(_libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(function_ptr), ctypes.c_int(threads), ctypes.c_size_t(shared_mem)),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return blocks.value


def launch(function_ptr: int, grid, block, args: tuple, stream_ptr: int, shared_mem: int, name: str) -> None:
    """Launch the CUfunction `function_ptr` on stream `stream_ptr` (of the current context) with PDL on."""
    config = _REUSED.config
    config.grid[:] = (*grid, 1, 1)[:3]
    config.block[:] = (*block, 1, 1)[:3]
    config.shared_mem = shared_mem
    config.stream = stream_ptr
    status = _launch_fn()(_REUSED.config_ref, function_ptr, pack(args)[1], None)
    _check(status, f"cuLaunchKernelEx of {name} (grid {tuple(grid)}, block {tuple(block)})")
