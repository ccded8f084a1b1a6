"""Starts a job on N local rank processes (gloo on CPU, NCCL on CUDA) and turns any failure into one error naming the rank that failed first.

A launcher of our own rather than only torchrun, because one path has to (a) bring the world up with
bounded timeouts (`runtime.parallel.timeout`), (b) notice the first rank that fails and stop the others
instead of leaving them blocked in a collective, and (c) say which rank failed and why, in one message a
test can assert on. What the ranks of `python -m generated.run` run is in `runtime.launch`.
"""
from __future__ import annotations

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
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from runtime import parallel

# Set in every rank of a CUDA run: NVLink SHARP (NVLS) and symmetric-memory multicast need fabric
# features that shared or partitioned GPU hosts may not expose; NCCL then falls back to plain NVLink.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# After the first rank fails, the others get this long to exit with their own errors (usually "peer
# closed the connection"), which the report lists; then they are stopped.
_GRACE_S = 1.0
# Modules a CPU launch's fork server imports once, so that ranks start in milliseconds instead of each
# importing torch (16 ranks on a 2-core CI host would spend ~15 s there).
_PRELOAD = ("torch", "torch.distributed", "runtime.parallel", "runtime.ops", "runtime.checkpoint",
            "runtime.experts", "runtime.processes", "runtime.launch")


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
