"""Expert formats: what each MoE layer holds (RULES FN1) and what an MXFP4 layer runs as (FN2).

A checkpoint's quant metadata names algorithms (`NVFP4`, `MIXED_PRECISION`, ...); a layer's
*checkpoint format* is what its expert tensors are. An MXFP4 checkpoint can run as several *run
formats* (W4A16, W4A8 with FP8 or MXFP8 activations): which one is a property of the target SM and of
the implementations the request can use, never of the checkpoint.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from contract import MXFP4_RUN_FORMATS
from registry.errors import ResolutionError
from registry.impls import Impl, Registry

MIXED_PRECISION = "MIXED_PRECISION"

# quant_algo as metadata writes it -> the expert tensors' format. FP8_BLOCK_SCALES is the DeepSeek
# form (`quant_method: fp8` with `weight_block_size`); MXFP4 covers gpt-oss's `quant_method: mxfp4`.
CHECKPOINT_ALGOS = {
    "FP8_BLOCK_SCALES": "fp8_block_scales",
    "NVFP4": "nvfp4",
    "W4A16_NVFP4": "w4a16_nvfp4",
    "MXFP4": "mxfp4",
    "W4A16_MXFP4": "mxfp4",
}


def algo_format(algo: str) -> str:
    """The checkpoint format of a quant algorithm; unknown algorithms keep their own (lowercase) name,
    which no implementation serves, so they fail at resolution with the list of what exists."""
    return CHECKPOINT_ALGOS.get(algo.upper(), algo.lower())


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quant metadata as FN1 reads it (from hf_quant_config.json or quantization_config)."""

    quant_algo: str | None = None                       # None: unquantized
    exclude_modules: tuple[str, ...] = ()               # fnmatch patterns
    quantized_layers: tuple[tuple[str, str], ...] = ()  # module name or pattern -> algorithm


@dataclass(frozen=True)
class LayerFormat:
    """One MoE layer's checkpoint format and why (FN1)."""

    format: str
    source: str
    excluded: bool  # bf16 because the checkpoint leaves these experts unquantized while quantizing others


def expert_format(
    quant: CheckpointQuant,
    module: str,
    members: tuple[str, ...],
    default_routed: str | None = None,
) -> LayerFormat:
    """FN1: an exclusion wins, then a per-layer entry, then the model's default routed format or the
    global algorithm; under MIXED_PRECISION a layer no entry lists is unquantized.

    `module` is the experts' module path; `members` are names under it (e.g. `0.gate_proj`) that a
    pattern may name instead of the prefix itself.
    """
    names = (module,) + tuple(f"{module}.{m}" for m in members)
    mixed = (quant.quant_algo or "").upper() == MIXED_PRECISION
    quantizes = bool(quant.quant_algo or default_routed or quant.quantized_layers)
    # Exclusions are applied before per-layer entries (FN1): an excluded module is built unquantized
    # even when a per-layer pattern also names it, so the format reported is the one it is built in.
    # Exclusions come first: looking up per-layer entries first would report e.g. an excluded MTP layer
    # of a MIXED_PRECISION checkpoint as quantized. An unquantized checkpoint has nothing to exclude from.
    if quantizes:
        for pattern in quant.exclude_modules:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return LayerFormat("bf16", f"excluded from quantization by {pattern!r}", excluded=True)
    for key, algo in quant.quantized_layers:
        if any(fnmatch.fnmatchcase(n, key) for n in names):
            return LayerFormat(algo_format(algo), f"per-layer entry {key!r}: {algo}", excluded=False)
    if default_routed is not None:
        return LayerFormat(algo_format(default_routed), f"model default routed format {default_routed}", excluded=False)
    if quant.quant_algo and not mixed:
        return LayerFormat(algo_format(quant.quant_algo), f"checkpoint quant_algo {quant.quant_algo}", excluded=False)
    if mixed:
        return LayerFormat("bf16", "not listed under MIXED_PRECISION: unquantized", excluded=True)
    return LayerFormat("bf16", "unquantized checkpoint", excluded=False)


def publishes(impl: Impl, candidates: tuple[Impl, ...], sm: int, registry: Registry) -> bool:
    """Whether an implementation's format counts as published for FN2 on this SM.

    A backend that never degrades (VANILLA) counts only when the request holds nothing else, so an
    emulation never picks the run format; an implementation publishes only on SMs it runs on.
    """
    if not impl.runs_on(sm):
        return False
    if registry.backend(impl.backend).never_degrades:
        # "Nothing else" means nothing else that runs on this SM: a candidate that cannot run here
        # publishes nothing, so it must not silence the reference either (else AUTO on sm_80, where no
        # TORCH implementation runs, would refuse every MXFP4 checkpoint under FN2).
        return all(registry.backend(c.backend).never_degrades for c in candidates if c.runs_on(sm))
    return True


def mxfp4_run_format(candidates: tuple[Impl, ...], sm: int, registry: Registry, asked: str) -> str:
    """FN2: the SM's most preferred MXFP4 run format that the request's implementations publish.

    `asked` names the request in messages (e.g. "moe_config.tactic 'bf16'").
    """
    preference = registry.mxfp4_preference(sm)
    if preference is None:
        raise ResolutionError(
            f"no MXFP4 run formats are declared for sm_{sm}; add sm {sm} to [mxfp4_run_formats] in "
            f"{registry.source} (RULES FN2)"
        )
    published = {c.format for c in candidates if c.format in MXFP4_RUN_FORMATS and publishes(c, candidates, sm, registry)}
    for fmt in preference:
        if fmt in published:
            return fmt
    raise ResolutionError(
        f"{asked} names no MXFP4 run format that runs on sm_{sm}: the MXFP4 experts need one of "
        f"{', '.join(preference)} (RULES FN2)"
    )


def run_format(checkpoint_format: str, candidates: tuple[Impl, ...], sm: int, registry: Registry, asked: str) -> tuple[str, str]:
    """The format a layer runs as, and a short note of why (shown by `explain`)."""
    if checkpoint_format == "mxfp4":
        fmt = mxfp4_run_format(candidates, sm, registry, asked)
        return fmt, f"MXFP4 checkpoint, sm_{sm} preference{_passed_over(fmt, candidates, sm, registry)}"
    return checkpoint_format, "checkpoint format"


def _passed_over(fmt: str, candidates: tuple[Impl, ...], sm: int, registry: Registry) -> str:
    """Why the SM's more preferred MXFP4 run formats, if any, did not win (FN2), for the note above."""
    preference = registry.mxfp4_preference(sm)
    earlier = preference[:preference.index(fmt)]
    if not earlier:
        return ""
    runners = {f: sorted({c.backend for c in candidates if c.format == f and c.runs_on(sm)}) for f in earlier}
    emulated = tuple(f for f in earlier if runners[f])
    absent = tuple(f for f in earlier if not runners[f])
    verb = "comes" if len(earlier) == 1 else "come"
    pronoun = "it" if len(earlier) == 1 else "them"
    parts = []
    if emulated:
        backends = ", ".join(sorted({backend for f in emulated for backend in runners[f]}))
        which = pronoun if emulated == earlier else ", ".join(emulated)
        parts.append(f"on sm_{sm} only {backends} runs {which}, and a reference counts only alone")
    if absent:
        which = pronoun if absent == earlier else ", ".join(absent)
        parts.append(f"no implementation of the request runs {which} on sm_{sm}")
    return f": {', '.join(earlier)} {verb} first, but {'; '.join(parts)} (RULES FN2)"
