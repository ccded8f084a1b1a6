"""The causal-LM scaffold every generated model class extends: checks, layout, backbone and head, loading, random init.

A generated `modeling.py` states what is particular to its build (target, SM, layout, the bound
implementations, the layer plan, the tensors it does not read) and how one decoder layer is made
(`Architecture`: its layer builders); `CausalLMBuild` does the rest the same way for every build: it
refuses a device or a rank the build does not run on, joins the layout's process groups, constructs the
checkpoint's `model.*` (`Backbone`) and `lm_head`, logs what it binds (RULES LR6), checks a checkpoint and loads it. A
specialized build passes its constants; the generic build passes what it resolved at load (RULES GN1).
Forward and decoding are `runtime.decoding.CausalLM`'s.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from runtime import build
from runtime.checkpoint import CheckpointError, CheckpointReader, check_checkpoint, load_checkpoint, opened
from runtime.decoding import CausalLM
from runtime.ops import LMHead, VocabEmbedding
from runtime.parallel import Layout, attach_layout


@dataclass(frozen=True)
class Architecture:
    """How a build's decoder is made: its vocabulary and hidden sizes, and its file's layer builders
    (`make_layer(index, experts_cls or None, layout, rank, dtype)`, `make_norm(dtype)`, `make_rotary()`).
    `names`: the checkpoint's names of the backbone, its embedding and its final norm, where they are not
    `model`, `embed_tokens` and `norm` (Nemotron-H's `backbone`, `embeddings`, `norm_f`)."""

    vocab_size: int
    hidden_size: int
    make_layer: Callable
    make_norm: Callable
    make_rotary: Callable
    names: tuple[str, str, str] = ("model", "embed_tokens", "norm")


def layer_ids(runs) -> tuple[str | None, ...]:
    """A layer plan written as runs, `((range(0, 1), None), (range(1, 4), "id"), ...)`, as one id per layer."""
    ids: list[str | None] = []
    for layers, impl in runs:
        if layers.start != len(ids) or layers.step != 1:
            raise ValueError(f"a layer plan's runs cover consecutive layers from 0; {layers} follows layer {len(ids) - 1}")
        ids.extend([impl] * len(layers))
    return tuple(ids)


def check_num_layers(num_layers, total: int, owner: str, name: str = "num_layers") -> int:
    """`num_layers` as a count of the decoder layers `owner` (a build of `total` layers) can keep; `name`: how
    the caller spells the option (`--num-layers` on the command line)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral):
        raise TypeError(f"{name} takes a whole number of decoder layers from 1 to {total}, got {num_layers!r}")
    if not 1 <= num_layers <= total:
        raise ValueError(f"{name} takes a number of decoder layers from 1 to {total} ({owner} has {total}), got {num_layers}")
    return int(num_layers)


def first_layers(layers: Sequence[str | None], num_layers: int | None, ignored: Sequence[str], backbone: str, owner: str):
    """(the first `num_layers` entries of a layer plan, `ignored` plus the checkpoint names of the layers cut away):
    the build keeps the plan's order, dense layers included, and its loader skips the other layers' tensors unread."""
    if num_layers is None:
        return tuple(layers), tuple(ignored)
    keep = check_num_layers(num_layers, len(layers), owner)
    return tuple(layers[:keep]), tuple(ignored) + tuple(f"{backbone}.layers.{i}.*" for i in range(keep, len(layers)))


def held_layers(reader: CheckpointReader, backbone: str) -> int:
    """How many decoder layers a checkpoint holds: those of `<backbone>.layers.<i>` present from 0 on."""
    present = set()
    for name in reader.names():
        head, _, rest = name.partition(f"{backbone}.layers.")
        index = rest.partition(".")[0]
        if not head and index.isdigit():
            present.add(int(index))
    count = 0
    while count in present:
        count += 1
    return count


class Backbone(nn.Module):
    """The checkpoint's `model.*`: embedding, decoder layers, final norm, rotary tables."""

    def __init__(self, arch: Architecture, experts_classes, layout: Layout, rank: int, dtype: torch.dtype):
        super().__init__()
        _, embed, norm = arch.names
        setattr(self, embed, VocabEmbedding(
            vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, tp_rank=layout.tp_rank(rank), tp_size=layout.tp, dtype=dtype
        ))
        self.layers = nn.ModuleList(arch.make_layer(i, cls, layout, rank, dtype) for i, cls in enumerate(experts_classes))
        setattr(self, norm, arch.make_norm(dtype))
        self.rotary_emb = arch.make_rotary()
        if (embed, norm) != ("embed_tokens", "norm"):
            # Unregistered aliases under the names runtime.decoding reads (state_dict keeps the checkpoint's).
            self.__dict__.update(embed_tokens=getattr(self, embed), norm=getattr(self, norm))


class CausalLMBuild(CausalLM):
    """A build's model: constructed for `target` on `device` as rank `rank` of `layout`.

    `implementations`: bound id -> (experts class, backend); `cpu_impls`: the bound ids that also
    run on the host CPU; `layers`: per decoder layer its bound id, None for a dense MLP; `ignored`: the
    checkpoint tensors the build does not read (fnmatch patterns; the loader refuses any other unread one);
    `num_layers`: build only the plan's first that many layers (dense ones included), reading only their tensors
    (a smoke run of a large checkpoint, a benchmark of a few layers; None: all of them).
    """

    def __init__(
        self,
        arch: Architecture,
        *,
        target: str,
        sm: int,
        parallel: str,
        layout: Layout,
        implementations: dict,
        cpu_impls: Sequence[str],
        layers: Sequence[str | None],
        ignored: Sequence[str] = (),
        device="cpu",
        rank: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        num_layers: int | None = None,
    ):
        super().__init__()
        layers, ignored = first_layers(layers, num_layers, ignored, arch.names[0], target)
        # Only the kept layers' implementations: a cut build neither constructs nor logs (RULES LR6) the others.
        implementations = {i: impl for i, impl in implementations.items() if num_layers is None or i in layers}
        self.layout, self.ignored_tensors = layout, ignored
        build.check_placement(target, sm, device, implementations, tuple(cpu_impls), owner=self)
        # Refuses a torch.distributed world that does not fit the layout before any collective runs.
        attach_layout(self, target, parallel, layout, rank)
        build.check_rank(target, layout.world, rank)
        experts_classes = tuple(implementations[i][0] if i else None for i in layers)
        self.rank, self.device, self.dtype = rank, torch.device(device), dtype
        with torch.device(device):
            setattr(self, arch.names[0], Backbone(arch, experts_classes, layout, rank, dtype))
            self._backbone = arch.names[0]
            if arch.names[0] != "model":
                self.__dict__["model"] = getattr(self, arch.names[0])   # the alias runtime.decoding reads
            self.lm_head = LMHead(
                hidden_size=arch.hidden_size, vocab_size=arch.vocab_size, tp_rank=layout.tp_rank(rank), tp_size=layout.tp, dtype=dtype
            )
        build.log_implementations(implementations)

    def load_checkpoint(self, path, progress=None):
        """Read this rank's weights from an HF checkpoint folder (or an open `CheckpointReader`; a failed load changes
        nothing: it refuses what `check_checkpoint` refuses before the first copy)."""
        with opened(path) as reader:
            self._refuse_fewer_layers(reader)
            return load_checkpoint(self, reader, ignore=self.ignored_tensors, progress=progress, device=self.device)

    def check_checkpoint(self, path) -> None:
        """CheckpointError unless this rank's `load_checkpoint(path)` would find the folder (or open reader) fits:
        from the headers only, so a build constructed on the meta device checks a folder without allocating."""
        with opened(path) as reader:
            self._refuse_fewer_layers(reader)
            check_checkpoint(self, reader, ignore=self.ignored_tensors)

    def _refuse_fewer_layers(self, reader: CheckpointReader) -> None:
        backbone, wanted = self._backbone, len(self.model.layers)
        held = held_layers(reader, backbone)
        if 0 < held < wanted:
            # A checkpoint of fewer layers than the build (a smoke run's, a benchmark's): say so, not every missing tensor.
            span = f"{backbone}.layers.0" + (f" to {held - 1}" if held > 1 else "")
            raise CheckpointError(
                f"{reader.path} holds {held} decoder layer{'s' if held > 1 else ''} ({span}) but this build has {wanted}: "
                f"load it with num_layers={held} (or fewer), or a checkpoint of at least {wanted} layers")

    def init_random(self, seed=0):
        """Fresh seeded random weights (never zeros), for runs without a checkpoint."""
        build.init_random(self, seed)
