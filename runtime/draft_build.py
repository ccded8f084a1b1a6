"""The scaffold every generated `draft.py` extends: its placement and rank checks, layout, checkpoint checks, loading and random init (`DraftBuild`), and each draft kind's module.

A generated `draft.py` states what is particular to its draft (its target, SM and layout, the bound
implementations, its layer table, the tensors it does not read) and passes them here; the draft kinds
present the interface of `runtime.drafts` (RULES SD2): `MTPDraft` (embedded or replacement-head MTP
layers built from the target file's layer builders), `PredictorMTPDraft` (an MTP predictor kept as its own
tree under `mtp.`, Qwen3-Next's and Nemotron-H's), `Eagle3Draft` (an Eagle3 head), and `TokenDraft`
(an external drafter: a whole causal-LM build fed only tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from runtime import build
from runtime.causal_lm import Architecture
from runtime.checkpoint import check_checkpoint, load_checkpoint
from runtime.ops import Eagle3Head, LMHead, MTPBlock, RotaryEmbedding, VocabEmbedding
from runtime.parallel import Layout, attach_layout

log = logging.getLogger("moegen")


class DraftBuild(nn.Module):
    """A draft of `target` on `device` as rank `rank` of `layout`: refuses a device or a rank it does not
    run on (named `<target> draft` in messages); with `parallel`, joins the layout's process groups as its
    target's modeling.py does. `implementations`/`cpu_impls` are what the draft binds (id -> (experts
    class, backend)) and those that also run on the host CPU; `ignored`: the checkpoint tensors it
    does not read (fnmatch patterns)."""

    def __init__(self, *, target: str, sm: int, layout: Layout, implementations: dict, cpu_impls: Sequence[str],
                 parallel: str | None = None, ignored: Sequence[str] = (), device="cpu", rank: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        name = target + " draft"
        build.check_placement(name, sm, device, implementations, tuple(cpu_impls), owner=self)
        if parallel is not None:
            # The draft runs on its target's ranks and layout: the same world checks as modeling.py's.
            attach_layout(self, name, parallel, layout, rank)
        build.check_rank(name, layout.world, rank)
        self.ignored_tensors = tuple(ignored)
        self.rank, self.device, self.dtype = rank, torch.device(device), dtype

    def weights(self) -> nn.Module:
        """The module whose tensor names are the checkpoint's (the draft itself unless a kind says otherwise)."""
        return self

    def load_checkpoint(self, path, progress=None):
        """Read this rank's draft weights from a checkpoint folder (a failed load changes nothing)."""
        return load_checkpoint(self.weights(), path, ignore=self.ignored_tensors, progress=progress, device=self.device)

    def check_checkpoint(self, path) -> None:
        """CheckpointError unless this rank's `load_checkpoint(path)` would find the folder fits: from the headers
        only, so a draft constructed on the meta device checks a folder without allocating."""
        check_checkpoint(self.weights(), path, ignore=self.ignored_tensors)

    def init_random(self, seed=0):
        """Fresh seeded random weights (never zeros), for runs without a checkpoint."""
        build.init_random(self.weights(), seed)


def _positions(next_token_ids, positions):
    return torch.arange(next_token_ids.shape[-1], device=next_token_ids.device) if positions is None else positions


class _TargetHeadDraft(DraftBuild):
    """What both MTP kinds share: they read the target's final-norm hidden states, score the target's own
    vocabulary, and build MoE layers `layers` ((checkpoint layer index, bound implementation id) each)."""

    # What the speculative loop feeds `forward` (the draft interface every draft build presents).
    INPUT = "hidden"

    def __init__(self, *, layers, layout: Layout, **scaffold):
        super().__init__(layout=layout, **scaffold)
        self.layout, self._layers = layout, tuple(layers)

    def draft_layer_ids(self):
        """(checkpoint layer index, bound implementation id) of each MoE layer this draft built."""
        return self._layers

    def to_target_ids(self, ids):
        """An MTP scores the target's own vocabulary."""
        return ids


