"""`load_model` of a generated root: it picks, through the build index, the build that serves a deployment, and builds and loads it.

It reads the root's `_build_index.INDEX`: a target's specialized build when it claims the
selection, is bound to what the selection resolves to and holds the draft its speculative mode needs (the
decision `explain` narrates), else the model's generic build (mode `auto`), or an error naming the
criterion that did not match (`require`); `off` always uses the generic build (RULES TG5, TG6). A root
may be imported under any name (`generate --out`): `Builds` is given it, and imports the root's modules
relative to it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

log = logging.getLogger("moegen")


class HeldDraft(NamedTuple):
    """The draft a chosen build constructs for a speculative mode: its kind and its module (DRAFT, DRAFT_CLASS; a
    specialized build's `draft.py` when the build is specialized, else the generic build's, resolved at load)."""

    kind: str
    module: ModuleType


def selection_of(moe_config, speculative_config):
    """A Selection from registry.deploy objects, plain dicts, or None."""
    from registry.selection import Selection, check_selection

    def get(obj, name, default=None):
        if obj is None:
            return default
        return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)

    return check_selection(
        Selection(
            backend=get(moe_config, "backend", "AUTO"),
            tactic=get(moe_config, "tactic"),
            eplb=bool(get(moe_config, "eplb", False)),
            spec_mode=get(speculative_config, "mode"),
            draft_backend=get(speculative_config, "moe_backend"),
            draft_tactic=get(speculative_config, "moe_tactic"),
        )
    )


def _layer_formats(facts, quant):
    """Every MoE layer's (index, checkpoint format) under `quant` (RULES FN1), target and draft layers."""
    from registry.formats import expert_format

    sites = list(facts["sites"]) + [site for draft in facts["drafts"] for site in draft["sites"]]
    return sorted((layer, expert_format(quant, module, ()).format) for layer, module, *_ in sites)


def checkpoint_name_of(facts_module, model, checkpoint, checkpoint_name):
    """The declared checkpoint a folder is: the one whose quant metadata it carries, else the one
    whose MoE layers its metadata gives the same formats (producers spell exclusions differently:
    DeepSeek's config.json lists none where the declaration names the router it leaves in bf16)."""
    from registry.errors import SelectionError
    from registry.formats import CheckpointQuant
    from registry.quant_meta import read_checkpoint_quant

    names = sorted(facts_module.FACTS)
    if checkpoint_name is not None:
        if checkpoint_name not in names:
            raise SelectionError(f"{model} has no checkpoint {checkpoint_name!r}; declared: {', '.join(names)}")
        return checkpoint_name
    if checkpoint is not None:
        found, source = read_checkpoint_quant(Path(checkpoint))
        declared = {}
        for name in names:
            q = facts_module.QUANT[name]
            declared[name] = CheckpointQuant(q["quant_algo"], tuple(q["exclude_modules"]), tuple(tuple(e) for e in q["quantized_layers"]))
        same = [name for name in names if declared[name] == found]
        if not same:
            same = [
                name for name in names
                if _layer_formats(facts_module.FACTS[name], found) == _layer_formats(facts_module.FACTS[name], declared[name])
            ]
        if len(same) == 1:
            return same[0]
        what = "matches none" if not same else f"matches several ({', '.join(same)})"
        raise SelectionError(
            f"the quant metadata of {checkpoint} ({source}) {what} of {model}'s declared checkpoints "
            f"({', '.join(names)}); pass checkpoint_name=, or declare it (python -m codegen import-checkpoint)"
        )
    if len(names) == 1:
        return names[0]
    raise SelectionError(f"{model} has several checkpoints ({', '.join(names)}): pass checkpoint= or checkpoint_name=")


