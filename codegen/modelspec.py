"""A declaration's `[config]`, typed and checked for what its family template reads, then normalized (registry.normal_config) into the constants the template inlines.

The normalization itself lives in the registry, pure Python, so that loading a build can normalize a
checkpoint's config.json alike without pydantic; typing (pydantic) and the render's own refusals stay here.
"""

from __future__ import annotations

from codegen.errors import GenerationError
from registry import configs, normal_config
from registry.declarations import field_path


def normalize(family: str, config: dict, source: str = "the declaration") -> dict:
    """Defaults filled in, head_dim and rotary parameters resolved, one attention window per layer.

    `config` is typed again here (a declaration's already is; a config.json read by import-checkpoint
    is not yet): nothing `normal_config.normalize` reads has a value of the wrong type or range."""
    try:
        config = configs.validate_config(family, config)
    except configs.ConfigError as exc:
        raise GenerationError(f"{source}: {field_path(('config',) + exc.key)}: {exc}") from None
    # Keys only the template reads have no default: a declaration may leave them out until it renders.
    missing = [k for k in configs.template_keys(family) if config.get(k) is None]
    if missing:
        raise GenerationError(f"{source}: [config] lacks {', '.join(missing)}, which the {family} template reads; add it")
    return normal_config.normalize(family, config)
