"""The per-token math of speculative decoding, on the device with no host sync: nucleus probabilities, exponential-race draws, near ties, and speculative-sampling acceptance."""
from __future__ import annotations

import torch


def near_ties(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """`[..., V]` logits -> booleans `[...]`: the top two are within `eps` of the larger magnitude (at least
    1), where another rounding of the same computation may swap the argmax (RULES SD1 in bf16)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1] <= eps * top[..., 0].abs().clamp_min(1.0)


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """fp32 probabilities `[..., V]` of the tempered top-p nucleus (as `decoding.sample` draws from), in id order."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the most likely id always stays).
    ordered = ordered.masked_fill(ordered.cumsum(dim=-1) - ordered >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One id per row of `probs [..., V]`: argmax(p / E), E ~ Exp(1), draws i with probability p_i (no host sync)."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


def accept_sampled(p: torch.Tensor, q: torch.Tensor, proposals: torch.Tensor, generator):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for rows that share positions.

    `p [B, k+1, V]` the target's distributions at the k+1 verified positions, `q [B, k, V]` the draft's,
    `proposals [B, k]` drawn from `q`. Proposal j of a row is accepted with probability
    `min(1, p_j(d) / q_j(d))`; `a` is the smallest count of leading acceptances over the rows. At index `a`
    a row that accepted its proposal there keeps it; one that rejected it draws from the residual
    `max(0, p_a - q_a)` renormalized, and at `a = k` every row draws from `p_k`: each kept token is a draw
    from the target's distribution. Returns the kept ids `[B, k+1]` (valid through `a`) and `a` `[1]`.
    """
    batch, k = proposals.shape
    pick = proposals.unsqueeze(-1)
    accepted = torch.rand(batch, k, device=p.device, generator=generator) * q.gather(-1, pick).squeeze(-1) \
        < p[:, :k].gather(-1, pick).squeeze(-1)
    agree = accepted.long().cumprod(dim=1).sum(dim=1)
    kept = agree.min().view(1)
    at = kept.view(1, 1).expand(batch, 1)
    p_at = p.gather(1, at.unsqueeze(-1).expand(batch, 1, p.shape[-1])).squeeze(1)
    q_full = torch.cat((q, q.new_zeros(batch, 1, q.shape[-1])), dim=1)  # the bonus position: residual = p_k
    q_at = q_full.gather(1, at.unsqueeze(-1).expand(batch, 1, q.shape[-1])).squeeze(1)
    residual = (p_at - q_at).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)  # p == q: never rejected
    padded = torch.cat((proposals, proposals[:, -1:]), dim=1)
    token = torch.where(agree > kept, padded.gather(1, at).squeeze(1), draw(residual, generator))
    return padded.scatter(1, at, token.unsqueeze(1)), kept
