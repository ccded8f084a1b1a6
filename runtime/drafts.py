"""The draft interface (RULES SD2): what a draft build declares and presents, and `ExternalDrafter`, which presents a whole causal-LM build of the same vocabulary that way.

Every draft build presents:

- `INPUT`: `"hidden"` (embedded MTP: the target's final-norm hidden states, what its head reads),
  `"aux_hidden"` (Eagle3: the outputs of the target layers `AUX_LAYERS`, concatenated), or `"tokens"`
  (an external drafter: tokens only; `ExternalDrafter` wraps a whole `CausalLM` build this way);
- `new_caches(batch_size, max_seq_len)`: a list of caches; draft step `j` uses `caches[j % len]`;
- `forward(next_token_ids [B, S], target_hidden [B, S, *] | None, positions [S], cache, step=0)
  -> (logits [B, S, V_draft], hidden [B, S, H])`: the entry at position `i` reads the token at `i + 1`
  and the target's hidden state at `i`, and predicts the token at `i + 2`; later steps read the
  draft's own hidden output instead of the target's;
- `to_target_ids(ids)`: draft-vocabulary ids to target ids (identity when absent).
"""
from __future__ import annotations

import torch

INPUTS = ("hidden", "aux_hidden", "tokens")


def vocab_size(model) -> int:
    """A CausalLM build's vocabulary (all tensor-parallel shards of its embedding)."""
    embed = model.model.embed_tokens
    return embed.local_vocab * embed.tp_size


class ExternalDrafter:
    """A whole `CausalLM` build (same tokenizer) as a draft: fed only tokens, its entry `i` of the draft
    interface is its own position `i + 1` (it reads the token there and predicts the next)."""

    INPUT = "tokens"

    def __init__(self, model, target) -> None:
        ours, theirs = vocab_size(target), vocab_size(model)
        if ours != theirs:
            raise ValueError(
                f"the external drafter {type(model).__name__} has a vocabulary of {theirs} ids and the target "
                f"{type(target).__name__} of {ours}: a drafter must share the target's tokenizer (RULES SD2)")
        self.model = model

    def new_caches(self, batch_size, max_seq_len):
        # One position more than the interface's: the drafter also holds the prompt's first token.
        return [self.model.new_caches(batch_size, max_seq_len + 1)]

    def prefill(self, input_ids, target_hidden, caches):
        """The whole prompt at the drafter's positions `0 .. n-1` (the interface's `-1 .. n-2`)."""
        self.model(input_ids, torch.arange(input_ids.shape[1], device=input_ids.device), caches[0])

    def forward(self, next_token_ids, target_hidden, positions, cache, step=0):
        hidden = self.model.hidden_states(next_token_ids, positions + 1, cache)
        return self.model.lm_head(hidden), hidden


def draft_input(draft) -> str:
    """The draft's declared INPUT, refused unless it is one of INPUTS."""
    kind = getattr(draft, "INPUT", None)
    if kind not in INPUTS:
        raise ValueError(f"{type(draft).__name__}.INPUT is {kind!r}; a draft declares one of {', '.join(INPUTS)}")
    return kind
