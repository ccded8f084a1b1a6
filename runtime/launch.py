"""Runs a job on N local ranks (gloo on CPU, NCCL on CUDA) for `python -m generated.run` and the tests, turning any failure into one error naming the rank.

A launcher of our own rather than only torchrun, because one path has to (a) bring the world up with
bounded timeouts (`runtime.parallel.timeout`), (b) notice the first rank that fails and stop the others
instead of leaving them blocked in a collective, and (c) say which rank failed and why, in one message a
test can assert on. torchrun still works: `python -m generated.run` started by torchrun runs as the rank
torchrun made it (`main`), and the forward it runs is the same function (`forward_rank`).

This module never imports `generated` or `registry` (runtime sits below both): the generated launcher
module (`generated/run.py`) passes in its package's `load_model` and what only the registry knows (the
build's name and layout, how to write a tiny checkpoint).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from runtime import parallel
from runtime.parallel import DEFAULT_TIMEOUT_S, Layout

# Set in every rank of a CUDA run: NVLink SHARP (NVLS) and symmetric-memory multicast need fabric
# features that shared or partitioned GPU hosts may not expose; NCCL then falls back to plain NVLink.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# After the first rank fails, the others get this long to exit with their own errors (usually "peer
# closed the connection"), which the report lists; then they are stopped.
_GRACE_S = 1.0
# Modules a CPU launch's fork server imports once, so that ranks start in milliseconds instead of each
# importing torch (16 ranks on a 2-core CI host would spend ~15 s there).
_PRELOAD = ("torch", "torch.distributed", "runtime.parallel", "runtime.ops", "runtime.checkpoint",
            "runtime.experts", "runtime.launch")


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (the rendezvous of a local world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """The device a rank runs on: the CPU, or GPU `local_rank` of this host."""
    return f"cuda:{local_rank}" if torch.device(device).type == "cuda" else "cpu"


def init_distributed(device: str = "cpu", timeout_s: float | None = None) -> tuple[int, int]:
    """Bring up torch.distributed from the environment torchrun (or `launch`) sets; returns (rank, world).

    The timeout (None: MOEGEN_DIST_TIMEOUT_S, else the default) bounds the rendezvous and every
    collective of the world and of the groups `runtime.parallel` creates later.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    parallel.set_timeout(parallel.timeout_seconds(timeout_s))
    kwargs = {}
    if torch.device(device).type == "cuda":
        for key, value in GPU_ENV.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(local)
        # Binding the device makes NCCL create its communicator now (eagerly), inside the timeout.
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend_for(device), init_method="env://", rank=rank, world_size=world,
                            timeout=parallel.timeout(), **kwargs)
    return rank, world


# -- failures -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended when it did not succeed."""

    rank: int
    exitcode: int | None          # None: still running when the launcher stopped it
    error: str | None = None      # "Type: message" of the Python exception, when the rank could write it
    traceback: str | None = None
    when: float = math.inf        # time.time() of the exception: the earliest one is the cause

    def describe(self) -> str:
        if self.error is not None:
            return self.error
        if self.exitcode is None:
            return "stopped by the launcher"
        if self.exitcode < 0:
            return f"killed by signal {-self.exitcode} (no Python error: out of memory, or killed from outside?)"
        return f"exited with code {self.exitcode} without a Python error"


class LaunchError(RuntimeError):
    """A launched job failed: the first line names the rank that failed first and why."""

    def __init__(self, message: str, failures: Sequence[RankFailure] = ()):
        self.failures = tuple(failures)
        super().__init__(message)


# What a rank reports when a peer died under it: an effect, never the cause, whatever its timestamp
# (the dead peer's exit and this error happen within the same millisecond).
_PEER_GONE = ("closed by peer", "reset by peer", "connection refused", "broken pipe", "remote process exited",
              "communicator was aborted", "peer closed")


def _is_secondary(failure: RankFailure) -> bool:
    return failure.error is not None and any(s in failure.error.lower() for s in _PEER_GONE)