class MTPDraft(_TargetHeadDraft):
    """MTP layers (embedded in the target's checkpoint, or a replacement head), each named as the
    checkpoint's `model.layers.<index>` (embedded draft stages: `model.<tree>.<k>`, `stages`): `x = eh_proj(cat([enorm(embed(token[t+1])), hnorm(h[t])]))`, the
    target family's decoder layer (`arch.make_layer`), `shared_head` for the logits, its own embedding copy.

    `forward(next_token_ids [B, S], target_hidden [B, S, H], positions [S], cache, step=0) -> (logits, hidden)`:
    `target_hidden` is the target's `hidden_states(...)` of the previous positions, after its final norm,
    as the reference engines pass it. `layers`: (checkpoint layer index, bound implementation id) per MTP layer.
    """

    def __init__(self, arch: Architecture, rms_norm_eps: float, *, layers, layout: Layout, implementations: dict,
                 rank: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu", stages: tuple[str, int] | None = None,
                 **scaffold):
        super().__init__(layers=layers, layout=layout, implementations=implementations, device=device, rank=rank,
                         dtype=dtype, **scaffold)
        # Embedded draft stages (RULES DR7), `stages = (tree, first index)`: the same MTP-like layers, chained the
        # same way, named `model.<tree>.<k>` with k = index - first index (DeepSeek-V4-Flash's `model.draft_stages.<k>`).
        tree, first = stages if stages is not None else ("layers", 0)
        with torch.device(device):
            self.model = nn.Module()
            self.model.add_module(tree, nn.ModuleDict(
                {str(i - first): _mtp_layer(arch, rms_norm_eps, i, implementations[impl][0], layout, rank, dtype) for i, impl in layers}
            ))
            self.rotary_emb = arch.make_rotary()
        self.blocks = tuple(getattr(self.model, tree)[str(i - first)] for i, _ in layers)
        build.log_implementations(implementations)

    def new_caches(self, batch_size, max_seq_len):
        return [
            block.self_attn.new_cache(batch_size=batch_size, max_seq_len=max_seq_len, dtype=self.dtype, device=self.device)
            for block in self.blocks
        ]

    def forward(self, next_token_ids, target_hidden, positions=None, cache=None, step=0):
        """Draft step `step` runs MTP layer `step` (chained layers), then reuses them cyclically, as the reference engines do."""
        positions = _positions(next_token_ids, positions)
        block = self.blocks[step % len(self.blocks)]
        cos, sin = self.rotary_emb(positions)
        # `cache` is this step's entry of `new_caches()` (runtime.speculative passes `caches[step % len]`).
        hidden = block(block.embed_tokens(next_token_ids), target_hidden, positions, cos, sin, cache)
        return block.shared_head(hidden), hidden


def _mtp_layer(arch: Architecture, rms_norm_eps, index, experts_cls, layout, rank, dtype):
    """One MTP block named as the checkpoint's `model.layers.<index>`, with its own embedding copy."""
    tp_rank = layout.tp_rank(rank)
    block = MTPBlock(
        hidden_size=arch.hidden_size, vocab_size=arch.vocab_size, rms_norm_eps=rms_norm_eps,
        decoder_layer=arch.make_layer(index, experts_cls, layout, rank, dtype), tp_rank=tp_rank, tp_size=layout.tp, dtype=dtype,
    )
    block.add_module("embed_tokens", VocabEmbedding(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, tp_rank=tp_rank, tp_size=layout.tp, dtype=dtype))
    return block


