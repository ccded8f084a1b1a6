"""Token embedding and LM head, both split over the vocabulary under tensor parallelism.

The vocabulary is the largest dimension of these models (129k-201k rows), so under TP each rank holds a
contiguous slice of rows: the embedding looks up only ids in its slice (zeros elsewhere) and all-reduces;
the head computes its slice of the logits and all-gathers them. With `tp_size=1` both are the plain
operations. The vocabulary must split evenly (every supported checkpoint's does for tp <= 16); padding a
ragged vocabulary is not implemented.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime import parallel
from runtime.ops.linear import new_param, split


class VocabEmbedding(nn.Module):
    """`embed_tokens`: `weight [V / tp, H]`; `forward(ids [...]) -> [..., H]`."""

    def __init__(
        self, *, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.local_vocab = split(vocab_size, tp_size, "vocab_size")
        self.start = tp_rank * self.local_vocab
        self.tp_size = tp_size
        self.weight = new_param(self.local_vocab, hidden_size, dtype=dtype, shard=(0, tp_rank, tp_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        # Ids of other ranks look up row 0 and are zeroed: no data-dependent indexing, no host sync.
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return parallel.all_reduce(rows, parallel.TP)


class LMHead(nn.Module):
    """`lm_head` (or MTP `shared_head.head`): `weight [V / tp, H]`; `forward(h [..., H]) -> logits [..., V]`."""

    def __init__(
        self, *, hidden_size: int, vocab_size: int, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        local = split(vocab_size, tp_size, "vocab_size")
        self.tp_size = tp_size
        self.weight = new_param(local, hidden_size, dtype=dtype, shard=(0, tp_rank, tp_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = parallel.all_gather(logits, dim=-1, group=parallel.TP)
        return logits
