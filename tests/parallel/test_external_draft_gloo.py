"""An external drafter in a multi-rank run, as users run it: `python -m generated.run --parallel tp2 --nproc 2
--spec-mode draft_target --draft-checkpoint DIR` on two gloo ranks (tiny_kimi_k3's tp2 target and its Qwen3-MoE
drafter, both split 2-way by tensor parallel).

- Greedy speculative decoding gives exactly the tokens of the plain 2-rank run (RULES SD1), and the counts it
  reports (SD3) are those of an independent one-process replay: the one-rank drafter, run uncached over the plain
  run's tokens, proposes k tokens a round and keeps the agreeing prefix plus the target's own token.
- The drafter the ranks load computes the logits of the one-rank drafter loaded from the same folder: relative L2
  error <= 1e-3 (observed 1.5e-4 on both ranks). fp32 builds, whose shards' sums differ by summation order only,
  but the bound TORCH experts round their inputs to bf16, where such a difference now and then moves an input by
  one bf16 step; a shard read from the wrong rows, or a sum left out, moves the logits by their own size.
- A drafter folder the ranks could not use is refused before any rank starts (exit 2), naming what to change.

The counts are only worth comparing when the drafter is right some of the time and wrong some of the time, which a
random drafter never is (it proposes 1 of 512 tokens). `_successor_drafter` steers one: its layers keep random
weights, its embedding and head make its greedy proposal after a token the successor a table gives (two of every
three of the plain run's pairs), else a sink token the target never emits, by a margin of about 16 logits (measured
>= 15.8; the run measured accepted 7 of 24 proposals in 8 rounds).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generated import load_model, run
from runtime.processes import launch
from tests.generated import builds, helpers_drafts

ROOT = Path(__file__).resolve().parents[2]
MODEL, SM, CHECKPOINT, PARALLEL = "tiny_kimi_k3", 90, "tiny_kimi_k3_mxfp4", "tp2"
DRAFT_TARGET = f"{CHECKPOINT}__sm_{SM}__{PARALLEL}"
PROMPT = [[5, 6, 7, 8], [300, 12, 41, 7]]
NEW, K = 16, 3
OWN_FOLDER = ("keeps its weights in a folder of its own: pass draft_checkpoint=DIR to load_model "
              "(--draft-checkpoint DIR to python -m generated.run)")


def _launch_args(checkpoint, generate: int, drafter=None) -> list[str]:
    args = ["--model", MODEL, "--sm", str(SM), "--parallel", PARALLEL, "--nproc", "2", "--checkpoint", str(checkpoint),
            "--tokens", *(",".join(map(str, row)) for row in PROMPT), "--generate", str(generate), "--timeout", "60"]
    if drafter is not None:
        args += ["--spec-mode", "draft_target", "--draft-tokens", str(K), "--draft-checkpoint", str(drafter)]
    return args


def _run(args: list[str]) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """`python -m generated.run ARGS` as a user runs it: (each row's generated tokens, (target steps, proposed,
    accepted) when it decoded speculatively)."""
    done = subprocess.run([sys.executable, "-m", "generated.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{DRAFT_TARGET}: generated.{MODEL}.{DRAFT_TARGET}.modeling on 2 ranks (gloo, cpu)", done.stdout
    rows = [re.fullmatch(rf"row {r} \(4 tokens\) generated: ([\d, ]+)", lines[1 + r]) for r in range(len(PROMPT))]
    assert all(rows), done.stdout
    tokens = torch.tensor([[int(t) for t in row[1].split(", ")] for row in rows])
    stats = re.search(r"^speculative: (\d+) target steps, (\d+) proposed, (\d+) accepted", done.stdout, re.M)
    return tokens, (tuple(int(n) for n in stats.groups()) if stats else None)


def _successor_drafter(folder, successors: dict[int, int], sink: int) -> Path:
    """The drafter's folder, steered: after a token `t` of `successors` its greedy proposal is `successors[t]`,
    after any other token `sink`. Each tabled token embeds along a direction of its own (an orthonormal basis; the
    other tokens along the sink's), and the head scores a token along the directions of the tokens it follows; the
    random layers add a few percent to those directions, the wrong tokens' logits stay near 0 and the right one's
    near 16."""
    tensors = helpers_drafts.drafter_tensors()
    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    dtype = tensors["lm_head.weight"].dtype
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(7)))[0].T
    sources = sorted(successors)
    assert len(sources) < hidden, "one direction a tabled token, one for the sink"
    embed = (basis[len(sources)] * hidden ** 0.5).expand(vocab, hidden).clone()
    head = torch.zeros(vocab, hidden)
    head[sink] = basis[len(sources)] * 2
    for i, token in enumerate(sources):
        embed[token] = basis[i] * hidden ** 0.5
        head[successors[token]] += basis[i] * 2
    tensors.update({"model.embed_tokens.weight": embed.to(dtype), "lm_head.weight": head.to(dtype)})
    return helpers_drafts.drafter_folder(folder, tensors)


def _replay(drafter, sequences: torch.Tensor) -> tuple[int, int, int]:
    """(rounds, proposed, accepted) of greedy speculative decoding of NEW tokens with k = K, replayed in one process
    from the target's own tokens `sequences` (prompt, then at least NEW + K greedy tokens): each round the drafter
    proposes K tokens greedily after the kept prefix, every row keeps the proposals that agree with the target's
    tokens, the round keeps the fewest over the rows, plus the target's next token."""
    prompt = len(PROMPT[0])
    made, rounds, accepted = 1, 0, 0   # the prefill gives the first token
    with torch.no_grad():
        while made < NEW:
            context = sequences[:, :prompt + made]
            for _ in range(K):
                context = torch.cat((context, drafter(context)[:, -1:].argmax(-1)), dim=1)
            proposed, truth = context[:, prompt + made:], sequences[:, prompt + made:prompt + made + K]
            kept = int((proposed == truth).long().cumprod(dim=1).sum(dim=1).min())
            made, rounds, accepted = made + kept + 1, rounds + 1, accepted + kept
    return rounds, rounds * K, accepted


def _one_rank_drafter(folder):
    """The drafter as one process builds it (the one-rank target's draft.py), fp32, loaded from `folder`."""
    draft = builds.load(f"generated.{MODEL}.{helpers_drafts.EXTERNAL_TARGET}.draft").DRAFT_CLASS(dtype=torch.float32)
    draft.load_checkpoint(folder)
    return draft.eval()


def _drafter_logits_rank(rank: int, world: int, device: str, checkpoint: str, drafter: str, tokens: torch.Tensor):
    """On each rank: load_model's tp2 target with its drafter (fp32), and the drafter's logits of `tokens`."""
    model = load_model(MODEL, SM, PARALLEL, checkpoint=checkpoint, checkpoint_name=CHECKPOINT, draft_checkpoint=drafter,
                       speculative_config={"mode": "draft_target"}, device=device, rank=rank, dtype=torch.float32)
    with torch.no_grad():
        return model.draft.model.eval()(tokens).float()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The target's checkpoint, as the launcher's --tiny writes it."""
    return Path(run.write_tiny(MODEL, SM, CHECKPOINT, tmp_path_factory.mktemp("kimi-target"), seed=0))


@pytest.mark.slow
def test_two_ranks_decode_with_the_external_drafter_the_plain_tokens_with_the_replayed_counts(target, tmp_path):
    plain, stats = _run(_launch_args(target, NEW + K))   # the tokens past NEW: what the last round's proposals meet
    assert stats is None
    sequences = torch.cat((torch.tensor(PROMPT), plain), dim=1)
    pairs = [(int(a), int(b)) for row in sequences for i, (a, b) in enumerate(zip(row[:-1], row[1:])) if i % 3 != 2]
    successors = dict(reversed(pairs))   # a token met twice keeps its first successor
    sink = min(set(range(512)) - set(sequences.flatten().tolist()))
    drafter = _successor_drafter(tmp_path / "drafter", successors, sink)

    tokens, (rounds, proposed, accepted) = _run(_launch_args(target, NEW, drafter))
    assert torch.equal(tokens, plain[:, :NEW])   # RULES SD1
    assert (rounds, proposed, accepted) == _replay(_one_rank_drafter(drafter), sequences)
    assert 0 < accepted < proposed   # the drafter is right some of the time, and wrong some of the time


@pytest.mark.slow
def test_the_ranks_drafter_computes_the_one_process_drafters_logits(target, tmp_path):
    drafter = helpers_drafts.drafter_folder(tmp_path / "drafter")   # random: every layer counts
    tokens = builds.token_ids(512, batch=2, length=9, seed=4)
    results = launch(_drafter_logits_rank, 2, (str(target), str(drafter), tokens), timeout_s=60, job_timeout_s=600,
                     preload=run.PRELOAD)
    with torch.no_grad():
        expected = _one_rank_drafter(drafter)(tokens)
    for rank, logits in enumerate(results):
        assert logits.shape == (2, 9, 512) and builds.rel_err(logits, expected) <= 1e-3, rank


# -- refused before any rank starts ---------------------------------------------------------------------------------


def _missing_tensor(folder) -> Path:
    tensors = helpers_drafts.drafter_tensors()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    return helpers_drafts.drafter_folder(folder, tensors)


def _wrong_shapes(folder) -> Path:
    tensors = helpers_drafts.drafter_tensors()
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :32].clone()
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.mlp.gate.weight"][:4].clone()
    return helpers_drafts.drafter_folder(folder, tensors)


def _another_drafters_config(folder) -> Path:
    # A Qwen3-MoE drafter of another width and depth: its config.json says so before a tensor is read.
    return helpers_drafts.drafter_folder(folder, hidden_size=128, num_hidden_layers=4)


FOLDER_ADVICE = "pass a checkpoint of the declared draft (draft_checkpoint=DIR, --draft-checkpoint DIR)"
REFUSED = {
    "missing tensor": (_missing_tensor, "{folder} does not fit the draft tiny_kimi_k3_drafter of tiny_kimi_k3 as rank 0 "
                       "of 2 builds it: missing tensor model.layers.1.self_attn.k_proj.weight: the build expects shape "
                       f"(32, 64) bfloat16 (shard 0 of 2 along dim 0); {FOLDER_ADVICE}"),
    "wrong shapes": (_wrong_shapes, "{folder} does not fit the draft tiny_kimi_k3_drafter of tiny_kimi_k3 as rank 0 of 2 "
                     f"builds it; {FOLDER_ADVICE}. 2 problems with the checkpoint:\n"
                     "  model.layers.0.mlp.gate.weight: expected shape (8, 64), found (4, 64)\n"
                     "  lm_head.weight: expected shape (512, 64) (shard 0 of 2 along dim 0), found (512, 32)"),
    "another drafter's config": (_another_drafters_config, (
        "{folder}/config.json describes another model than the draft tiny_kimi_k3_drafter of tiny_kimi_k3: "
        "config.num_hidden_layers is 4 in the checkpoint, 2 in the build; config.hidden_size is 128 in the checkpoint, "
        "64 in the build. Loaded, it would compute another model's logits: pass a checkpoint of the declared drafter "
        "(draft_checkpoint=DIR, --draft-checkpoint DIR), or declare this folder's config as the config of tiny_kimi_k3's "
        "[[drafts]] entry tiny_kimi_k3_drafter and generate its builds")),
    "no --draft-checkpoint": (None, f"the external draft of tiny_kimi_k3 {OWN_FOLDER}"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_drafter_folder_the_ranks_cannot_use_is_refused_before_any_rank_starts(target, tmp_path, capsys, no_ranks, case):
    make, message = REFUSED[case]
    folder = None if make is None else make(tmp_path / "drafter")
    args = _launch_args(target, NEW, folder)
    if folder is None:
        args += ["--spec-mode", "draft_target"]
    assert run.main(args) == 2
    assert capsys.readouterr().err.strip() == f"python -m generated.run: error: {message.format(folder=folder)}"