class PredictorMTPDraft(_TargetHeadDraft):
    """An MTP predictor kept as its own tree under `mtp.` (Qwen3-Next, Nemotron-H: `runtime.ops.FcMTPPredictor`,
    `PatternMTPPredictor`), built by the target file's `make_mtp(experts classes, layout, rank, dtype)`. These
    checkpoints store no embedding or head copy for the MTP: loaded alone, the draft reads its own copies of the
    target's `<backbone>.<embedding>` and `lm_head` from the same folder (its tensor names are the checkpoint's);
    `load_model` makes it use the target's own modules instead (`share_with`), as vLLM's Qwen3NextMTP and NemotronHMTP do.

    `forward(next_token_ids [B, S], target_hidden [B, S, H], positions [S], cache, step=0) -> (logits, hidden)`,
    `target_hidden` the target's final-norm hidden states, `hidden` the predictor's final-norm output (what the
    next step reads). `layers`: (checkpoint layer index, bound implementation id) per draft MoE layer.
    """

    def __init__(self, arch: Architecture, make_mtp, *, layers, layout: Layout, implementations: dict, rank: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", **scaffold):
        super().__init__(layers=layers, layout=layout, implementations=implementations, device=device, rank=rank,
                         dtype=dtype, **scaffold)
        backbone, embedding, _ = arch.names
        tp_rank = layout.tp_rank(rank)
        with torch.device(device):
            self.mtp = make_mtp([implementations[impl][0] for _, impl in layers], layout, rank, dtype)
            self.add_module(backbone, nn.Module())
            getattr(self, backbone).add_module(embedding, VocabEmbedding(
                vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, tp_rank=tp_rank, tp_size=layout.tp, dtype=dtype))
            self.lm_head = LMHead(hidden_size=arch.hidden_size, vocab_size=arch.vocab_size, tp_rank=tp_rank, tp_size=layout.tp,
                                  dtype=dtype)
            self.rotary_emb = arch.make_rotary()
        self._embedding = (backbone, embedding)
        # Unregistered alias `forward` embeds with: the checkpoint-named module above, or the target's (`share_with`).
        self.__dict__["embed_tokens"] = getattr(getattr(self, backbone), embedding)
        build.log_implementations(implementations)

    def share_with(self, target) -> bool:
        """Embed and score with `target`'s own `embed_tokens` and `lm_head` modules instead of this draft's copies.

        Why: these checkpoints keep one embedding and one head, which the MTP reads as the target does; two copies
        cost their bytes twice (about 1.2 GB for Qwen3-Next in bf16) and a second read at load. Call before loading:
        the copies are dropped and their checkpoint names ignored, so `load_checkpoint`/`init_random` neither read nor
        touch them (the target loads them). Where a copy would differ in shape, dtype, device or tensor-parallel shard,
        the draft keeps its copies and logs why. Returns whether it shares them."""
        backbone, embedding = self._embedding
        pairs = ((f"{backbone}.{embedding}", self.embed_tokens, target.model.embed_tokens), ("lm_head", self.lm_head, target.lm_head))
        for name, own, theirs in pairs:
            why = _unshareable(own, theirs)
            if why is not None:
                log.info("the MTP draft keeps its own copies of the embedding and lm_head: the target's %s %s", name, why)
                return False
        delattr(self, backbone)   # it held only the embedding
        del self.lm_head
        self.__dict__.update(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
        self.ignored_tensors += tuple(f"{name}.weight" for name, _, _ in pairs)
        return True

    def new_caches(self, batch_size, max_seq_len):
        return self.mtp.new_caches(batch_size=batch_size, max_seq_len=max_seq_len, dtype=self.dtype, device=self.device)

    def forward(self, next_token_ids, target_hidden, positions=None, cache=None, step=0):
        positions = _positions(next_token_ids, positions)
        cos, sin = self.rotary_emb(positions)
        # `cache` is this step's entry of `new_caches()` (runtime.speculative passes `caches[step % len]`).
        hidden = self.mtp(self.embed_tokens(next_token_ids), target_hidden, step, positions, cos, sin, cache)
        return self.lm_head(hidden), hidden


def _unshareable(own: nn.Module, theirs: nn.Module) -> str | None:
    """Why `theirs` cannot stand in for `own` (None when it can): another kind of module, or another weight."""
    if type(own) is not type(theirs):
        return f"is a {type(theirs).__name__}, not a {type(own).__name__}"
    a, b = own.weight, theirs.weight
    for what in ("shape", "dtype", "device"):
        if getattr(a, what) != getattr(b, what):
            return f"has {what} {getattr(b, what)}, the draft's {getattr(a, what)}"
    if getattr(a, "shard", None) != getattr(b, "shard", None):
        return f"is tensor-parallel shard {getattr(b, 'shard', None)}, the draft's {getattr(a, 'shard', None)}"
    return None


class Eagle3Draft(DraftBuild):
    """An Eagle3 head (`runtime.ops.eagle3`) of shape `head` with its layer's rotary `rope`.

    `forward(next_token_ids [B, S], target_hidden [B, S, 3 H_target] at step 0 (the target's AUX_LAYERS states,
    concatenated) or the head's own hidden [B, S, H] after, positions [S], caches, step=0) -> (logits [B, S, V_draft], hidden)`.
    Published Eagle3 checkpoints name their tensors without the `head.` prefix this module adds.
    """

    # What the speculative loop feeds `forward` (the draft interface every draft build presents).
    INPUT = "aux_hidden"

    def __init__(self, head: dict, rope: dict, *, device="cpu", dtype: torch.dtype = torch.bfloat16, **scaffold):
        super().__init__(device=device, dtype=dtype, **scaffold)
        with torch.device(device):
            self.head = Eagle3Head(**head, dtype=dtype)
            self.rotary_emb = RotaryEmbedding(**rope)

    def weights(self) -> nn.Module:
        return self.head

    def new_caches(self, batch_size, max_seq_len):
        attention = self.head.midlayer.self_attn
        return [attention.new_cache(batch_size=batch_size, max_seq_len=max_seq_len, dtype=self.dtype, device=self.device)]

    def forward(self, next_token_ids, target_hidden, positions=None, cache=None, step=0):
        positions = _positions(next_token_ids, positions)
        cos, sin = self.rotary_emb(positions)
        return self.head(next_token_ids, target_hidden, positions, cos, sin, cache, step)

    def to_target_ids(self, ids):
        return self.head.to_target_ids(ids)

    def share_embedding(self, target):
        """Embed with the target build's `embed_tokens` (for heads whose checkpoint ships none); call before loading."""
        self.head.share_embedding(target.model.embed_tokens)


class TokenDraft:
    """Mixed into an external drafter's causal-LM build: it reads only its own tokens (`INPUT`) and shares the
    target's vocabulary (checked when the declaration loaded). `load_model` hands it to the speculative loop
    through `runtime.drafts.ExternalDrafter`, which holds the prompt's first token too (the draft interface's
    entry `i` is its position `i + 1`)."""

    # What the speculative loop feeds it (the draft interface every draft build presents).
    INPUT = "tokens"

    def to_target_ids(self, ids):
        return ids