class Builds:
    """The builds of the generated root imported as `package` (e.g. `generated`), read through its index."""

    def __init__(self, package: str):
        self.package = package

    def __reduce__(self):
        # Pickled by name: a rank process (runtime.launch) imports the root again rather than receiving its index.
        return Builds, (self.package,)

    @functools.cached_property
    def index(self) -> dict:
        return importlib.import_module(f"{self.package}._build_index").INDEX

    def module(self, relative: str):
        """One of the root's modules, named as the index names it (`.<model>.<target>.modeling`)."""
        return importlib.import_module(relative, self.package)

    def facts(self, model):
        """The model's generated facts module, refused (SelectionError) when the root has no build of it."""
        from registry.errors import SelectionError

        if model not in self.index["models"]:
            raise SelectionError(f"no generated build of model {model!r}; generated: {', '.join(sorted(self.index['models']))}")
        return self.module(self.index["models"][model]["facts"])

    def target_layers(self, model) -> int:
        """The decoder layers of `model` (its generic build's layer plan, the same in every build of it)."""
        return self.module(self.index["models"][model]["generic"]).NUM_TARGET_LAYERS

    def load_model(
        self,
        model,
        sm,
        parallel="tp1",
        moe_config=None,
        speculative_config=None,
        checkpoint=None,
        checkpoint_name=None,
        device="cpu",
        mode="auto",
        rank=0,
        seed=0,
        dtype=None,
        draft_checkpoint=None,
        num_layers=None,
    ):
        """Build `model` for (checkpoint, sm, parallel) and load its weights (a checkpoint folder, or random).

        `draft_checkpoint`: the folder of a draft that keeps its weights apart from the target's (an external
        drafter, an Eagle3 head, a replacement MTP head); an embedded MTP draft reads `checkpoint`. An external
        drafter's folder is compared with the drafter's declared config, and any draft folder's headers with what this
        rank's draft reads (`check_draft`), before the target's weights load.

        `dtype` is the build's activation and parameter dtype (default: the build's own, bfloat16).
        `device="meta"` without a checkpoint builds the structure only, allocating nothing.
        `num_layers=N` builds only the first N decoder layers of the layer plan (dense ones included, in its
        order) and reads only their tensors: a checkpoint may hold more layers, never fewer; a draft still
        reads its own tensors where they are (an embedded MTP layer at the full model's index).
        Returns the model (a torch module); under a neural speculative mode its draft build is `model.draft`
        (`model.generate(..., speculative=k)` decodes with it). Raises a moegen error naming what did not match under `require`.
        """
        choice = self._choose(model, sm, parallel, moe_config, speculative_config, checkpoint, checkpoint_name, mode)
        facts_module, name, selection, chosen, _ = choice
        module = self.module(chosen.module)
        for reason in chosen.reasons:
            # Falling back is allowed, silently falling back is not (RULES TG5); `off` asked for it.
            log.log(logging.INFO if mode == "off" else logging.WARNING, "%s; loading the generic build %s", reason, module.__name__)
        if checkpoint is not None:
            from serving.config_check import check_config

            # Before the build allocates its parameters: over the decoder layers it keeps (num_layers).
            check_config(facts_module, checkpoint, self.target_layers(model), num_layers)
            if draft_checkpoint is not None:
                # The draft's own folder too (this rank's draft, from the headers), before the target's weights load:
                # for a real model that load takes minutes, and the draft's would fail only after it.
                self._check_draft(model, sm, parallel, choice, draft_checkpoint, num_layers, ranks=(rank,))
        extra = {} if dtype is None else {"dtype": dtype}
        if chosen.kind == "specialized":
            built = module.MODEL_CLASS(device=device, rank=rank, num_layers=num_layers, **extra)
        else:
            built = module.MODEL_CLASS(
                checkpoint=name, sm=sm, parallel=parallel, selection=selection, device=device, rank=rank, num_layers=num_layers, **extra
            )
        if checkpoint is not None:
            built.load_checkpoint(checkpoint)
        elif str(device) != "meta":
            # On meta the build is its structure only (which build serves, what it binds): no values to draw.
            built.init_random(seed)
        if selection.spec_mode is not None:
            from runtime.speculative import attach_draft

            attach_draft(built, *self._load_draft(built, model, name, sm, parallel, chosen, selection, checkpoint, draft_checkpoint,
                                                  device, rank, seed, extra))
        return built

    def _choose(self, model, sm, parallel, moe_config, speculative_config, checkpoint, checkpoint_name, mode):
        """(the model's facts module, the declared checkpoint's name, the selection, the BuildChoice, the layout): the
        build `load_model` loads for these arguments, chosen through the build index (nothing is built)."""
        from contract import Layout
        from registry.build_index import pick_build
        from registry.model import facts_from_literal, layout_of

        facts_module = self.facts(model)
        name = checkpoint_name_of(facts_module, model, checkpoint, checkpoint_name)
        facts = facts_from_literal(facts_module.FACTS[name])
        profiles = {k: Layout(*v) for k, v in facts_module.PROFILES.items()}
        layout = layout_of(parallel, profiles)
        selection = selection_of(moe_config, speculative_config)
        return facts_module, name, selection, pick_build(self.index, facts, sm, parallel, layout, selection, mode), layout

    def check_draft(self, model, sm, parallel="tp1", moe_config=None, speculative_config=None, checkpoint_name=None,
                    mode="auto", draft_checkpoint=None, num_layers=None, ranks=None):
        """What `load_model(checkpoint=<a folder>, ...)` with these arguments refuses of its draft, checked before any
        weight is allocated or read (a launcher checks it before its ranks start), in the order load_model refuses it: a
        `draft_checkpoint` whose config.json describes another drafter (serving.config_check.check_draft_config), a
        draft that reads the outputs of target layers `num_layers` cuts away, a draft that keeps its weights in a
        folder of its own without `draft_checkpoint`, a `draft_checkpoint` whose tensors do not fit the draft of some
        rank (serving.draft_folder.check_draft_tensors: each rank's draft, or each of `ranks`, built on the meta
        device). Returns None when the chosen build loads a draft, else why it decodes without one (then nothing
        reads `draft_checkpoint`)."""
        choice = self._choose(model, sm, parallel, moe_config, speculative_config, None, checkpoint_name, mode)
        return self._check_draft(model, sm, parallel, choice, draft_checkpoint, num_layers, ranks)

    def _check_draft(self, model, sm, parallel, choice, draft_checkpoint, num_layers, ranks):
        """`check_draft` for the build `_choose` gave (`choice`): load_model checks the draft of the build it loads."""
        facts_module, name, selection, chosen, layout = choice
        if selection.spec_mode is None:
            return "no speculative_config.mode: decoded with the target alone"
        held, why = self._held_draft(model, chosen, selection.spec_mode)
        if held is None:
            return why
        if draft_checkpoint is not None:
            from serving.config_check import check_draft_config

            check_draft_config(facts_module, held.module.DRAFT, draft_checkpoint)
        from runtime.causal_lm import check_num_layers

        total = self.target_layers(model)
        try:
            kept = total if num_layers is None else check_num_layers(num_layers, total, model)
        except (TypeError, ValueError):
            kept = total  # a count out of range is refused on its own (--num-layers, or the target build's construction)
        self._refuse_unkept_aux(held, model, kept)
        if draft_checkpoint is None:
            self._refuse_without_own_folder(held.kind, model)
            return None
        from serving.draft_folder import check_draft_tensors

        check_draft_tensors(self._draft_class(held, chosen, name, sm, parallel, selection), layout.world, draft_checkpoint,
                            draft=held.module.DRAFT, model=model, ranks=ranks)
        return None

    def _held_draft(self, model, chosen, mode):
        """(the HeldDraft the chosen build constructs for the speculative `mode`, None), or (None, why the build decodes
        without one)."""
        from registry.model import NON_NEURAL_MODES

        if mode in NON_NEURAL_MODES:
            return None, f"speculative_config.mode {mode!r} has no neural draft: decoded with the target alone"
        if chosen.kind == "specialized":
            # The build index picked this build only because it holds the draft of this mode (RULES TG6).
            held = next(t["draft"] for t in self.index["targets"] if t["name"] == chosen.target)
            return HeldDraft(held["kind"], self.module(held["module"])), None
        generic = self.index["models"][model]["generic_draft"]
        if generic is None or mode not in generic["modes"]:
            return None, f"the generic build of {model} constructs no draft for mode {mode!r}: decoded with the target alone"
        return HeldDraft(generic["kind"], self.module(generic["module"])), None

    @staticmethod
    def _refuse_unkept_aux(held: HeldDraft, model, kept: int) -> None:
        """SelectionError when the held draft (an Eagle3 head) reads the outputs of target layers that a build of the
        first `kept` decoder layers cuts away. Read off the draft's class, not a built draft: a launcher refuses it
        before any rank starts, a rank before it allocates the draft."""
        aux, kind = tuple(getattr(held.module.DRAFT_CLASS, "AUX_LAYERS", ())), held.kind
        if aux and max(aux) >= kept:
            from registry.errors import SelectionError

            raise SelectionError(f"the {kind} draft of {model} reads the outputs of target layers {', '.join(map(str, aux))}; "
                                 f"num_layers={kept} keeps layers 0 to {kept - 1}: pass num_layers={max(aux) + 1} or more")

    def _refuse_without_own_folder(self, kind, model) -> None:
        """SelectionError for a draft of `kind` loaded from a checkpoint without a folder of its own, unless it is an
        embedded MTP draft or draft stages (they read the target's folder; RULES SD3)."""
        from registry.errors import SelectionError
        from registry.model import EMBEDDED_DRAFT_KINDS

        if kind not in EMBEDDED_DRAFT_KINDS:
            raise SelectionError(f"the {kind} draft of {model} keeps its weights in a folder of its own: pass "
                                 f"draft_checkpoint=DIR to load_model (--draft-checkpoint DIR to python -m {self.package}.run)")

    @staticmethod
    def _draft_class(held: HeldDraft, chosen, name, sm, parallel, selection):
        """The held draft's class, given what it is built with besides device, rank and dtype: a specialized build's
        draft states everything; the generic draft resolves its layers at load under the draft's own selection (DR1, DR2)."""
        if chosen.kind == "specialized":
            return held.module.DRAFT_CLASS
        return functools.partial(held.module.DRAFT_CLASS, checkpoint=name, sm=sm, parallel=parallel, selection=selection)

    def _load_draft(self, target, model, name, sm, parallel, chosen, selection, checkpoint, draft_checkpoint, device, rank, seed, extra):
        """(the draft build of `target` the speculative mode needs, None) or (None, why the build decodes without one):
        an embedded MTP draft or draft stages read the target's checkpoint folder, every other kind `draft_checkpoint` (RULES SD3)."""
        held, why = self._held_draft(model, chosen, selection.spec_mode)
        if held is None:
            return None, why
        kind, module = held.kind, held.module
        build = functools.partial(self._draft_class(held, chosen, name, sm, parallel, selection), device=device, rank=rank,
                                  **extra)
        if draft_checkpoint is not None and checkpoint is None:
            from serving.config_check import check_draft_config

            # The draft's own folder, before the draft allocates its parameters (an external drafter's config); a load
            # from a checkpoint folder checked it before the target's weights (`_check_draft`).
            check_draft_config(self.facts(model), module.DRAFT, draft_checkpoint)
        self._refuse_unkept_aux(held, model, len(target.model.layers))
        draft = build()
        own = draft_checkpoint
        if own is None and checkpoint is not None:
            self._refuse_without_own_folder(kind, model)
            own = checkpoint
        if hasattr(draft, "share_with"):
            # An MTP predictor reads the target's embedding and head: the target's own modules when both come
            # from one folder (or are both random), else its own copies.
            same = own == checkpoint if None in (own, checkpoint) else Path(own).resolve() == Path(checkpoint).resolve()
            if same:
                draft.share_with(target)
            else:
                log.info("the MTP draft reads %s, not the target's folder: it keeps its own embedding and lm_head", own)
        if own is not None:
            draft.load_checkpoint(own)
        elif str(device) != "meta":  # on meta a build is its structure only
            draft.init_random(seed)
        return draft.eval(), None

