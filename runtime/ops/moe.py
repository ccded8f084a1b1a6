"""The MoE block: a router, an experts implementation and optional shared experts, summed and reduced per the layout.

The block is where the parallel layout meets the MoE: the experts object returns this rank's partial sum
(its experts, its intermediate shard; docs/runtime.md) and shared experts return their TP partial sum, so
the block owns the one reduction. With attention data parallel (`dp > 1`) each replica holds different
tokens: they are all-gathered across replicas before routing, and each replica keeps its own rows of the
reduced output.

`dep<N>` (attention data parallel, experts split over the ranks) has two exchanges. A forward outside a
decode step (prefill, a plain forward; replicas may hold different token counts) sends each (token,
expert) pair to the rank that owns the expert and back, sized by counts it exchanges and reads back
first: a host sync, so it is never captured. A decode step runs under `runtime.parallel.token_capacity`
(its batch bucket: `C` tokens per rank) and moves fixed `[C, H]` blocks instead, so it has fixed shapes
and no host sync, and captures in a CUDA graph. Its capacity is the worst case of the bucket: every
token of a rank may route to experts of every peer, so a fixed all-to-all block per peer has to hold
all `C` of them, which makes the dispatch an all-gather of the `C` rows of every rank and the combine
a reduce-scatter of the experts' partial sums; each rank's experts compute only the pairs of their own
experts. Within a bucket nothing can overflow; a forward with more tokens than the capacity is refused
before any collective, and ranks whose buckets differ are refused where the bucket is chosen
(`CausalLM.decoder`, through `runtime.parallel.check_same_tokens`), never truncated.

Submodule names are the checkpoint's, passed as keyword arguments so a template writes exactly the names
of its family: `gate` (most families) or `router` (gpt-oss); `experts`; `shared_experts` (DeepSeek, GLM)
or `shared_expert` + `shared_expert_gate` (Qwen2-MoE / Qwen3-Next). A `SigmoidTopKRouter` built with
`bias_on_block=True` gets its correction bias from the block (`block_sparse_moe.e_score_correction_bias`,
MiniMax-M2).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from runtime import parallel
from runtime.parallel import Layout


class MoEBlock(nn.Module):
    """`forward(hidden [..., H]) -> [..., H]`, the full (reduced) output for this rank's tokens."""

    def __init__(
        self,
        *,
        experts: nn.Module,
        gate: nn.Module | None = None,
        router: nn.Module | None = None,
        shared_experts: nn.Module | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        layout: Layout = Layout(),
    ) -> None:
        super().__init__()
        if (gate is None) == (router is None):
            raise ValueError("pass exactly one of gate= (most families) or router= (gpt-oss)")
        if shared_experts is not None and shared_expert is not None:
            raise ValueError("pass shared_experts= (DeepSeek/GLM) or shared_expert= (Qwen), not both")
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("shared_expert_gate= needs shared_expert=")
        shared = shared_experts if shared_experts is not None else shared_expert
        if shared is not None and getattr(getattr(shared, "down_proj", None), "reduce", False):
            raise ValueError("build shared experts with reduce_output=False: the MoE block reduces them")

        if gate is not None:
            self.gate = gate
        else:
            self.router = router
        self.experts = experts
        if shared_experts is not None:
            self.shared_experts = shared_experts
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = shared_expert_gate
        if getattr(gate, "bias_on_block", False):
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(gate.num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

        # Aliases kept in a tuple so they are not registered twice (state_dict keys stay the checkpoint's).
        self._parts = (gate if gate is not None else router, shared, shared_expert_gate)
        # Which collectives run is decided here, once, from the layout.
        self.world = layout.world
        self.dp = layout.dp
        self.tp = layout.tp

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        route = self._parts[0]
        if self.e_score_correction_bias is None:
            return route(x)
        return route(x, self.e_score_correction_bias)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self._route(x))

    def _shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        _, shared, shared_gate = self._parts
        if shared is None:
            return None
        out = shared(x)
        if shared_gate is not None:
            out = shared_gate(x) * out
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if self.dp == 1:
            # Every rank holds all tokens, and TP spans the world: routed and shared partial sums add up
            # before a single all-reduce (none at all on one rank).
            out = self._routed(x)
            shared = self._shared_out(x)
            if shared is not None:
                out = out + shared
            if self.world > 1:
                out = parallel.all_reduce(out, parallel.WORLD)
        elif self.tp == 1:
            # Attention data parallel with expert parallel (dep<N>): each rank holds its own tokens.
            capacity = parallel.capacity()
            out = self._routed_all_to_all(x) if capacity is None else self._routed_fixed(x, capacity)
            shared = self._shared_out(x)
            if shared is not None:
                out = out + shared
        else:
            # Replicas of TP groups: route everyone's tokens on every rank (equal counts per replica), sum
            # the experts' partial outputs over the world, keep this replica's rows.
            tokens = parallel.all_gather(x, dim=0, group=parallel.DP)
            routed = parallel.all_reduce(self._routed(tokens), parallel.WORLD)
            out = routed.chunk(self.dp, dim=0)[parallel.group_rank(parallel.DP)]
            shared = self._shared_out(x)
            if shared is not None:
                out = out + parallel.all_reduce(shared, parallel.TP)
        return out.reshape(shape)

    def _routed_fixed(self, x: torch.Tensor, capacity: int) -> torch.Tensor:
        """A decode step's exchange: every rank's `capacity` rows to every rank, partial sums back."""
        tokens = x.shape[0]
        if tokens > capacity:  # a shape: checked on the host, before any collective
            raise parallel.CapacityError(
                f"MoE exchange: {tokens} tokens on this rank exceed the capacity of {capacity} tokens per rank "
                f"of this decode step (its batch bucket); decode them in a bucket of at least {tokens} rows")
        if tokens < capacity:  # padding rows are routed and computed like any other, and dropped after
            x = torch.cat((x, x.new_zeros(capacity - tokens, x.shape[1])))
        # Routing is replicated (every rank holds the router), so one collective carries the rows.
        every = parallel.all_gather(x, dim=0, group=parallel.WORLD)
        partial = self._routed(every)
        return parallel.reduce_scatter(partial, dim=0, group=parallel.WORLD)[:tokens]

    def _routed_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Any other forward: each (token, expert) pair to the expert's rank and back, sized by exchanged counts."""
        ids, weights = self._route(x)
        tokens, k = ids.shape
        # Experts are split over the world in contiguous blocks, as ExpertParallel assigns them.
        per_rank = self._parts[0].weight.shape[0] // self.world
        dest = (ids // per_rank).reshape(-1)
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.world)
        recv = parallel.exchange_counts(send)
        send = send.tolist()
        rows = parallel.all_to_all(x.repeat_interleave(k, dim=0)[order], send, recv)
        pair_ids = parallel.all_to_all(ids.reshape(-1)[order], send, recv)
        pair_weights = parallel.all_to_all(weights.reshape(-1)[order], send, recv)
        # Each received row is one pair: an experts call with top-k 1 weights it by its routing weight.
        done = self.experts(rows, pair_ids[:, None], pair_weights[:, None])
        back = parallel.all_to_all(done, recv, send)
        out = torch.empty_like(back)
        out[order] = back
        return out.view(tokens, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
