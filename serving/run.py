"""The launcher of a generated root: `python -m generated.run --model M --sm S --parallel P (--checkpoint PATH | --tiny) [--nproc N]`.

Runs a build's parallel layout on N local ranks (gloo on CPU, NCCL on CUDA; `runtime.launch` does the
launching), each rank building through `load_model(..., rank=r)` and reading only its shard of the
checkpoint; rank 0 prints a summary of the logits. This module feeds the launcher what only the registry
knows: the target's name and layout, the model's vocabulary, and which tensors a tiny random checkpoint
holds. Under torchrun it runs as the rank torchrun made it, with the same arguments:
`torchrun --nproc-per-node N -m generated.run --model M --sm S --parallel P --tiny`.
Collectives wait at most `--timeout` seconds, else MOEGEN_DIST_TIMEOUT_S, else 300.
"""

from __future__ import annotations

from runtime import launch
from contract import Layout
from serving.config_check import check_config
from serving.load import Builds, checkpoint_name_of, selection_of


class Launcher:
    """The launcher of the generated root imported as `package`: what its `run.py` shim exposes."""

    def __init__(self, package: str):
        self.builds = Builds(package)
        self.load_model = self.builds.load_model
        # Imported once by the fork server that starts CPU ranks (the registry: generic builds resolve at load).
        self.preload = (package, "registry.generic", "registry.build_index")

    def _facts(self, model):
        from registry.errors import MoegenError

        try:
            return self.builds.facts(model)
        except MoegenError as e:
            raise ValueError(str(e)) from None

    def describe(self, model, sm, parallel, checkpoint=None, checkpoint_name=None, spec_mode=None, num_layers=None,
                 moe_config=None, mode="auto", draft_checkpoint=None):
        """The run's target name and layout numbers, refused (ValueError) before any rank starts when unknown
        (or when the model has no draft for `spec_mode`, or the checkpoint's config.json describes another model
        in the `num_layers` decoder layers the run keeps).

        Under a `spec_mode`, the draft that `load_model(..., moe_config, mode)` builds is checked as the ranks'
        load_model would check it (`Builds.check_draft`; the run reads a folder, `checkpoint` or the one --tiny
        writes): refused when it keeps its weights in a folder of its own and `draft_checkpoint` is None, when
        `draft_checkpoint`'s config.json describes another drafter or its tensors do not fit the draft of some rank,
        or when it reads the outputs of target layers `num_layers` cuts away; a `draft_checkpoint` no draft would read
        is refused too."""
        from registry.errors import MoegenError
        from registry.model import facts_from_literal, layout_of
        from registry.model_resolve import resolve_model

        facts = self._facts(model)
        try:
            name = checkpoint_name_of(facts, model, checkpoint, checkpoint_name)
            layout = layout_of(parallel, {k: Layout(*v) for k, v in facts.PROFILES.items()})
            if spec_mode is not None:
                selection = selection_of(None, {"mode": spec_mode})
                resolve_model(facts_from_literal(facts.FACTS[name]), selection, sm, layout.moe_tp, layout.ep)
        except MoegenError as e:
            raise ValueError(str(e)) from None
        layers = self.builds.target_layers(model)
        if checkpoint is not None:
            check_config(facts, checkpoint, layers, num_layers)
        if spec_mode is not None:
            try:
                unread = self.builds.check_draft(model, sm, parallel, moe_config=moe_config, speculative_config={"mode": spec_mode},
                                                 checkpoint_name=name, mode=mode, draft_checkpoint=draft_checkpoint,
                                                 num_layers=num_layers)
            except MoegenError as e:
                raise ValueError(str(e)) from None
            if unread is not None and draft_checkpoint is not None:
                raise ValueError(f"--draft-checkpoint gives a draft's folder, but this run loads no draft: {unread}")
        return launch.RunTarget(
            name=f"{name}__sm_{sm}__{parallel}", parallel=parallel, layout=layout,
            vocab_size=facts.CONFIG["vocab_size"], checkpoint_name=name, num_layers=layers,
        )

    def write_tiny(self, model, sm, checkpoint_name, folder, seed=0):
        """One seeded random checkpoint of `model`, named by its one-rank generic build built on the meta device
        (names and shapes only, so even a build bound to GPU-only kernels writes it on a CPU host), plus the
        tensors of the one-rank specialized build's embedded MTP draft where it has one (the builds that do not run the
        draft ignore them, as they ignore a real checkpoint's MTP layers)."""
        from families import FAMILIES
        from registry.errors import MoegenError
        from registry.build_index import matching
        from registry.model import EMBEDDED_DRAFT_KINDS, facts_from_literal
        from runtime.checkpoint.writer import fp8_block_tensors, random_tensors, save_checkpoint

        facts = self._facts(model)
        generic = self.builds.module(self.builds.index["models"][model]["generic"])
        try:
            whole = generic.MODEL_CLASS(checkpoint=checkpoint_name, sm=sm, parallel="tp1", device="meta")
        except MoegenError as e:
            raise ValueError(str(e)) from None
        storage = FAMILIES[generic.FAMILY].experts_storage
        tensors = random_tensors(whole, storage, seed)
        for target in matching(self.builds.index, facts_from_literal(facts.FACTS[checkpoint_name]), sm, "tp1"):
            # Only an embedded MTP or draft stages keep their tensors in the target's folder (the other drafts have their own).
            if target["draft"] is not None and target["draft"]["kind"] in EMBEDDED_DRAFT_KINDS:
                draft = self.builds.module(target["draft"]["module"])
                tensors.update(random_tensors(draft.DRAFT_CLASS(device="meta"), storage, seed + 1))
        if facts.QUANT[checkpoint_name]["quant_algo"] == "FP8_BLOCK_SCALES":
            # DeepSeek's layout: its attention, dense MLP and shared-expert linears are FP8 blocks too (the builds
            # dequantize them at load, as they do a hub checkpoint's); the experts are FP8 already.
            tensors = fp8_block_tensors(tensors)
        return save_checkpoint(tensors, folder, facts.CONFIG)

    def main(self, argv=None):
        from registry.model import SPEC_MODES

        return launch.main(argv, load_model=self.load_model, describe=self.describe, write_tiny=self.write_tiny,
                           preload=self.preload, prog=f"python -m {self.builds.package}.run", spec_modes=SPEC_MODES)
