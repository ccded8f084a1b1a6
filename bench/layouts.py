"""Parallel layouts of a build on N GPUs against the same build on one (issue 16): prefill and CUDA-graph decode
steps, their logits against the one-GPU run's, and the collectives' share of a step (device machine; a script,
not a test).

    python3 bench/layouts.py [--model qwen3_30b_a3b] [--layers 4] [--layouts tp2,tp2_moetp1ep2,dep2] [--out DIR]

Scope as bench/build.py's, whose checkpoint writer and loader it uses: real shapes and vocabulary, the first
`--layers` decoder layers, loaded by `generated.load_model` (mode auto: the specialized build where the layout
is declared, else the generic one; the report names it). Every run gets the same token rows. A layout with
attention data parallelism splits the rows between its replicas, so every batch is a multiple of the replicas
(dep2: 2, 8 and 32 rows), and every run prefills the same 2048-token rows, as many as the largest data-parallel
layout has replicas (one a replica there; a batch of them elsewhere). Decode: one step with 1024 tokens cached, the `runtime.decoding.Decoder` step
replayed (its CUDA graph; on a CPU, a smoke run, its eager step). Logits: the replicas' rows gathered on rank 0
against the one-GPU run's (relative error, top-1; prefill over its last 64 positions). Collectives: NCCL
kernels' share of the largest batch's step (torch.profiler on rank 0).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import build  # noqa: E402  (bench/build.py)

KEPT_POSITIONS = 64   # prefill logits compared over the last positions (all 2048 x vocab would be GBs)


def _ms(fn, reps: int, device: torch.device) -> float:
    if device.type == "cuda":
        return build.events_ms(fn, reps)
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / reps


def batches_for(dp: int, batches) -> list[int]:
    """Each batch rounded up to a multiple of the data-parallel replicas."""
    return [-(-b // dp) * dp for b in batches]


def time_layout(rank: int, world: int, device: str, spec: dict) -> dict | None:
    """One rank's part (or the whole one-GPU run, rank 0 of 1): load, prefill, decode steps, profile."""
    from runtime import parallel
    from runtime.decoding import Decoder

    dev = torch.device(device)
    model = build.load_build(spec["model"], spec["sm"], spec["layers"], Path(spec["folder"]), "auto", device=device,
                             parallel=spec["parallel"], rank=rank)
    layout = model.layout
    ids = spec["ids"].to(dev)
    mine = lambda rows: rows.chunk(layout.dp)[layout.dp_rank(rank)]   # noqa: E731
    gather = lambda t: parallel.all_gather(t.contiguous(), dim=0, group=parallel.DP)   # noqa: E731
    out = {"parallel": spec["parallel"], "build": type(model).__module__,
           "layout": [layout.tp, layout.moe_tp, layout.ep, layout.dp]}
    prompt = mine(ids[:spec["prefill_rows"], :spec["prefill"]])
    with torch.no_grad():
        out["prefill_logits"] = gather(model(prompt)[:, -KEPT_POSITIONS:]).float().cpu()
        out["prefill_ms"] = _ms(lambda: model(prompt), spec["reps"], dev)
    cached = spec["cached"]
    for batch in spec["batches"]:
        rows = mine(ids[:batch, :cached + 1])
        decoder = Decoder(model, rows.shape[0], cached + 64)
        decoder.prefill(rows[:, :cached])
        out[f"decode_b{batch}_logits"] = gather(decoder.step(rows[:, cached]).clone()).float().cpu()

        def step():
            decoder.position.fill_(cached)
            if decoder.graph is not None:
                decoder.graph.replay()
            else:
                decoder.step(rows[:, cached])

        out[f"decode_b{batch}_ms"] = _ms(step, spec["reps"], dev)
        if dev.type == "cuda" and batch == spec["batches"][-1]:
            kernels = build.kernel_times(step)
            out[f"decode_b{batch}_nccl_share"] = kernels["nccl_us"] / kernels["total_us"]
            out[f"decode_b{batch}_kernels"] = kernels
        del decoder
    return out if rank == 0 else None


