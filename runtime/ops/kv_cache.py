"""A static KV cache: per-layer tensors preallocated for `max_seq_len` positions, written at given positions.

Static so that a decode step has fixed shapes and no allocation, which is what a CUDA graph needs: a
step writes its keys with `index_copy_` at the positions tensor and attends over the whole buffer, the
causal mask (built from positions, not from a Python length) hiding the slots not yet written. The cache
stores two tensors per layer whatever they are: keys and values for GQA, the compressed latent and the
rotated shared key for MLA; the attention op that creates it (`new_cache`) says their shapes.
"""
from __future__ import annotations

import torch


class StaticCache:
    """Two `[batch, max_seq_len, *shape]` buffers and the position of every slot (`positions = arange`)."""

    def __init__(
        self,
        *,
        batch_size: int,
        max_seq_len: int,
        first_shape: tuple[int, ...],
        second_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        self.first = torch.zeros(batch_size, max_seq_len, *first_shape, dtype=dtype, device=device)
        self.second = torch.zeros(batch_size, max_seq_len, *second_shape, dtype=dtype, device=device)
        self.positions = torch.arange(max_seq_len, dtype=torch.int64, device=device)

    @property
    def max_seq_len(self) -> int:
        return self.first.shape[1]

    def update(
        self, positions: torch.Tensor, first: torch.Tensor, second: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, S, ...]` tensors at `positions [S]` and return the full buffers.

        Positions must lie in `[0, max_seq_len)`; that is the caller's contract (checking it here would
        need a host sync on every step).
        """
        self.first.index_copy_(1, positions, first.to(self.first.dtype))
        self.second.index_copy_(1, positions, second.to(self.second.dtype))
        return self.first, self.second
