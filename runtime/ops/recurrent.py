"""The fixed-size decode state of a recurrent token mixer (a conv window and an fp32 memory) and the rollback speculative decoding asks of it.

A recurrent layer's cache is not a buffer per position that a rejected token merely leaves stale: each
token advances it. So speculative decoding asks every cache that supports it (`keep_states(caches, n)`)
to keep, during each later forward of exactly `n` tokens (the verify block, the draft's catch-up block),
the state after each of those tokens, and after acceptance to return to one of them
(`roll_back(caches, index)`, `index` a device tensor: no host sync, fixed shapes, so the phases capture
as CUDA graphs). A forward of another length (a prefill, a one-token step) keeps nothing and leaves the
kept states as they were, so a draft can return to the same one after its one-token proposals.
"""
from __future__ import annotations

import torch


def leaves(caches):
    """The per-layer caches in `caches` (one cache, or lists of them however nested: a draft's caches hold a
    whole model's)."""
    if isinstance(caches, (list, tuple)):
        for cache in caches:
            yield from leaves(cache)
    else:
        yield caches


class RecurrentCache:
    """`conv [B, channels, kernel - 1]` (the last convolution inputs, model dtype) and `memory` (fp32, any
    shape `[B, ...]`), updated in place by the mixer's forward."""

    def __init__(self, conv: torch.Tensor, memory: torch.Tensor) -> None:
        self.conv, self.memory = conv, memory
        self.kept_steps = 0
        self.kept_conv = self.kept_memory = self.rows = None

    @property
    def advanced_in_place(self) -> tuple[torch.Tensor, ...]:
        """What a step updates from its old value (not a slot at its position): a graph's warm-up must undo it."""
        return (self.conv, self.memory)

    def keep_states(self, steps: int) -> None:
        """From now on keep the state after each token of every forward of exactly `steps` tokens."""
        if not isinstance(steps, int) or steps < 2:
            raise ValueError(f"a recurrent cache keeps the states of blocks of at least 2 tokens, got {steps!r}")
        self.kept_steps = steps
        self.kept_conv = self.conv.new_zeros(steps, *self.conv.shape)
        self.kept_memory = self.memory.new_zeros(steps, *self.memory.shape)
        self.rows = torch.arange(self.conv.shape[0], device=self.conv.device)

    def start(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state a forward at `positions` continues from: zeros when it starts at position 0 (a new
        request forgets the previous one; a multiply, not a branch, so no host sync)."""
        keep = (positions[:1] > 0).to(torch.float32)
        return self.conv * keep.to(self.conv.dtype), self.memory * keep

    def keeps(self, seq: int) -> bool:
        """Whether a forward of `seq` tokens must hand `update` the memory after each token."""
        return seq == self.kept_steps

    def update(self, window: torch.Tensor, memory: torch.Tensor, memories: torch.Tensor | None = None) -> None:
        """After a forward: `window [B, C, kernel - 1 + S]` (the previous conv inputs, then the S new ones),
        the final memory, and (when `keeps(S)`) `memories [S, B, ...]`, the memory after each token."""
        width = self.conv.shape[-1]
        self.conv.copy_(window[..., window.shape[-1] - width:])
        self.memory.copy_(memory)
        if memories is not None:
            # The conv state after token t is the `width` inputs ending at it.
            self.kept_conv.copy_(window.unfold(-1, width, 1)[:, :, 1:].permute(2, 0, 1, 3))
            self.kept_memory.copy_(memories)

    def roll_back(self, index: torch.Tensor) -> None:
        """The state after token `index` (`[1]` for every row, or `[B]`) of the last forward that kept them."""
        index = index.expand(self.rows.shape[0])
        self.conv.copy_(self.kept_conv[index, self.rows])
        self.memory.copy_(self.kept_memory[index, self.rows])


def keep_states(caches, steps: int) -> None:
    """Every cache in `caches` that can roll back keeps the state after each token of `steps`-token forwards."""
    for cache in leaves(caches):
        if hasattr(cache, "keep_states"):
            cache.keep_states(steps)


def roll_back(caches, index: torch.Tensor) -> None:
    """Every cache in `caches` that kept states returns to the one after token `index` of its last kept block
    (caches of attention layers need nothing: a position is their rollback)."""
    for cache in leaves(caches):
        if getattr(cache, "kept_steps", 0):
            cache.roll_back(index)

