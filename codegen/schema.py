"""The deployment-config JSON schema (`schemas/deploy-config.schema.json`), generated from the registry.

It accepts exactly the selections runtime validation accepts (RULES GN5): literals and tactics are
spelled out from the registry's tokens, with Python's `str.strip()` and `str.lower()` folded into the
patterns (whitespace around the value, any case of each letter), TA4 and RQ4 as conditions.
"""

from __future__ import annotations

import json
import re

from registry.deploy import MoeConfig, SpeculativeConfig
from registry.identity import FIELDS
from registry.impls import AUTO, Impl, Registry
from registry.model import SPEC_MODES

from codegen.files import MARKER

PATH = "schemas/deploy-config.schema.json"
COMMAND = "python -m codegen schema"


# Characters outside ASCII whose str.lower() is an ASCII letter: only the Kelvin sign. A test scans
# every code point to keep this table true.
NON_ASCII_FOLDS = {"k": "\u212a"}


def folded(char: str) -> str:
    """A regex class of every character whose lower() is `char` (k: k, K and the Kelvin sign)."""
    variants = sorted({char, char.upper()} | set(NON_ASCII_FOLDS.get(char, "")))
    if len(variants) == 1:
        return re.escape(char)
    return "[" + "".join(variants) + "]"


def _token(token: str) -> str:
    return "".join(folded(c) for c in token)


def tactic_pattern(impls: tuple[Impl, ...], tokens: dict[str, str]) -> str:
    """Segments of one implementation's tokens or `*`, at most four, no token twice, not only `*`."""
    seg_any = r"[^.\s]+"
    per_impl = []
    for impl in impls:
        seg = "(?:" + "|".join(_token(impl.id.segment(f)) for f in FIELDS) + r"|\*)"
        per_impl.append(f"{seg}(?:\\.{seg}){{0,3}}")
    twice = "".join(
        rf"(?!(?:{seg_any}\.)*{_token(t)}\.(?:{seg_any}\.)*{_token(t)}(?=\.|\s*$))" for t in sorted(tokens)
    )
    only_wildcards = r"(?!\*(?:\.\*)*\s*$)"
    return r"^\s*" + only_wildcards + twice + "(?:" + "|".join(per_impl) + r")\s*$"


def _literal_pattern(literals) -> str:
    return r"^\s*(?:" + "|".join(re.escape(l) for l in literals) + r")\s*$"


def render_schema(registry: Registry) -> str:
    tokens = registry.token_field
    eplb_impls = tuple(i for i in registry.impls if i.capabilities.dynamic_eplb)
    eplb_literals = ([AUTO] if eplb_impls else []) + sorted({i.family for i in eplb_impls})
    tactic = {"type": "string", "pattern": tactic_pattern(registry.impls, tokens)}
    auto_only = {"type": "string", "pattern": _literal_pattern([AUTO])}
    moe_fields = MoeConfig.model_fields
    spec_fields = SpeculativeConfig.model_fields
    schema = {
        "$comment": f"{MARKER} Regenerate: {COMMAND}",
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "moegen deployment selection",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "moe_config": {"$ref": "#/$defs/MoeConfig"},
            "speculative_config": {"anyOf": [{"$ref": "#/$defs/SpeculativeConfig"}, {"type": "null"}]},
        },
        "$defs": {
            "MoeConfig": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "backend": {"type": "string", "pattern": _literal_pattern(registry.literals), "description": moe_fields["backend"].description},
                    "tactic": {"anyOf": [tactic, {"type": "null"}], "description": moe_fields["tactic"].description},
                    "eplb": {"type": "boolean", "description": moe_fields["eplb"].description},
                },
                "allOf": [
                    {   # TA4: a tactic only next to backend AUTO (an absent backend is AUTO).
                        "if": {"properties": {"tactic": {"type": "string"}}, "required": ["tactic"]},
                        "then": {"properties": {"backend": auto_only}},
                    },
                    {   # RQ4: under dynamic EPLB only implementations that consume the plans.
                        "if": {"properties": {"eplb": {"const": True}}, "required": ["eplb"]},
                        "then": {
                            "properties": {
                                "backend": {"type": "string", "pattern": _literal_pattern(eplb_literals) if eplb_literals else "(?!)"},
                                "tactic": {"anyOf": [{"type": "string", "pattern": tactic_pattern(eplb_impls, tokens) if eplb_impls else "(?!)"}, {"type": "null"}]},
                            }
                        },
                    },
                ],
            },
            "SpeculativeConfig": {
                "type": "object",
                "additionalProperties": False,
                "required": ["mode"],
                "properties": {
                    "mode": {"enum": list(SPEC_MODES), "description": spec_fields["mode"].description},
                    "moe_backend": {"anyOf": [{"type": "string", "pattern": _literal_pattern(registry.literals)}, {"type": "null"}], "description": spec_fields["moe_backend"].description},
                    "moe_tactic": {"anyOf": [tactic, {"type": "null"}], "description": spec_fields["moe_tactic"].description},
                },
                "allOf": [
                    {   # TA4 for drafts: a draft tactic only next to an unset or AUTO moe_backend.
                        "if": {"properties": {"moe_tactic": {"type": "string"}}, "required": ["moe_tactic"]},
                        "then": {"properties": {"moe_backend": {"anyOf": [auto_only, {"type": "null"}]}}},
                    }
                ],
            },
        },
    }
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
