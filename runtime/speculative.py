"""Speculative decoding (RULES SD1-SD3): a draft proposes `k` tokens, the target verifies them in one forward over its static cache, and the agreeing prefix plus the target's own next token is kept.

One round, for every row at once (the rows share positions, so a round keeps the smallest agreeing
prefix over the rows; each row's kept tokens are still its target's own tokens; the draft interface is
in runtime/drafts.py, the acceptance math in runtime/acceptance.py):

1. draft phase: one forward over the previous verify block (`k + 1` entries: catches the draft's cache
   up with what the target accepted, and gives the first proposal at the accepted index), then `k - 1`
   one-token steps;
2. verify phase: the target runs `[next token, k proposals]` at positions `pos .. pos + k`, takes its
   argmax at each, counts the leading proposals equal to it (`a`), emits its own tokens `0 .. a`, and
   moves `pos` by `a + 1`. Sampled decoding accepts by speculative sampling instead (`accept_sampled`).

Rollback is a position for attention caches: both caches are static, so the slots of rejected tokens
are rewritten by the next round before any query reaches them, and every attention mask hides keys after
the query (`attention_core.allowed_keys`), so a stale slot is never attended. A recurrent layer's cache
(Gated DeltaNet, Mamba-2: runtime/ops/recurrent.py) keeps the state after each token of every `k + 1`
block instead, and each phase returns it to the one after the last accepted token (`roll_back`, indexed
by the device tensor of the accepted count): the target's after its verify, the draft's after its
catch-up block and again after its one-token proposals, which the next catch-up block recomputes. Both phases read and write only
fixed device buffers with fixed shapes, so on CUDA each is captured once as a CUDA graph and replayed;
the only host sync is reading `a` once per round (to emit that many tokens and know when to stop).
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from runtime.acceptance import accept_sampled, draw, near_ties, nucleus
from runtime.decoding import Generation, batch_bucket, length_bucket, owner, sync
from runtime.drafts import ExternalDrafter, draft_input, vocab_size
from runtime.experts.base import ExpertsBase
from runtime.graphs import advanced_in_place, capture
from runtime.ops.recurrent import keep_states, leaves, roll_back

log = logging.getLogger("moegen")

@dataclass(frozen=True)
class Speculation:
    """What `generate(..., speculative=...)` takes: `draft_tokens` (k) proposals per round, from `draft`
    (default: the draft `load_model` attached to the target)."""

    draft_tokens: int
    draft: object = None


@dataclass
class SpeculativeGeneration(Generation):
    """A `Generation` plus the draft's record (SD3): proposals made and accepted (per row, summed over
    rounds), target verify steps, and `note` when no draft ran."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    near_ties: int = 0      # greedy: kept tokens whose target top-2 logits were within tie_eps(target) (SD1)
    note: str | None = None

    @property
    def acceptance_length(self) -> float:
        """Tokens each target verify step yields: accepted proposals plus its own token, per round."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        # Generated tokens after the first (which prefill yields) over decode time, as Generation's.
        made = self.tokens.shape[0] * (self.new_tokens.shape[1] - 1)
        return made / self.decode_s if self.decode_s > 0 else float("nan")

    def report(self) -> str:
        if self.note is not None:
            return self.note
        return (f"speculative: {self.rounds} target steps, {self.proposed} proposed, {self.accepted} accepted "
                f"({self.accepted / max(1, self.proposed):.1%}), acceptance length {self.acceptance_length:.2f}, "
                f"{self.near_ties} near-tie tokens")


def tie_eps(model: nn.Module) -> float:
    """The eps of the coarsest dtype `model`'s GEMMs take operands in: its own, or its experts' (bf16 for every
    implementation but VANILLA in fp32). A tie within it may break either way between the verify block and
    a one-token step, so an fp32 build with bf16 experts reports bf16's ties (SD1)."""
    dtypes = {model.dtype} | {type(m).plain_dtype(model.dtype) for m in model.modules() if isinstance(m, ExpertsBase)}
    return max(torch.finfo(dtype).eps for dtype in dtypes)


