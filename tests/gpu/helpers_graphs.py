"""Shared by the GPU tests: a module's CUDA-graph replay equals its eager call; a model's sm_90 build on this GPU; the
CUDA memory a call allocates, and the workspaces an experts call may."""
from __future__ import annotations

import torch

from tests.runtime.helpers_experts import assert_rel_close, random_hidden, random_routing


def assert_graph_replay_matches_eager(module, spec, tokens: int, **call) -> None:
    """Capture `module(hidden, ids, weights, **call)` once, then replay it on three fresh random inputs."""
    module.debug_poison = False
    hidden = torch.empty(tokens, spec.hidden_size, dtype=torch.bfloat16, device="cuda")
    ids = torch.empty(tokens, spec.top_k, dtype=torch.long, device="cuda")
    weights = torch.empty(tokens, spec.top_k, dtype=torch.float32, device="cuda")

    def fresh(seed):
        i, w = random_routing(tokens, spec, seed=seed)
        hidden.copy_(random_hidden(tokens, spec, seed=seed + 1))
        ids.copy_(i)
        weights.copy_(w)

    fresh(42)
    module.prepare("cuda")
    # warm up on a side stream (lazy tables, autotuning) so the capture records steady-state launches only
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        module(hidden, ids, weights, **call)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(hidden, ids, weights, **call)
    for seed in (43, 44, 45):
        fresh(seed)
        graph.replay()
        eager = module(hidden, ids, weights, **call)
        torch.cuda.synchronize()
        assert_rel_close(out.float().cpu(), eager.float().cpu(), 1e-6, 1e-6)


def allocated_during(fn):
    """(fn(), peak bytes, bytes still held at the end) of the CUDA allocations made while fn runs."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base


def experts_workspace_bytes(tokens: int, spec) -> int:
    """An upper bound of what one call of a CUPY or TRITON experts module allocates besides its weights: routing ints,
    FP8 codes and scales, the bf16 intermediate, fp32 down rows (TRITON's are bf16: half that), the output."""
    pairs = tokens * spec.top_k
    return (pairs * 4 * 6 + tokens * spec.hidden_size * 2 + pairs * spec.intermediate_size * 3
            + pairs * spec.hidden_size * 4 + tokens * spec.hidden_size * 2 + pairs * 8)


def sm90_build(model: str, dtype, seed: int = 4):
    """The model's single-rank sm_90 specialized build on this GPU, with seeded random weights."""
    from tests.generated import builds

    target = next(t for t in builds.specialized(model) if builds.single_rank(t) and t["sm"] == 90)
    built = builds.load("generated" + target["module"]).MODEL_CLASS(device="cuda", dtype=dtype)
    built.init_random(seed=seed)
    return built.eval()
