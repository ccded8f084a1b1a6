"""Times the Triton FP8 block-scaled linear against bf16 F.linear (cuBLAS) at deepseek_v3's shapes, with a config sweep.

`python3 bench/fp8_linear.py [--out FILE.json]` on a GPU. Each timing is a CUDA graph of 20 calls
(no host overhead), median of 7 replays, per call. Reported: µs, TB/s of the bytes a call must move
(weight + its scales, activations in, output out) and TFLOP/s; `plan` is runtime/kernels/
triton_fp8_linear.plan's pick, the other rows the sweep's (each checked against the plan's output).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtime.formats import fp8  # noqa: E402
from runtime.kernels import triton_fp8_linear as L  # noqa: E402

SHAPES = [(7168, 18432), (18432, 7168), (7168, 1536), (7168, 576), (1536, 24576), (16384, 7168)]
ROWS = (1, 32, 2048)


def _time(fn, calls: int = 20, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _sweep(m: int, n: int, k: int, sms: int):
    if m > L.DECODE_MAX_ROWS:
        for bm, bn, warps, stages in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 128, 4, 4),
                                      (128, 128, 4, 4)):
            yield bm, bn, warps, stages, 8, 1
        return
    bm = 16 if m <= 16 else 32
    kb = -(-k // 128)
    for bn in (64, 128):
        tiles = -(-m // bm) * -(-n // bn)
        for stages in (4, 6):
            for waves in (1, 2, 4):
                yield bm, bn, 4, stages, 0, max(1, min(kb, -(-waves * sms // tiles)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(k + n)
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
        codes, scale = fp8.quantize_weight_blocks(w)
        wb = fp8.dequantize_weight_blocks(codes, scale, torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            must = n * k + scale.numel() * 4 + m * k * 2 + m * n * 2
            flop = 2 * m * n * k
            t_bf16 = _time(lambda: F.linear(x, wb))
            planned = L.plan(m, n, k, sms)
            y_plan = L.fp8_block_linear(x, codes, scale)
            results = []
            for cfg in [planned] + [c for c in _sweep(m, n, k, sms) if c != planned]:
                try:
                    y = L.fp8_block_linear(x, codes, scale, cfg)
                    err = float((y.float() - y_plan.float()).norm() / y_plan.float().norm())
                    t = _time(lambda: L.fp8_block_linear(x, codes, scale, cfg))
                except Exception as e:  # a config that does not compile or fit: reported, not fatal
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                results.append((t, cfg, err))
            t_plan = results[0][0]
            best = min(results)
            row = dict(k=k, n=n, m=m, bf16_us=t_bf16, plan=list(planned), plan_us=t_plan, best=list(best[1]),
                       best_us=best[0], max_err_vs_plan=max(r[2] for r in results),
                       plan_tbs=must / t_plan / 1e6, plan_tflops=flop / t_plan / 1e6,
                       bf16_tbs=(must + n * k) / t_bf16 / 1e6, bf16_tflops=flop / t_bf16 / 1e6)
            rows.append(row)
            print(f"{k:>6}->{n:<6} M={m:<5} bf16 {t_bf16:8.1f} us ({row['bf16_tbs']:.2f} TB/s, {row['bf16_tflops']:6.1f} TF/s)"
                  f" | fp8 plan {t_plan:8.1f} us ({row['plan_tbs']:.2f} TB/s, {row['plan_tflops']:6.1f} TF/s) {planned}"
                  f" | best {best[0]:8.1f} us {best[1]} | err<= {row['max_err_vs_plan']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