class SpeculativeDecoder:
    """Target and draft caches for `batch_size` rows of `max_seq_len` positions, and the two phases of a
    round (captured as CUDA graphs on CUDA, eager elsewhere). Greedy: the draft proposes its argmax and
    the target keeps its own argmax, so the output is the target's own greedy output (SD1). Sampled
    (`temperature > 0`, top-p): the draft draws from its nucleus and `accept_sampled` keeps each token as
    a draw from the target's."""

    def __init__(self, target, draft, k: int, batch_size: int, max_seq_len: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the draft proposes at least 1 token per round (--draft-tokens), got {k!r}")
        self._target, self.draft, self.k = weakref.ref(target), draft, k   # the target owns this decoder
        self.input = draft_input(draft)
        self.aux_layers = tuple(getattr(draft, "AUX_LAYERS", ())) if self.input == "aux_hidden" else ()
        self.to_target = getattr(draft, "to_target_ids", None)
        device = target.device
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.draft_caches = draft.new_caches(batch_size, max_seq_len)
        if any(hasattr(cache, "keep_states") for cache in leaves(self.draft_caches[1:])):
            raise ValueError(f"{type(draft).__name__}'s caches of draft steps after the first are recurrent: only a "
                             "draft's first cache (its catch-up block's) rolls back; let every draft step share that one")
        self.target_caches = target.new_caches(batch_size, max_seq_len)   # after the refusal: the larger allocation
        # Recurrent layers keep the state after each token of a k + 1 block: the verify and catch-up blocks.
        keep_states(self.target_caches, k + 1)
        keep_states(self.draft_caches, k + 1)
        ids = dict(dtype=torch.int64, device=device)
        self.offsets = torch.arange(k + 1, **ids)
        self.tokens = torch.zeros(batch_size, k + 1, **ids)      # verify input: next token, then proposals
        self.pos = torch.zeros(1, **ids)                          # position of tokens[:, 0]
        self.emitted = torch.zeros(batch_size, k + 1, **ids)     # the target's tokens of the last verify
        self.kept = torch.zeros(1, **ids)                         # a: proposals accepted in the last verify
        self.ties = torch.zeros(batch_size, **ids)                # per row: near-tie tokens kept so far
        self.tie_eps = tie_eps(target)
        self.draft_tokens = torch.zeros(batch_size, k + 1, **ids)  # the draft's catch-up block
        self.draft_pos = torch.zeros(1, **ids)
        self.draft_sel = torch.zeros(1, **ids)
        self.draft_hidden = None                                  # [B, k+1, *]: allocated at prefill
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        # Sampling (temperature > 0): the draft's distributions over the target vocabulary, and the draws'
        # generator (reseeded per call; registered with the graphs that draw from it).
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device=device) if temperature > 0 else None
        self.draft_probs = None                                   # [B, k, V_target]
        self.vocab_map = None                                     # draft id -> target id, for the probabilities

    @property
    def target(self):
        return owner(self._target, "speculative decoder")

    def _target_forward(self, ids, positions, last: bool = False):
        """Logits (of the last position only with `last`) and what the draft reads (final-norm hidden states,
        aux layer outputs, or None)."""
        if self.aux_layers:
            final, aux = self.target.hidden_states(ids, positions, self.target_caches, aux_layers=self.aux_layers)
        else:
            final = self.target.hidden_states(ids, positions, self.target_caches)
            aux = final if self.input == "hidden" else None
        return self.target.lm_head(final[:, -1:] if last else final), aux

    def _propose(self, logits, step):
        """Draft step `step`'s target ids `[B, S]`: its argmax, or (sampling) a draw from its nucleus, whose
        probabilities over the target vocabulary it keeps for the verify phase."""
        if self.generator is None:
            ids = logits.argmax(dim=-1)
            return ids if self.to_target is None else self.to_target(ids)
        probs = nucleus(logits[:, -1], self.temperature, self.top_p)
        if self.to_target is not None:
            if self.vocab_map is None:  # set in the eager warm-up, before any capture
                self.vocab_map = self.to_target(torch.arange(probs.shape[-1], device=probs.device))
            mapped = probs.new_zeros(probs.shape[0], vocab_size(self.target))
            probs = mapped.index_add_(1, self.vocab_map, probs)
        if self.draft_probs is None:
            self.draft_probs = probs.new_zeros(probs.shape[0], self.k, probs.shape[-1])
        self.draft_probs[:, step] = probs
        return draw(probs, self.generator)[:, None]

    def _draft_cache(self, step):
        return self.draft_caches[step % len(self.draft_caches)]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Both caches from position 0 with `[batch_size, n]` prompts; returns the target's next ids `[B]`."""
        batch, n = input_ids.shape
        if batch != self.batch_size or n + self.k + 1 > self.max_seq_len:
            raise ValueError(f"this decoder takes {self.batch_size} rows of at most {self.max_seq_len - self.k - 1} "
                             f"tokens, got {list(input_ids.shape)}")
        logits, hidden = self._target_forward(input_ids, torch.arange(n, device=input_ids.device), last=True)
        if self.generator is None:
            token = logits[:, -1].argmax(dim=-1)
        else:
            token = draw(nucleus(logits[:, -1], self.temperature, self.top_p), self.generator)
        if hasattr(self.draft, "prefill"):
            self.draft.prefill(input_ids, hidden, self.draft_caches)
        elif n > 1:  # entries 0 .. n-2; entry n-1 (it needs `token`) opens the first round's catch-up block
            self.draft.forward(input_ids[:, 1:], hidden[:, :-1], torch.arange(n - 1, device=input_ids.device),
                               self._draft_cache(0), step=0)
        if hidden is not None:
            if self.draft_hidden is None:  # once: the captured phases read this buffer
                self.draft_hidden = hidden.new_zeros(batch, self.k + 1, hidden.shape[-1])
            self.draft_hidden.zero_()
            self.draft_hidden[:, 0] = hidden[:, -1]
        self.ties.zero_()
        if self.generator is None:
            self.ties.add_(near_ties(logits[:, -1:], self.tie_eps).sum(dim=1))
        self.draft_tokens.zero_()
        self.draft_tokens[:, 0] = token
        self.draft_pos.fill_(n - 1)
        self.draft_sel.zero_()
        self.tokens[:, 0] = token
        self.pos.fill_(n)
        return token

    def _draft_phase(self) -> None:
        """Catch-up block at `draft_pos`, first proposal at its entry `draft_sel`, then `k - 1` steps."""
        logits, hidden = self.draft.forward(
            self.draft_tokens, self.draft_hidden, self.draft_pos + self.offsets, self._draft_cache(0), step=0)
        roll_back(self._draft_cache(0), self.draft_sel)   # recurrent layers: to the state after entry draft_sel
        token = self._propose(logits.index_select(1, self.draft_sel), 0)       # [B, 1]
        hidden = hidden.index_select(1, self.draft_sel)
        self.tokens[:, 1:2] = token
        position = self.draft_pos + self.draft_sel
        for step in range(1, self.k):
            position = position + 1
            logits, hidden = self.draft.forward(
                token, None if self.input == "tokens" else hidden, position, self._draft_cache(step), step=step)
            token = self._propose(logits, step)
            self.tokens[:, step + 1:step + 2] = token
        if self.k > 1:  # the next catch-up block starts after entry draft_sel, not after the proposals
            roll_back(self._draft_cache(0), self.draft_sel)

    def _verify_phase(self) -> None:
        """Target over `tokens` at `pos .. pos + k`; accept, emit, and set up the draft's next catch-up."""
        positions = self.pos + self.offsets
        logits, hidden = self._target_forward(self.tokens, positions)
        if self.generator is None:
            ours = logits.argmax(dim=-1)                                       # [B, k+1]
            agree = (self.tokens[:, 1:] == ours[:, :-1]).long().cumprod(dim=1).sum(dim=1)
            kept = agree.min().view(1)
            self.ties.add_((near_ties(logits, self.tie_eps) & (self.offsets <= kept)).sum(dim=1))
        else:
            ours, kept = accept_sampled(nucleus(logits, self.temperature, self.top_p), self.draft_probs,
                                        self.tokens[:, 1:], self.generator)
        self.kept.copy_(kept)
        roll_back(self.target_caches, kept)                 # recurrent layers: to the state after token a
        self.emitted.copy_(ours)
        # The catch-up block: entry j is position pos + j reading the token at pos + j + 1, which is the
        # token kept there (for j < a the accepted proposal; j = a the target's own next token).
        self.draft_tokens.copy_(ours)
        if self.draft_hidden is not None:
            self.draft_hidden.copy_(hidden)
        self.draft_pos.copy_(self.pos)
        self.draft_sel.copy_(kept)
        self.tokens[:, :1] = ours.gather(1, kept.view(1, 1).expand(self.batch_size, 1))
        self.pos.add_(kept + 1)

    def _run(self, name: str, phase) -> None:
        owner(self._target, "speculative decoder")   # the phases, and their graphs, read the target's weights
        if self.tokens.device.type != "cuda":
            phase()
            return
        if name not in self.graphs:
            self.graphs[name] = self._capture(phase)
        self.graphs[name].replay()

    def _capture(self, phase) -> torch.cuda.CUDAGraph:
        # The warm-up's draws must not advance the generator either, or a seeded run that captures
        # would draw other numbers than one that only replays: `capture` restores it too.
        state = [self.tokens, self.pos, self.emitted, self.kept, self.ties, self.draft_tokens,
                 self.draft_pos, self.draft_sel] + ([self.draft_hidden] if self.draft_hidden is not None else [])
        state += [*advanced_in_place(self.target_caches), *advanced_in_place(self.draft_caches)]
        return capture(phase, state, self.generator)[0]

    @torch.no_grad()
    def round(self) -> tuple[torch.Tensor, int]:
        """One draft phase and one verify phase: the target's emitted ids `[B, a + 1]` and `a`."""
        self._run("draft", self._draft_phase)
        self._run("verify", self._verify_phase)
        kept = int(self.kept)  # the round's one host sync
        return self.emitted[:, :kept + 1].clone(), kept