def compare(run: dict, one: dict) -> dict:
    """`run`'s logits against the one-GPU run's, then its timings as they are (logits dropped)."""
    row = {k: v for k, v in run.items() if not k.endswith("_logits")}
    for key in [k for k in run if k.endswith("_logits")]:
        row[key.removesuffix("_logits") + "_parity"] = build.parity(run[key], one[key])
    return row


def run_layouts(model: str, sm: int, layers: int, layouts, folder: Path, device: str, *, prefill: int = build.PREFILL,
                cached: int = build.CACHED, batches=build.BATCHES, reps: int = 20, seed: int = 1) -> list[dict]:
    """The one-device run, then each layout on its world of ranks; rows with parity against the first."""
    from contract import parse_layout
    from runtime.processes import launch

    vocab = importlib.import_module(f"generated.{model}.facts").CONFIG["vocab_size"]
    parsed = {p: parse_layout(p) for p in layouts}
    # The one-device run decodes every batch some layout decodes (each rounded up to that layout's replicas).
    sizes = sorted({b for lay in parsed.values() for b in batches_for(lay.dp, batches)} or batches)
    ids = torch.randint(0, vocab, (max(sizes), max(prefill, cached + 1)), generator=torch.Generator().manual_seed(seed))
    base = dict(model=model, sm=sm, layers=layers, folder=str(folder), ids=ids, prefill=prefill, cached=cached, reps=reps,
                prefill_rows=max((lay.dp for lay in parsed.values()), default=1))
    one = time_layout(0, 1, device, {**base, "parallel": "tp1", "batches": sizes})
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()   # rank 0 of every layout shares this GPU
    rows = [compare(one, one)]
    for p in layouts:
        spec = {**base, "parallel": p, "batches": batches_for(parsed[p].dp, batches)}
        try:
            ranks = launch(time_layout, parsed[p].world, (spec,), device=device, timeout_s=120, job_timeout_s=1200)
        except Exception:  # noqa: BLE001 - a layout that fails is reported, the others still run
            rows.append({"parallel": p, "error": traceback.format_exc()})
            continue
        rows.append(compare(ranks[0], one))
    return rows


def markdown(rows: list[dict]) -> str:
    keys = sorted({k for r in rows for k in r if k.startswith("decode_b") and k.endswith("_ms")},
                  key=lambda k: int(k[len("decode_b"):-len("_ms")]))
    lines = ["| layout | build | prefill ms (rel) | " + " | ".join(k[len("decode_"):-len("_ms")] + " ms (rel)" for k in keys)
             + " | NCCL share of the last step |", "|" + "---|" * (len(keys) + 4)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['parallel']} | failed: {r['error'].strip().splitlines()[-1]} |")
            continue
        cells = [f"{r[k]:.3f} ({r[k[:-3] + '_parity']['rel_err']:.3g})" if k in r else "-" for k in keys]
        share = next((f"{v:.0%}" for k, v in r.items() if k.endswith("_nccl_share")), "-")
        lines.append(f"| {r['parallel']} | {r['build'].rsplit('.', 2)[-2]} | {r['prefill_ms']:.2f} "
                     f"({r['prefill_parity']['rel_err']:.3g}) | " + " | ".join(cells) + f" | {share} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_30b_a3b")
    parser.add_argument("--sm", type=int, default=90)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layouts", default="tp2,tp2_moetp1ep2,dep2")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="moegen-layouts-"))
    build.save_checkpoint(args.model, args.layers, folder)
    rows = run_layouts(args.model, args.sm, args.layers, args.layouts.split(","), folder, "cuda")
    report = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "model": args.model, "layers": args.layers, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"layouts_{args.model}.json").write_text(json.dumps(report, indent=1, default=str))
    print(markdown(rows))


if __name__ == "__main__":
    main()
