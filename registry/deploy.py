"""The deployment's MoE selection as users write it: `moe_config`, `speculative_config`, dynamic EPLB.

pydantic models validated when parsed (RULES TA2, TA4, RQ1, RQ4 through `registry.selection`), loadable
from a TOML or JSON file and from CLI flags, convertible to the plain `Selection` every consumer reads.
The JSON schema of these models (`schemas/deploy-config.schema.json`) is generated from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from registry.errors import MoegenError, SelectionError
from registry.impls import AUTO
from registry.inputs import read_json, read_toml
from registry.model import SPEC_MODES
from registry.selection import Selection, check_selection


def _store(value: str | None, field: str) -> str | None:
    """Tactics are stored stripped and lowercased (TA1); literals stripped."""
    if value is None:
        return None
    return value.strip().lower() if field.endswith("tactic") else value.strip()


class MoeConfig(BaseModel):
    """`moe_config`: a backend literal (a preference) or a tactic (a pin), never both but AUTO."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(default=AUTO, description="AUTO or a backend literal (TORCH, VANILLA, ...).")
    tactic: str | None = Field(
        default=None,
        description="A dotted subset of provider.technique.kernel_name.quant naming the implementations to pin; "
        "only next to backend AUTO. See docs/moe_impl_catalog.md.",
    )
    eplb: bool = Field(default=False, description="Per-layer dynamic expert load balancing.")

    @field_validator("backend", "tactic")
    @classmethod
    def _stored(cls, value, info):
        return _store(value, info.field_name)

    @model_validator(mode="after")
    def _check(self):
        check_selection(Selection(backend=self.backend, tactic=self.tactic, eplb=self.eplb))
        return self


class SpeculativeConfig(BaseModel):
    """`speculative_config`: the speculative mode and the draft's own MoE selection (RULES DR1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal[SPEC_MODES] = Field(description="The speculative decoding mode.")  # type: ignore[valid-type]
    moe_backend: str | None = Field(default=None, description="Unset: inherit the target's backend.")
    moe_tactic: str | None = Field(default=None, description="Pins the draft's MoE implementations; only next to an unset or AUTO moe_backend.")

    @field_validator("moe_backend", "moe_tactic")
    @classmethod
    def _stored(cls, value, info):
        return _store(value, info.field_name)

    @model_validator(mode="after")
    def _check(self):
        check_selection(Selection(spec_mode=self.mode, draft_backend=self.moe_backend, draft_tactic=self.moe_tactic))
        return self


class DeployConfig(BaseModel):
    """A whole deployment selection file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    moe_config: MoeConfig = MoeConfig()
    speculative_config: SpeculativeConfig | None = None

    @model_validator(mode="after")
    def _check(self):
        check_selection(self.selection())
        return self

    def selection(self) -> Selection:
        spec = self.speculative_config
        return Selection(
            backend=self.moe_config.backend,
            tactic=self.moe_config.tactic,
            eplb=self.moe_config.eplb,
            spec_mode=spec.mode if spec else None,
            draft_backend=spec.moe_backend if spec else None,
            draft_tactic=spec.moe_tactic if spec else None,
        )


def parse_deploy(data: dict, source: str = "deploy config") -> DeployConfig:
    """Validate a parsed deployment dict; errors become `SelectionError`s naming the field."""
    try:
        return DeployConfig.model_validate(data)
    except MoegenError as exc:
        if source == "command line":
            raise
        raise type(exc)(f"{source}: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        original = first.get("ctx", {}).get("error")
        if isinstance(original, MoegenError):
            raise type(original)(f"{source}: {original}") from None
        where = ".".join(str(p) for p in first["loc"]) or "(file)"
        raise SelectionError(f"{source}: {where}: {first['msg']}") from None


def load_deploy(path: Path) -> DeployConfig:
    """A deployment selection from a `.toml` or `.json` file."""
    shown = f"--config {path}"
    data = read_json(path, shown, SelectionError) if path.suffix == ".json" else read_toml(path, shown, SelectionError)[1]
    return parse_deploy(data, str(path))


def from_flags(
    backend: str | None = None,
    tactic: str | None = None,
    eplb: bool = False,
    spec_mode: str | None = None,
    draft_backend: str | None = None,
    draft_tactic: str | None = None,
    base: DeployConfig | None = None,
) -> DeployConfig:
    """CLI flags over an optional file's values: a flag given replaces that field."""
    data = (base or DeployConfig()).model_dump(exclude_none=True)
    moe = data.setdefault("moe_config", {})
    if backend is not None:
        moe["backend"] = backend
    if tactic is not None:
        moe["tactic"] = tactic
    if eplb:
        moe["eplb"] = True
    spec = data.get("speculative_config") or {}
    if spec_mode is not None:
        spec["mode"] = spec_mode
    if draft_backend is not None:
        spec["moe_backend"] = draft_backend
    if draft_tactic is not None:
        spec["moe_tactic"] = draft_tactic
    if spec:
        if "mode" not in spec:
            raise SelectionError("--draft-backend/--draft-tactic need --spec-mode: the draft they select belongs to a speculative mode")
        data["speculative_config"] = spec
    return parse_deploy(data, "command line")