def speculative_decoder(target, draft, k: int, batch_size: int, max_seq_len: int, temperature: float = 0.0,
                        top_p: float = 1.0) -> SpeculativeDecoder:
    """The decoder of the bucket (as `CausalLM.decoder`), made once per target, draft, k and sampling."""
    key = (id(draft), k, batch_bucket(batch_size), length_bucket(max_seq_len + k + 1), temperature, top_p)
    decoders = target.__dict__.setdefault("_speculative_decoders", {})
    if key not in decoders:
        decoders[key] = SpeculativeDecoder(target, draft, k, key[2], key[3], temperature, top_p)
    return decoders[key]


def attach_draft(target, draft, note: str | None = None) -> None:
    """Make `draft` the target's default draft (`target.draft`), kept out of the target's module tree so
    its parameters, state dict and checkpoint loading stay the target's own; without one, `note` says why
    (what a speculative `generate` then logs and reports)."""
    if isinstance(draft, nn.Module) and getattr(draft, "INPUT", None) == "tokens":
        draft = ExternalDrafter(draft, target)   # an external drafter's build is a causal LM of its own
    target.__dict__["draft"] = draft
    target.__dict__["draft_note"] = note


@torch.no_grad()
def generate(target, input_ids: torch.Tensor, max_new_tokens: int, speculative, *, temperature: float,
             top_p: float, eos_token_id: int | None, seed: int) -> SpeculativeGeneration:
    """`target.generate` with a draft (it has checked the sampling arguments): `speculative` is a
    `Speculation` or the number of draft tokens k (the draft then is `target.draft`). Without a draft,
    decodes with the target alone and says so."""
    if not isinstance(speculative, Speculation):
        speculative = Speculation(speculative)
    k = speculative.draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the draft proposes at least 1 token per round (--draft-tokens), got {k!r}")
    draft = speculative.draft if speculative.draft is not None else getattr(target, "draft", None)
    if draft is None:
        note = getattr(target, "draft_note", None) or (
            f"{type(target).__name__} was loaded without a draft (no speculative_config.mode): "
            "decoded with the target alone")
        log.warning("%s", note)
        out = target.generate(input_ids, max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, seed=seed)
        return SpeculativeGeneration(out.tokens, out.prompt_len, out.prefill_s, out.decode_s, out.decode_steps,
                                     note=note)
    batch, seq = input_ids.shape
    decoder = speculative_decoder(target, draft, k, batch, seq + max_new_tokens, temperature,
                                  top_p if temperature > 0 else 1.0)
    if decoder.generator is not None:
        decoder.generator.manual_seed(seed)
    device = decoder.tokens.device
    ids = input_ids.to(device)
    if decoder.batch_size > batch:  # pad to the bucket with copies of the last row, dropped at the end
        ids = torch.cat((ids, ids[-1:].expand(decoder.batch_size - batch, seq)))

    sync(device)
    start = time.perf_counter()
    out = [decoder.prefill(ids)[:, None]]
    sync(device)
    prefilled = time.perf_counter()
    made, rounds, accepted = 1, 0, 0
    finished = out[0][:batch, 0] == eos_token_id if eos_token_id is not None else None
    while made < max_new_tokens:
        if finished is not None and bool(finished.all()):
            break
        emitted, kept = decoder.round()
        out.append(emitted)
        if finished is not None:
            finished |= (emitted[:batch] == eos_token_id).any(1)
        made += kept + 1
        rounds += 1
        accepted += kept
    sync(device)
    done = time.perf_counter()
    tokens = torch.cat(out, dim=1)[:batch, :max_new_tokens].cpu()
    if eos_token_id is not None:  # rows that reached EOS continue with it, as target-only generate does
        after = (tokens == eos_token_id).long().cumsum(1) > 0
        tokens = tokens.masked_fill(after, eos_token_id)
    return SpeculativeGeneration(torch.cat((input_ids.cpu(), tokens), dim=1), seq, prefilled - start,
                                 done - prefilled, rounds, rounds=rounds, proposed=rounds * k, accepted=accepted,
                                 near_ties=int(decoder.ties[:batch].sum()))
