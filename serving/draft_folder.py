"""Refuses a draft's own folder whose tensors do not fit the draft every rank builds, before any rank starts.

Without it a launcher starts its ranks, each loads the target (hundreds of GB for a real model), and only
then does the draft's load find a tensor missing or of another shape: every rank fails with exit 1 after
the slowest part of the run. The check reads the folder's headers once and builds each rank's draft on the
meta device (names, shapes and shards only), so it costs milliseconds; what it refuses is exactly what each
rank's `load_checkpoint` would (runtime.checkpoint.check_checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.checkpoint import CheckpointError, CheckpointReader

ADVICE = "pass a checkpoint of the declared draft (draft_checkpoint=DIR, --draft-checkpoint DIR)"


def check_draft_tensors(make_draft: Callable, world: int, folder, *, draft: str, model: str, ranks=None) -> None:
    """CheckpointError unless `folder` holds what the draft `draft` of `model` reads on each of `ranks` (default: all
    `world` ranks; `make_draft(device=, rank=)` builds one rank's draft): every tensor in its shape and dtype, none
    that no parameter reads. The message names the first rank that would refuse it and all that rank's problems."""
    with CheckpointReader(folder) as reader:   # a folder it cannot read is refused here, in the reader's words
        for rank in range(world) if ranks is None else ranks:
            try:
                make_draft(device="meta", rank=rank).check_checkpoint(reader)
            except CheckpointError as e:
                head = f"{folder} does not fit the draft {draft} of {model}"
                head += f" as rank {rank} of {world} builds it" if world > 1 else ""
                said = f"{head}: {e}; {ADVICE}" if len(e.problems) == 1 else f"{head}; {ADVICE}. {e}"
                raise CheckpointError(said) from None
