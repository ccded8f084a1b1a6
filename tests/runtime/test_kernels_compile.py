"""The CUPY kernels on a machine without a GPU: every `.cu` source compiles with the host's nvcc for
every SM its registry entries declare (all GEMM variants instantiated), the router's limits in
router.py are the sizes of the kernel's arrays, the kernels' cross-launch counters are never made inside
a CUDA-graph capture, and every CUPY class imports and constructs on the meta device with cupy absent."""
import subprocess
import sys

import pytest
import torch

from registry.impls import load_registry
from runtime.kernels import SOURCE, SOURCES
from runtime.kernels import router
from runtime.kernels.build import compile_cubin, nvcc


def _cupy_sms():
    return sorted({sm for impl in load_registry().impls if impl.backend == "CUPY" for sm in impl.sms})


def test_every_kernel_source_is_built_by_the_loader():
    assert SOURCES and all(path.suffix == ".cu" and path.is_file() for path in SOURCES)
    kernel_dir = SOURCES[0].parent
    assert set(kernel_dir.glob("*.cu")) == set(SOURCES), "a .cu file that runtime.kernels never compiles"


@pytest.mark.skipif(nvcc() is None, reason="nvcc is not on PATH: install the CUDA toolkit to compile the CUPY kernels")
@pytest.mark.parametrize("sm", _cupy_sms())
def test_kernels_compile_with_nvcc_for_every_declared_sm(sm, tmp_path):
    cubin = compile_cubin(sm, tmp_path)
    assert cubin.stat().st_size > 0


def test_router_limits_are_the_kernel_array_sizes():
    # router.py's `applies` refuses a call beyond these; the kernel's shared arrays hold exactly them
    text = SOURCE.read_text()
    assert f"#define ROUTE_MAX_K {router.MAX_K}\n" in text
    assert f"#define ROUTE_MAX_GROUPS {router.MAX_GROUPS} " in text


def test_kernel_counters_are_refused_inside_a_graph_capture(monkeypatch):
    # the capture would record their zero fill, not run it: later launches would start from stale memory
    from runtime.experts.base import MoeShape
    from runtime.experts.cupy_mma import CupyMmaBf16Experts

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(router, "_COUNTERS", {})
    module = CupyMmaBf16Experts(MoeShape(64, 64, 4, 2, "silu_glu"), device="meta")
    for make, owner in ((lambda: router._counters(torch.device("cuda", 0)), "the router kernel"),
                        (lambda: module._align_ticket(torch.device("cuda", 0)), "CupyMmaBf16Experts's moe_align_count")):
        with pytest.raises(RuntimeError) as err:
            make()
        assert str(err.value) == (f"{owner} makes its counters at its first call, and that call is inside a "
                                  "CUDA-graph capture: call it once before capturing (as runtime.graphs.capture's "
                                  "warm-up does)")
    assert not router._COUNTERS and not module._align_tickets
    assert router._counters(torch.device("cpu")).tolist() == [0] * router.MAX_TOKENS   # a device that never captures
    assert module._align_ticket(torch.device("cpu")).tolist() == [0]
    # what tests/gpu/conftest.py checks after every GPU test: both sets, while they live
    from runtime.graphs import live_kernel_counters

    owners = [owner for owner, _ in live_kernel_counters()]
    assert "the router kernel" in owners and "CupyMmaBf16Experts's moe_align_count" in owners


def test_cupy_classes_construct_on_meta_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"       # any `import cupy` now raises ImportError
        "from registry.impls import load_registry\n"
        "from runtime.build import load_class\n"
        "from runtime.experts.base import ExpertParallel, MoeShape\n"
        "classes = [load_class(i.class_path) for i in load_registry().impls if i.backend == 'CUPY']\n"
        "assert classes and all(c.IMPL_ID.startswith('cupy.') for c in classes), classes\n"
        "for cls in classes:\n"
        "    for act in ('silu_glu', 'swiglu_oai', 'relu2'):\n"
        "        spec = MoeShape(7168, 2048, 256, 8, act, expert_bias=act == 'swiglu_oai')\n"
        "        m = cls(spec, ExpertParallel(moe_tp_size=2, moe_tp_rank=1, ep_size=4, ep_rank=3), device='meta')\n"
        "        assert all(b.device.type == 'meta' for b in m.buffers())\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
