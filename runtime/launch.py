"""What `python -m generated.run` does on every rank (`ForwardJob`, `forward_rank`), and its command line (`main`).

The ranks are started by `runtime.processes.launch`, or by torchrun: `python -m generated.run` started by
torchrun runs as the rank torchrun made it (`main`), and the forward it runs is the same function
(`forward_rank`).

This module never imports `generated` or `registry` (runtime sits below both): the generated launcher
module (`generated/run.py`) passes in its package's `load_model` and what only the registry knows (the
build's name and layout, how to write a tiny checkpoint).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from runtime import parallel
from runtime.causal_lm import check_num_layers
from runtime.parallel import DEFAULT_TIMEOUT_S, Layout
from runtime.processes import LaunchError, backend_for, init_distributed, launch, rank_device


# -- the forward a run does ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardJob:
    """One build to construct on every rank, load, and run on `tokens` (the whole batch, [B, S])."""

    model: str
    sm: int
    parallel: str
    checkpoint: str | None
    checkpoint_name: str | None
    tokens: torch.Tensor
    mode: str = "auto"
    seed: int = 0
    moe_config: dict | None = None   # the selection, as load_model takes it ({"backend": ..., "tactic": ...})
    # Builds and loads instead of the launcher's `load_model` (same signature, importable by name): the
    # tests use it for fp32 builds bound to the reference experts.
    loader: Callable | None = None
    generate: int = 0                # > 0: greedy-decode this many tokens after the prompt (`model.generate`)
    spec_mode: str | None = None     # speculative_config.mode: load the target with its draft
    draft_tokens: int = 0            # > 0: decode speculatively, the draft proposing this many per round
    num_layers: int | None = None    # build only the first this many decoder layers (a smoke run of a large checkpoint)
    draft_checkpoint: str | None = None  # the folder of a draft that keeps its weights apart from the target's


def forward_rank(load_model: Callable, job: ForwardJob, rank: int, device: str) -> dict:
    """This rank's part of a forward: build via `load_model(..., rank=rank)`, load, run its replica's rows.

    Returns the whole batch's logits (fp32, CPU) on every rank: under attention data parallelism each
    replica runs `B / dp` rows and the replicas' logits are gathered.
    """
    build = job.loader or load_model
    kwargs = {} if job.moe_config is None else {"moe_config": job.moe_config}
    if job.spec_mode is not None:
        kwargs["speculative_config"] = {"mode": job.spec_mode}
    if job.num_layers is not None:
        kwargs["num_layers"] = job.num_layers
    if job.draft_checkpoint is not None:
        kwargs["draft_checkpoint"] = job.draft_checkpoint
    model = build(job.model, job.sm, job.parallel, checkpoint=job.checkpoint, checkpoint_name=job.checkpoint_name,
                  device=device, mode=job.mode, rank=rank, seed=job.seed, **kwargs)
    model.eval()
    layout = model.layout
    if job.tokens.shape[0] % layout.dp:
        raise ValueError(f"{job.parallel} runs {layout.dp} data-parallel replicas with equal token counts: "
                         f"give a multiple of {layout.dp} rows, not {job.tokens.shape[0]}")
    rows = job.tokens.chunk(layout.dp)[layout.dp_rank(rank)]
    described = {"build": type(model).__module__, "layout": (layout.tp, layout.moe_tp, layout.ep, layout.dp)}
    if job.generate:
        out = model.generate(rows.to(device), job.generate, speculative=job.draft_tokens or None)
        tokens = parallel.all_gather(out.tokens.to(device), dim=0, group=parallel.DP).cpu()
        result = {"tokens": tokens, "prefill_s": out.prefill_s, "decode_s": out.decode_s,
                  "tokens_per_s": out.tokens_per_s * layout.dp, **described}
        if job.draft_tokens:
            result["speculative"] = out.report()
        return result
    with torch.no_grad():
        logits = model(rows.to(device))
        dtype = str(logits.dtype).removeprefix("torch.")
        logits = parallel.all_gather(logits, dim=0, group=parallel.DP)
    return {"logits": logits.float().cpu(), "dtype": dtype, **described}


def forward_jobs(rank: int, world: int, device: str, load_model: Callable, jobs: Sequence[ForwardJob]) -> list | None:
    """`launch` target: every job in order on this rank; rank 0 returns the results (one world, many builds)."""
    results = []
    for job in jobs:
        results.append(forward_rank(load_model, job, rank, device))
    return results if rank == 0 else None


# -- the command line ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunTarget:
    """What the registry says about a run before any rank starts (from `generated/run.py`)."""

    name: str                   # the target's identity, e.g. tiny_qwen3_moe_bf16__sm_90__tp2
    parallel: str
    layout: Layout
    vocab_size: int
    checkpoint_name: str
    num_layers: int             # the model's decoder layers (its layer plan's)


def _parse_tokens(rows: Sequence[str] | None, vocab: int, dp: int, seq_len: int, seed: int) -> torch.Tensor:
    if rows:
        try:
            parsed = [[int(t) for t in row.split(",") if t.strip()] for row in rows]
        except ValueError:
            raise ValueError("--tokens takes rows of comma-separated token ids, e.g. --tokens 1,2,3 4,5,6; "
                             f"got {' '.join(rows)}") from None
        if len({len(r) for r in parsed}) != 1 or not parsed[0]:
            raise ValueError("--tokens rows must be non-empty and of equal length")
        tokens = torch.tensor(parsed, dtype=torch.int64)
        bad = tokens[(tokens < 0) | (tokens >= vocab)]
        if bad.numel():
            raise ValueError(f"--tokens: id {int(bad[0])} is outside the vocabulary (0..{vocab - 1})")
        return tokens
    # Two rows at least (so a batch is exercised), and a multiple of the data-parallel replicas.
    batch = dp * math.ceil(2 / dp)
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def summarize(target: RunTarget, result: dict, nproc: int, device: str, tokens: torch.Tensor) -> str:
    """What rank 0 prints: which build ran where, and enough of the logits to compare runs by eye (or, for
    `--generate`, the generated ids of every row and the decode rate)."""
    lines = [f"{target.name}: {result['build']} on {parallel.ranks(nproc)} ({backend_for(device)}, {device})"]
    if "tokens" in result:
        generated = result["tokens"][:, tokens.shape[1]:]
        for row in range(generated.shape[0]):
            lines.append(f"row {row} ({tokens.shape[1]} tokens) generated: {', '.join(map(str, generated[row].tolist()))}")
        lines.append(f"prefill {result['prefill_s'] * 1e3:.1f} ms; decode {generated.shape[1] - 1} steps of "
                     f"{generated.shape[0]} rows in {result['decode_s'] * 1e3:.1f} ms: {result['tokens_per_s']:.1f} tokens/s")
        if "speculative" in result:
            lines.append(result["speculative"])
        return "\n".join(lines)
    logits = result["logits"]
    lines += [
        f"logits {list(logits.shape)} {result['dtype']}: max |x| {logits.abs().max().item():.6g}, "
        f"mean {logits.mean().item():.6g}, std {logits.std().item():.6g}, sum {logits.sum().item():.6g}",
    ]
    last = logits[:, -1, :]
    top = last.topk(min(5, last.shape[-1]), dim=-1)
    for row in range(last.shape[0]):
        ids = ", ".join(f"{int(i)} ({v:.4f})" for i, v in zip(top.indices[row], top.values[row].tolist()))
        lines.append(f"row {row} ({tokens.shape[1]} tokens) next-token top-{top.indices.shape[1]}: {ids}")
    return "\n".join(lines)


def _parser(prog: str, spec_modes: Sequence[str] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description="Run a generated build's parallel layout on N local ranks "
                                "(gloo on CPU, NCCL on CUDA) and print rank 0's logits.")
    p.add_argument("--model", required=True)
    p.add_argument("--sm", type=int, required=True)
    p.add_argument("--parallel", default="tp1", help="tp<N>, tp<N>_moetp<X>ep<Y>, dep<N> or a declared profile")
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="HF checkpoint folder; every rank reads only its own shard of it")
    weights.add_argument("--tiny", action="store_true",
                         help="write one seeded random checkpoint of the model first, then load it like --checkpoint")
    p.add_argument("--checkpoint-name", help="the declared checkpoint (needed when the model declares several)")
    p.add_argument("--nproc", type=int, help="ranks to start (default: the layout's world); must equal it")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", nargs="+", metavar="IDS", help="one comma-separated row of token ids per sequence")
    p.add_argument("--seq-len", type=int, default=8, help="length of the random rows when --tokens is not given")
    p.add_argument("--seed", type=int, default=0, help="seed of the --tiny weights and the random tokens")
    p.add_argument("--backend", help="moe_config.backend of the selection (default AUTO)")
    p.add_argument("--tactic", help="moe_config.tactic of the selection, e.g. grouped_mm")
    p.add_argument("--mode", choices=("auto", "require", "off"), default="auto",
                   help="auto: the specialized build when it serves the run, else the generic one; off: generic")
    p.add_argument("--timeout", type=float,
                   help="seconds a rank waits in rendezvous or a collective before it fails "
                        f"(default: MOEGEN_DIST_TIMEOUT_S, else {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="greedy-decode N tokens after the prompt (static caches, CUDA graphs on a GPU) and print them")
    p.add_argument("--spec-mode", choices=spec_modes or None,
                   help="speculative_config.mode: load the target with the draft this mode needs")
    p.add_argument("--draft-tokens", type=int, metavar="K",
                   help="with --spec-mode and --generate: the draft proposes K tokens per target step (default 1)")
    p.add_argument("--draft-checkpoint", metavar="DIR",
                   help="with --spec-mode: the folder of a draft that keeps its weights apart from the target's "
                        "(an external drafter, an Eagle3 head, a replacement MTP head); every rank reads it")
    p.add_argument("--num-layers", type=int, metavar="N",
                   help="build only the first N decoder layers and read only their tensors (a smoke run)")
    p.add_argument("--logits-out", help="write rank 0's logits and the run's description here (torch.save)")
    p.add_argument("--tiny-dir", help="with --tiny: write the checkpoint here (kept) instead of a temporary folder")
    return p


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def main(argv: Sequence[str] | None = None, *, load_model: Callable, describe: Callable, write_tiny: Callable,
         preload: Sequence[str] = (), prog: str = "python -m generated.run", spec_modes: Sequence[str] = ()) -> int:
    """The launcher's command line; returns the exit code (0 ran, 1 a rank failed, 2 refused before starting).

    `describe(model, sm, parallel, checkpoint, checkpoint_name[, spec_mode, moe_config, mode, draft_checkpoint]
    [, num_layers]) -> RunTarget` and `write_tiny(model, sm, checkpoint_name, folder, seed)` come from the generated
    package.
    """
    args = _parser(prog, spec_modes).parse_args(argv)
    torchrun = _under_torchrun()

    def refuse(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2

    if args.draft_checkpoint is not None:
        # Before describe, which compares the folder's config.json with the draft's.
        if args.spec_mode is None:
            return refuse("--draft-checkpoint gives the folder of the draft a speculative mode loads: give --spec-mode too")
        if not Path(args.draft_checkpoint).is_dir():
            return refuse(f"--draft-checkpoint takes the draft's checkpoint folder; {args.draft_checkpoint} is not a folder")
    selection = {k: v for k, v in (("backend", args.backend), ("tactic", args.tactic)) if v is not None}
    try:
        # Resolved once, here: every rank gets the same bound, --timeout over the documented variable.
        timeout_s = parallel.timeout_seconds(args.timeout)
        # Under a spec mode describe checks the draft the ranks will load (and its folder), so it is told the selection.
        spec = {} if args.spec_mode is None else {"spec_mode": args.spec_mode, "moe_config": selection or None,
                                                  "mode": args.mode, "draft_checkpoint": args.draft_checkpoint}
        cut = {} if args.num_layers is None else {"num_layers": args.num_layers}
        target = describe(args.model, args.sm, args.parallel, args.checkpoint, args.checkpoint_name, **spec, **cut)
    except (ValueError, LookupError, OSError) as e:
        return refuse(str(e))
    world = target.layout.world
    if torchrun:
        started = int(os.environ["WORLD_SIZE"])
        if started != world or (args.nproc is not None and args.nproc != started):
            return refuse(f"{target.name} needs {parallel.ranks(world)} ({target.parallel}); torchrun started {started}"
                          + (f" and --nproc is {args.nproc}" if args.nproc is not None and args.nproc != started else ""))
    nproc = world if args.nproc is None else args.nproc
    if nproc != world:
        return refuse(f"{target.name} needs {parallel.ranks(world)} ({target.parallel}); --nproc is {nproc}")
    if args.device == "cuda" and not torchrun and torch.cuda.device_count() < nproc:
        return refuse(f"{target.name} on CUDA needs {nproc} GPUs, one per rank; this host has {torch.cuda.device_count()}")
    try:
        tokens = _parse_tokens(args.tokens, target.vocab_size, target.layout.dp, args.seq_len, args.seed)
    except ValueError as e:
        return refuse(str(e))
    if args.generate < 0:
        return refuse(f"--generate takes a number of tokens >= 1, got {args.generate}")
    if args.draft_tokens is not None and args.spec_mode is None:
        return refuse("--draft-tokens sets the draft's proposals per round: give --spec-mode too")
    if args.spec_mode is not None and not args.generate:
        return refuse("--spec-mode decodes with a draft: give --generate N too")
    if args.draft_tokens is not None and args.draft_tokens < 1:
        return refuse(f"--draft-tokens takes a number of proposals >= 1, got {args.draft_tokens}")
    if args.spec_mode is not None and target.layout.dp > 1:
        return refuse(f"speculative decoding needs every rank to accept the same tokens; {target.parallel} runs "
                      f"{target.layout.dp} data-parallel replicas: use a layout without attention data parallelism")
    if args.num_layers is not None:
        try:
            check_num_layers(args.num_layers, target.num_layers, target.name, "--num-layers")
        except ValueError as e:
            return refuse(str(e))
    if args.generate and args.logits_out:
        return refuse("--logits-out writes a forward's logits; it does not combine with --generate")
    if tokens.shape[0] % target.layout.dp:
        return refuse(f"{target.parallel} runs {target.layout.dp} data-parallel replicas with equal token counts: "
                      f"give a multiple of {target.layout.dp} rows to --tokens, not {tokens.shape[0]}")

    with tempfile.TemporaryDirectory(prefix="moegen-tiny-") as scratch:
        checkpoint = args.checkpoint
        if args.tiny:
            # One seeded full checkpoint, written before any rank starts (under torchrun each rank writes
            # its own identical copy: there is no parent process to share one).
            checkpoint = args.tiny_dir or scratch
            try:
                write_tiny(args.model, args.sm, target.checkpoint_name, checkpoint, args.seed)
            except ValueError as e:
                return refuse(f"cannot write a tiny checkpoint of {args.model}: {e}")
        job = ForwardJob(args.model, args.sm, args.parallel, str(checkpoint), target.checkpoint_name, tokens,
                         mode=args.mode, seed=args.seed, moe_config=selection or None, generate=args.generate,
                         spec_mode=args.spec_mode, draft_tokens=(args.draft_tokens or 1) if args.spec_mode else 0,
                         num_layers=args.num_layers, draft_checkpoint=args.draft_checkpoint)
        if torchrun:
            rank, world = init_distributed(args.device, timeout_s)
            device = rank_device(args.device, int(os.environ.get("LOCAL_RANK", rank)))
            result = forward_jobs(rank, world, device, load_model, [job])
            dist.destroy_process_group()
            if rank != 0:
                return 0
            result = result[0]
        else:
            try:
                results = launch(forward_jobs, nproc, (load_model, [job]), device=args.device, timeout_s=timeout_s,
                                 preload=preload)
            except LaunchError as e:
                print(f"{prog}: {target.name} failed on {parallel.ranks(nproc)}: {e}", file=sys.stderr)
                return 1
            result = results[0][0]
    print(summarize(target, result, nproc, args.device, tokens))
    if args.logits_out:
        Path(args.logits_out).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"target": target.name, "parallel": target.parallel, "nproc": nproc, "device": args.device,
                    "tokens": tokens, **result}, args.logits_out)
        print(f"logits written to {args.logits_out}")
    return 0
