"""A world that does not fit a build is refused naming both, before any collective; a rank that fails makes the others stop with an error instead of hanging.

Refusals come in two places: the launcher refuses a rank count before starting anything
(`--nproc 3` for a tp2 build), and a build refuses a torch.distributed world that does not fit its
layout in its constructor, before its first collective (so a world started by hand or by torchrun is
caught too). Failures: the launcher notices the first rank that exits with an error, stops the others
(which would otherwise wait in a collective until the timeout) and names the failing rank and its
error; a rank that hangs makes its peers' collectives time out after the bounded timeout.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

import generated
from generated import run
from runtime.launch import LaunchError, forward_jobs, launch
from runtime.parallel import LayoutError
from tests.parallel import common

TP2 = "tiny_qwen3_moe_bf16__sm_90__tp2"


# -- refused before anything runs ---------------------------------------------------------------------


def test_the_launcher_refuses_a_rank_count_that_does_not_fit_before_starting(capsys):
    code = run.main(["--model", "tiny_qwen3_moe", "--sm", "90", "--parallel", "tp2", "--tiny", "--nproc", "3"])
    assert code == 2
    assert f"{TP2} needs 2 ranks (tp2); --nproc is 3" in capsys.readouterr().err


def test_the_launcher_refuses_a_layout_name_that_does_not_add_up(capsys):
    code = run.main(["--model", "tiny_qwen3_moe", "--sm", "90", "--parallel", "tp3_moetp2ep2", "--tiny"])
    assert code == 2
    assert "moetp2 x ep2 = 4 ranks, but tp3 has 3" in capsys.readouterr().err


@pytest.mark.parametrize("value, flags, where", [
    ("abc", [], "MOEGEN_DIST_TIMEOUT_S must be a positive number of seconds, got 'abc'"),
    ("-5", [], "MOEGEN_DIST_TIMEOUT_S must be a positive number of seconds, got '-5'"),
    ("inf", [], "MOEGEN_DIST_TIMEOUT_S must be a positive number of seconds, got 'inf'"),
    ("abc", ["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
])
def test_the_launcher_reads_the_timeout_variable_and_refuses_a_bad_bound(capsys, monkeypatch, value, flags, where):
    # issue 10 §4: the documented variable is read by `python -m generated.run` (its --timeout does not mask it)
    monkeypatch.setenv("MOEGEN_DIST_TIMEOUT_S", value)
    code = run.main(["--model", "tiny_qwen3_moe", "--sm", "90", "--parallel", "tp2", "--tiny", *flags])
    assert (code, capsys.readouterr().err) == (2, f"python -m generated.run: error: {where}\n")


def test_an_explicit_timeout_wins_over_the_variable_which_wins_over_the_default(monkeypatch):
    from runtime.parallel import DEFAULT_TIMEOUT_S, timeout_seconds

    monkeypatch.delenv("MOEGEN_DIST_TIMEOUT_S", raising=False)
    assert timeout_seconds() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("MOEGEN_DIST_TIMEOUT_S", "7.5")
    assert (timeout_seconds(), timeout_seconds(12)) == (7.5, 12.0)


def test_the_launcher_refuses_a_batch_that_data_parallel_replicas_cannot_share(capsys):
    code = run.main(["--model", "tiny_qwen3_moe", "--sm", "90", "--parallel", "dep2", "--tiny", "--tokens", "1,2,3"])
    assert code == 2
    assert "dep2 runs 2 data-parallel replicas with equal token counts: give a multiple of 2 rows" in capsys.readouterr().err


def test_a_sharded_build_will_not_run_without_its_world():
    # Constructing one rank's shard needs no world (tests of loading do it); running it does, and a
    # missing world must not silently turn every reduction into a no-op.
    shard = generated.load_model("tiny_qwen3_moe", 90, "tp2", rank=1)
    with pytest.raises(LayoutError, match=f"{TP2} needs 2 ranks \\(tp2\\); torch.distributed is not initialised"):
        shard(common.TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("mode,build", [("require", TP2), ("off", "tiny_qwen3_moe/generic")])
def test_a_world_that_does_not_fit_the_build_is_refused_naming_both(mode, build, checkpoints):
    tp2 = common.job("tiny_qwen3_moe", "tp2", checkpoints["tiny_qwen3_moe"], mode)
    with pytest.raises(LaunchError) as raised:
        launch(forward_jobs, 3, (run.load_model, [tp2]), timeout_s=30, job_timeout_s=60, preload=run.PRELOAD)
    message = f"{build} needs 2 ranks (tp2); torch.distributed has 3"
    assert message in str(raised.value).splitlines()[0]
    # Every rank refused on its own, with the same message: none was left waiting in a collective.
    assert sorted(f.rank for f in raised.value.failures if f.exitcode == 1) == [0, 1, 2]
    assert all(f.error == f"LayoutError: {message}" for f in raised.value.failures)


# -- failing ranks ------------------------------------------------------------------------------------

# Workers (module-level, so ranks can import them). Rank 0 always waits in a collective that rank 1 never
# joins: without the launcher it would wait for the whole 60 s timeout.


def _rank1_raises(rank, world, device):
    if rank == 1:
        raise ValueError("rank 1 could not read its shard")
    dist.all_reduce(torch.ones(1))


def _rank1_hangs(rank, world, device):
    if rank == 1:
        time.sleep(120)
    dist.all_reduce(torch.ones(1))


def _rank1_crashes(rank, world, device):
    if rank == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def _everyone_hangs(rank, world, device):
    time.sleep(120)


@pytest.mark.slow
def test_a_rank_that_fails_is_named_and_the_others_are_stopped_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(LaunchError) as raised:
        launch(_rank1_raises, 2, timeout_s=60, preload=run.PRELOAD)
    assert str(raised.value).splitlines()[0] == "rank 1 of 2 failed: ValueError: rank 1 could not read its shard"
    assert "_rank1_raises" in str(raised.value)  # the failing rank's traceback comes with it
    assert time.monotonic() - start < 20  # far below the 60 s collective timeout: rank 0 did not wait it out


@pytest.mark.slow
def test_a_rank_that_dies_without_a_python_error_is_named():
    with pytest.raises(LaunchError) as raised:
        launch(_rank1_crashes, 2, timeout_s=60, preload=run.PRELOAD)
    assert str(raised.value).splitlines()[0] == "rank 1 of 2 failed: exited with code 7 without a Python error"


@pytest.mark.slow
def test_a_rank_that_hangs_makes_its_peers_time_out_within_the_bound():
    start = time.monotonic()
    with pytest.raises(LaunchError) as raised:
        launch(_rank1_hangs, 2, timeout_s=3, preload=run.PRELOAD)
    first, *rest = str(raised.value).splitlines()
    assert first.startswith("rank 0 of 2 failed: ") and "timed out" in first.lower()
    assert "the launcher stopped rank 1" in rest
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_without_a_timeout_the_variable_bounds_the_collectives(monkeypatch):
    # issue 10 §4: MOEGEN_DIST_TIMEOUT_S, not the 300 s default, bounds a launch that gives no timeout
    monkeypatch.setenv("MOEGEN_DIST_TIMEOUT_S", "3")
    start = time.monotonic()
    with pytest.raises(LaunchError) as raised:
        launch(_rank1_hangs, 2, preload=run.PRELOAD)
    first = str(raised.value).splitlines()[0]
    assert first.startswith("rank 0 of 2 failed: ") and "timed out" in first.lower()
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_a_job_that_never_finishes_is_stopped_at_its_deadline():
    with pytest.raises(LaunchError, match="the job did not finish within 2 s; still running: ranks 0, 1"):
        launch(_everyone_hangs, 2, job_timeout_s=2, preload=run.PRELOAD)