def _failure_report(nproc: int, failures: list[RankFailure]) -> str:
    failed = sorted((f for f in failures if f.exitcode is not None),
                    key=lambda f: (_is_secondary(f), f.when, f.rank))
    stopped = sorted(f.rank for f in failures if f.exitcode is None)
    cause = failed[0]
    lines = [f"rank {cause.rank} of {nproc} failed: {cause.describe()}"]
    for other in failed[1:]:
        lines.append(f"then rank {other.rank} failed: {other.describe()}")
    if stopped:
        lines.append(f"the launcher stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}")
    if "timed out" in cause.describe().lower() or "timeout" in cause.describe().lower():
        lines.append("a collective that times out means another rank never reached it (hung, or slower than --timeout)")
    if cause.traceback:
        lines.append(f"rank {cause.rank} traceback:")
        lines.extend("  " + line for line in cause.traceback.rstrip().splitlines())
    return "\n".join(lines)


# -- launching ----------------------------------------------------------------------------------------


def _rank_main(rank: int, nproc: int, env: dict, device: str, timeout_s: float, threads: int,
               fn: Callable, args: tuple, out_dir: str) -> None:
    """One rank: join the world, run `fn(rank, world, device, *args)`, leave its result or error in out_dir."""
    os.environ.update(env)
    code = 0
    try:
        if threads:
            torch.set_num_threads(threads)
        rank, world = init_distributed(device, timeout_s)
        result = fn(rank, world, rank_device(device, int(env["LOCAL_RANK"])), *args)
        if result is not None:
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher, whatever it is
        code = 1
        report = {"rank": rank, "error": f"{type(e).__name__}: {e}".strip(), "traceback": traceback.format_exc(),
                  "when": time.time()}
        with open(os.path.join(out_dir, f"rank{rank}.error.json"), "w") as f:
            json.dump(report, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a rank whose peers died can block in the destructors of its process
    # groups, and the launcher is waiting on this exit code.
    os._exit(code)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _read_failure(out_dir: str, rank: int, exitcode: int | None, seen: float = math.inf) -> RankFailure:
    """A rank's failure from its error file; `seen` (when the launcher saw it exit) dates a silent crash."""
    path = os.path.join(out_dir, f"rank{rank}.error.json")
    if exitcode is not None and os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
        return RankFailure(rank, exitcode, report["error"], report["traceback"], report["when"])
    return RankFailure(rank, exitcode, when=seen)


def launch(fn: Callable, nproc: int, args: tuple = (), *, device: str = "cpu", timeout_s: float | None = None,
           job_timeout_s: float | None = None, preload: Sequence[str] = (), env: dict | None = None) -> list:
    """Run `fn(rank, world, device, *args)` on `nproc` local ranks; returns each rank's return value.

    `fn` must be importable by name (a module-level function) and its results picklable. CPU ranks use
    gloo and share the host's cores; CUDA ranks use NCCL, one GPU each. `timeout_s` (None:
    MOEGEN_DIST_TIMEOUT_S, else the default) bounds rendezvous and every collective; `job_timeout_s`
    (None: unbounded) bounds the whole job. On the first rank that fails the others get a moment to
    report, are stopped, and LaunchError names the failing rank.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    # Resolved here, not in the ranks: a forkserver's children see its environment, not this one's.
    timeout_s = parallel.timeout_seconds(timeout_s)
    cuda = torch.device(device).type == "cuda"
    if cuda and torch.cuda.device_count() < nproc:
        raise LaunchError(f"{nproc} CUDA ranks need {nproc} GPUs; this host has {torch.cuda.device_count()}")
    if cuda:
        # Spawned ranks start clean: a forked CUDA context is unusable, and GPU hosts have cores to spare.
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(dict.fromkeys((*_PRELOAD, *preload))))
    port = free_port()
    threads = 0 if cuda else max(1, (os.cpu_count() or 1) // nproc)
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), **(GPU_ENV if cuda else {}), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="moegen-launch-") as out_dir:
        procs = []
        try:
            for rank in range(nproc):
                rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                p = ctx.Process(target=_rank_main, name=f"moegen-rank{rank}", daemon=True,
                                args=(rank, nproc, rank_env, device, timeout_s, threads, fn, tuple(args), out_dir))
                p.start()
                procs.append(p)
            _wait(procs, nproc, out_dir, job_timeout_s)
        finally:
            _stop(procs)
        results = []
        for rank in range(nproc):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return results


def _wait(procs, nproc: int, out_dir: str, job_timeout_s: float | None) -> None:
    """Return when every rank exited 0; raise LaunchError at the first failure or when the job times out."""
    deadline = None if job_timeout_s is None else time.monotonic() + job_timeout_s
    running = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
    failed: dict[int, float] = {}   # rank -> time.time() the launcher saw it exit
    while running:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = connection.wait(list(running), timeout=left)
        if not ready:
            ranks = sorted(rank for rank, _ in running.values())
            _stop(procs)
            raise LaunchError(f"the job did not finish within {job_timeout_s:g} s; still running: "
                              f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}",
                              [RankFailure(r, None) for r in ranks])
        for sentinel in ready:
            rank, p = running.pop(sentinel)
            p.join()
            if p.exitcode != 0:
                failed[rank] = time.time()
        if failed:
            # Give the rest a moment to fail on their own (their errors complete the picture), then stop them.
            grace = time.monotonic() + _GRACE_S
            while running and time.monotonic() < grace:
                for sentinel in connection.wait(list(running), timeout=max(0.0, grace - time.monotonic())):
                    rank, p = running.pop(sentinel)
                    p.join()
                    if p.exitcode != 0:
                        failed[rank] = time.time()
            stopped = sorted(rank for rank, _ in running.values())
            _stop(procs)
            failures = [_read_failure(out_dir, r, procs[r].exitcode, seen) for r, seen in failed.items()]
            failures += [RankFailure(r, None) for r in stopped]
            raise LaunchError(_failure_report(nproc, failures), failures)


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


def forward_rank(load_model: Callable, job: ForwardJob, rank: int, device: str) -> dict:
    """This rank's part of a forward: build via `load_model(..., rank=rank)`, load, run its replica's rows.

    Returns the whole batch's logits (fp32, CPU) on every rank: under attention data parallelism each
    replica runs `B / dp` rows and the replicas' logits are gathered.
    """
    build = job.loader or load_model
    kwargs = {} if job.moe_config is None else {"moe_config": job.moe_config}
    if job.spec_mode is not None:
        kwargs["speculative_config"] = {"mode": job.spec_mode}
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
    p.add_argument("--logits-out", help="write rank 0's logits and the run's description here (torch.save)")
    p.add_argument("--tiny-dir", help="with --tiny: write the checkpoint here (kept) instead of a temporary folder")
    return p


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def main(argv: Sequence[str] | None = None, *, load_model: Callable, describe: Callable, write_tiny: Callable,
         preload: Sequence[str] = (), prog: str = "python -m generated.run", spec_modes: Sequence[str] = ()) -> int:
    """The launcher's command line; returns the exit code (0 ran, 1 a rank failed, 2 refused before starting).

    `describe(model, sm, parallel, checkpoint, checkpoint_name[, spec_mode]) -> RunTarget` and
    `write_tiny(model, sm, checkpoint_name, folder, seed)` come from the generated package.
    """
    args = _parser(prog, spec_modes).parse_args(argv)
    torchrun = _under_torchrun()

    def refuse(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2

    try:
        # Resolved once, here: every rank gets the same bound, --timeout over the documented variable.
        timeout_s = parallel.timeout_seconds(args.timeout)
        spec = {} if args.spec_mode is None else {"spec_mode": args.spec_mode}
        target = describe(args.model, args.sm, args.parallel, args.checkpoint, args.checkpoint_name, **spec)
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
        selection = {k: v for k, v in (("backend", args.backend), ("tactic", args.tactic)) if v is not None}
        job = ForwardJob(args.model, args.sm, args.parallel, str(checkpoint), target.checkpoint_name, tokens,
                         mode=args.mode, seed=args.seed, moe_config=selection or None, generate=args.generate,
                         spec_mode=args.spec_mode, draft_tokens=(args.draft_tokens or 1) if args.spec_mode else 0)
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
