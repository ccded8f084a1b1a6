"""The deployment-config JSON schema (`schemas/deploy-config.schema.json`), generated from the registry.

It accepts exactly the selections runtime validation (`registry.deploy.parse_deploy`) accepts (RULES
GN5): literals and tactics are spelled out from the registry's tokens, with Python's `str.strip()` and
`str.lower()` folded into the patterns (the exact set of characters strip() removes, every character
whose lower() is the letter), TA4 and RQ4 as conditions, and `eplb` as pydantic reads a boolean. The
patterns use only what ECMA-262 and Python's `re` read alike (no `\\s`, whose sets differ), so any
validator agrees with the runtime.
"""

from __future__ import annotations

import json
import re

from registry.deploy import MoeConfig, SpeculativeConfig
from registry.identity import FIELDS
from registry.impls import AUTO, Impl, Registry
from registry.model import SPEC_MODES

from codegen.headers import MARKER

PATH = "schemas/deploy-config.schema.json"
COMMAND = "python -m codegen schema"


# Characters outside ASCII whose str.lower() is an ASCII letter: only the Kelvin sign. A test scans
# every code point to keep this table true.
NON_ASCII_FOLDS = {"k": "\u212a"}

# Every character str.strip() removes (str.isspace()), as a regex class body. Spelled out because
# `\s` means another set in ECMA-262 (it adds U+FEFF, lacks U+001C-U+001F and U+0085). A test scans
# every code point to keep this table true.
WHITESPACE = r"\t\n\u000b\f\r\u001c-\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WS = f"[{WHITESPACE}]"
# The end of the text. Not `$`: Python's also matches before a final newline, ECMA-262's does not.
END = r"(?![\s\S])"

# The strings pydantic reads as a boolean, in any case (its lax mode; besides true/false, 0 and 1).
TRUE_STRINGS = ("1", "on", "t", "true", "y", "yes")
FALSE_STRINGS = ("0", "f", "false", "n", "no", "off")


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
    seg_any = f"[^.{WHITESPACE}]+"
    per_impl = []
    for impl in impls:
        seg = "(?:" + "|".join(_token(impl.id.segment(f)) for f in FIELDS) + r"|\*)"
        per_impl.append(f"{seg}(?:\\.{seg}){{0,3}}")
    twice = "".join(
        rf"(?!(?:{seg_any}\.)*{_token(t)}\.(?:{seg_any}\.)*{_token(t)}(?=\.|{WS}*{END}))" for t in sorted(tokens)
    )
    only_wildcards = rf"(?!\*(?:\.\*)*{WS}*{END})"
    return f"^{WS}*" + only_wildcards + twice + "(?:" + "|".join(per_impl) + f"){WS}*{END}"


def _literal_pattern(literals) -> str:
    # Literals are stripped, never case-folded: `auto` is refused (RULES RQ1).
    return f"^{WS}*(?:" + "|".join(re.escape(l) for l in literals) + f"){WS}*{END}"


def _words(words) -> str:
    return "^(?:" + "|".join("".join(f"[{c}{c.upper()}]" if c.isalpha() else c for c in w) for w in words) + ")" + END


def _boolean(description: str) -> dict:
    """A boolean as pydantic's lax mode reads one: true/false, 0/1 (0.0/1.0 too), or a yes/no word."""
    return {"anyOf": [{"type": "boolean"}, {"enum": [0, 1]}, {"type": "string", "pattern": _words(TRUE_STRINGS + FALSE_STRINGS)}],
            "description": description}


TRUTHY = {"anyOf": [{"const": True}, {"const": 1}, {"type": "string", "pattern": _words(TRUE_STRINGS)}]}


def render_schema(registry: Registry) -> str:
    tokens = registry.token_field
    eplb_impls = tuple(i for i in registry.impls if i.capabilities.dynamic_eplb)
    eplb_literals = ([AUTO] if eplb_impls else []) + sorted({i.backend for i in eplb_impls})
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
                    "eplb": _boolean(moe_fields["eplb"].description),
                },
                "allOf": [
                    {   # TA4: a tactic only next to backend AUTO (an absent backend is AUTO).
                        "if": {"properties": {"tactic": {"type": "string"}}, "required": ["tactic"]},
                        "then": {"properties": {"backend": auto_only}},
                    },
                    {   # RQ4: under dynamic EPLB only implementations that consume the plans.
                        "if": {"properties": {"eplb": TRUTHY}, "required": ["eplb"]},
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
