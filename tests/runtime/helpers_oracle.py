"""Giving an op of ours and its transformers twin the same fresh random weights (the oracle's module sets the names)."""
from __future__ import annotations

import torch


@torch.no_grad()
def randomise_and_copy(theirs, ours, seed):
    """Fresh weights for `theirs` (norm scales near 1, the rest small), copied into `ours`, which must hold
    exactly the same parameter names."""
    g = torch.Generator().manual_seed(seed)
    for name, t in theirs.named_parameters():
        fresh = torch.randn(t.shape, generator=g)
        t.copy_((1.0 + 0.2 * fresh if "norm" in name else 0.15 * fresh).to(t.dtype))
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == {n for n, _ in theirs.named_parameters()}
    for name, t in theirs.named_parameters():
        ours_params[name].copy_(t)
