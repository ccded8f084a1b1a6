"""Router alone, torch's path vs the router kernels (`moe_route` up to 64 tokens, torch's logits and `moe_topk`
above), in CUDA-graph replays (device machine; not a test). For routers with fp32 logits (D), `cast_us` is the
kernels' path with the logits computed by casting both operands to fp32 first, as before `routing.fp32_logits`.

    python3 bench/router.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtime import routing  # noqa: E402
from runtime.kernels import router as router_kernel  # noqa: E402
from runtime.routing import LinearTopKSoftmaxRouter, SigmoidTopKRouter, SoftmaxTopKRouter  # noqa: E402

SHAPES = {
    "Q": lambda: SoftmaxTopKRouter(hidden_size=2048, num_experts=128, top_k=8, norm_topk_prob=True, dtype=torch.bfloat16),
    "G": lambda: LinearTopKSoftmaxRouter(hidden_size=2880, num_experts=128, top_k=4, dtype=torch.bfloat16),
    "D": lambda: SigmoidTopKRouter(hidden_size=7168, num_experts=256, top_k=8, n_group=8, topk_group=4,
                                   routed_scaling_factor=2.5, dtype=torch.bfloat16),
}


def graph_us(fn, replays: int = 200) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    rows = []
    for shape, make in SHAPES.items():
        router = make().cuda()
        with torch.no_grad():
            for p in router.parameters():
                p.normal_(0, 0.05)
            for tokens in (1, 8, 64, 256, 2048, 8192):
                x = torch.randn(tokens, router.weight.shape[1], device="cuda", dtype=torch.bfloat16)
                fused = graph_us(lambda: router(x))
                saved = router_kernel.applies, router_kernel.topk_applies
                router_kernel.applies = router_kernel.topk_applies = lambda *a, **k: False
                try:
                    plain = graph_us(lambda: router(x))
                finally:
                    router_kernel.applies, router_kernel.topk_applies = saved
                rows.append({"shape": shape, "tokens": tokens, "torch_us": round(plain, 2), "kernel_us": round(fused, 2)})
                if getattr(router, "fp32_gemm", False):
                    saved = routing.fp32_logits
                    routing.fp32_logits = lambda h, w: F.linear(h.float(), w.float())
                    try:
                        rows[-1]["cast_us"] = round(graph_us(lambda: router(x)), 2)
                    finally:
                        routing.fp32_logits = saved
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
