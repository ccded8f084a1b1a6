"""A static KV cache: per-layer tensors preallocated for `max_seq_len` positions, written at given positions.

Static so that a decode step has fixed shapes and no allocation, which is what a CUDA graph needs: a
step writes its keys with `index_copy_` at the positions tensor and attends over the whole buffer, the
causal mask (built from positions, not from a Python length) hiding the slots not yet written. The cache
stores two tensors per layer whatever they are: keys and values for GQA, the compressed latent and the
rotated shared key for MLA; the attention op that creates it (`new_cache`) says their shapes.

Buffers are heads-major, `[batch, heads, max_seq_len, dim]`: the layout fused attention kernels read
without a copy (each head's keys contiguous). `packed=True` keeps both in one buffer, `second` after
`first` along the last dim (same head count), so MLA's absorbed decode reads `[latent, rotated key]` as
one key tensor without concatenating the cache.
"""
from __future__ import annotations

import torch


class StaticCache:
    """Two `[batch, heads, max_seq_len, dim]` buffers and the position of every slot (`positions = arange`)."""

    def __init__(
        self,
        *,
        batch_size: int,
        max_seq_len: int,
        first_shape: tuple[int, int],
        second_shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        packed: bool = False,
    ) -> None:
        (h1, d1), (h2, d2) = first_shape, second_shape
        if packed:
            if h1 != h2:
                raise ValueError(f"a packed cache needs one head count, got {h1} and {h2}")
            self.packed = torch.zeros(batch_size, h1, max_seq_len, d1 + d2, dtype=dtype, device=device)
            self.first, self.second = self.packed.split((d1, d2), dim=-1)
        else:
            self.packed = None
            self.first = torch.zeros(batch_size, h1, max_seq_len, d1, dtype=dtype, device=device)
            self.second = torch.zeros(batch_size, h2, max_seq_len, d2, dtype=dtype, device=device)
        self.positions = torch.arange(max_seq_len, dtype=torch.int64, device=device)

    @property
    def max_seq_len(self) -> int:
        return self.first.shape[2]

    def update(
        self, positions: torch.Tensor, first: torch.Tensor, second: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, S, heads, dim]` tensors at `positions [S]` and return the full `[B, heads, L, dim]` buffers.

        Positions must lie in `[0, max_seq_len)`; that is the caller's contract (checking it here would
        need a host sync on every step).
        """
        if self.packed is not None:
            both = torch.cat((first, second), dim=-1).to(self.packed.dtype)
            self.packed.index_copy_(2, positions, both.transpose(1, 2))
        else:
            self.first.index_copy_(2, positions, first.to(self.first.dtype).transpose(1, 2))
            self.second.index_copy_(2, positions, second.to(self.second.dtype).transpose(1, 2))
        return self.first, self.second
