"""The deployment-config JSON schema accepts exactly what runtime validation accepts (RULES GN5).

The oracle is `registry.deploy.parse_deploy` (what moegen itself does with a config file); the schema
is checked with `jsonschema`'s Draft 2020-12 validator over a written corpus and a hypothesis stream
of tactics, literals and fields in every spelling. The two tables the schema folds Python's
`str.strip()` and `str.lower()` into are checked against every code point.
"""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.schema import NON_ASCII_FOLDS, WHITESPACE, render_schema
from registry.deploy import parse_deploy
from registry.errors import MoegenError
from registry.impls import load_registry
from registry.model import SPEC_MODES

REGISTRY = load_registry()
VALIDATOR = jsonschema.Draft202012Validator(json.loads(render_schema(REGISTRY)))
TOKENS = sorted(REGISTRY.token_field)


def runtime_accepts(data) -> bool:
    try:
        parse_deploy(data)
    except MoegenError:
        return False
    return True


def schema_accepts(data) -> bool:
    return VALIDATOR.is_valid(data)


def moe(**fields):
    return {"moe_config": fields}


def spec(**fields):
    return {"speculative_config": fields}


# (deployment dict, accepted?) — the expectation pins both sides, so they cannot agree by both being wrong.
CORPUS = [
    ({}, True),
    (moe(), True),
    (moe(tactic="torch.eager"), True),
    (moe(tactic="eager.torch"), True),                       # any order (TA1)
    (moe(tactic="EAGER.Torch"), True),                       # any case
    (moe(tactic=" \t eager.torch \n"), True),                # stripped
    (moe(tactic="\u00a0eager\u2003"), True),                 # str.strip() removes Unicode spaces too
    (moe(tactic="\x1ceager\x85"), True),                     # ... and these, which ECMA's \s does not
    (moe(tactic="\ufeffeager"), False),                      # ... but not U+FEFF, which ECMA's \s does
    (moe(tactic="eager\u200b"), False),                      # a zero-width space is not whitespace
    (moe(tactic="*.eager"), True),                           # wildcards
    (moe(tactic="torch.*.*.bf16"), True),
    (moe(tactic="torch.eager.loop.bf16"), True),
    (moe(tactic="*"), False),                                # wildcard-only (TA2)
    (moe(tactic="*.*.*"), False),
    (moe(tactic="eager.eager"), False),                      # a field twice, same token
    (moe(tactic="eager.grouped_mm"), False),                 # a field twice, two tokens
    (moe(tactic="eager.bogus"), False),                      # unknown token
    (moe(tactic="torch.eager.loop.bf16.*"), False),          # more than four segments
    (moe(tactic="torch..eager"), False),                     # empty segment
    (moe(tactic=""), False),
    (moe(tactic="   "), False),
    (moe(tactic="grouped_mm.nvfp4"), False),                 # tokens that exist, no implementation has both
    (moe(tactic="fp8_bloc\u212a_scales"), True),             # the Kelvin sign lowers to k
    (moe(tactic="FP8_BLOC\u212a_SCALES.EAGER"), True),
    (moe(tactic="eager", backend="TORCH"), False),           # tactic next to a non-AUTO backend (TA4)
    (moe(tactic="eager", backend="AUTO"), True),             # explicit AUTO
    (moe(tactic="eager", backend=" AUTO\n"), True),
    (moe(tactic=None, backend="TORCH"), True),               # TA4 reads the value, not the field
    (moe(backend="auto"), False),                            # literals are not case-folded (RQ1)
    (moe(backend="Torch"), False),
    (moe(backend="BOGUS"), False),
    (moe(backend=" VANILLA "), True),
    (moe(backend=None), False),
    (moe(eplb=True, tactic="grouped_mm"), True),             # RQ4: matches an EPLB implementation
    (moe(eplb=True, tactic="eager"), False),                 # RQ4: matches none
    (moe(eplb=True, tactic="eager.bf16"), False),
    (moe(eplb=True, backend="VANILLA"), False),              # RQ4: a backend with no EPLB implementation
    (moe(eplb=True, backend="TORCH"), True),
    (moe(eplb="yes", tactic="eager"), False),                # pydantic reads "yes" as true ...
    (moe(eplb="off", tactic="eager"), True),                 # ... and "off" as false
    (moe(eplb=1.0), True),
    (moe(eplb=2), False),
    (moe(eplb=" true"), False),
    (moe(eplb=None), False),
    (moe(unknown=1), False),                                 # extra fields are forbidden
    ({"moe_config": None}, False),
    ({"unknown": {}}, False),
    ({"speculative_config": None}, True),
    (spec(mode="mtp"), True),
    (spec(mode="MTP"), False),
    (spec(mode="bogus"), False),
    (spec(moe_tactic="eager"), False),                       # mode is required
    (spec(mode="mtp", moe_tactic="eager", moe_backend="TORCH"), False),   # TA4 for drafts
    (spec(mode="mtp", moe_tactic="eager", moe_backend="AUTO"), True),
    (spec(mode="mtp", moe_tactic="eager", moe_backend=None), True),
    (spec(mode="mtp", moe_tactic="eager.bogus"), False),
    (spec(mode="ngram", moe_tactic="eager"), True),          # DR4: accepted, ignored at resolution
    (spec(mode="mtp", moe_backend="auto"), False),
    ({**moe(eplb=True), **spec(mode="mtp", moe_tactic="eager")}, True),   # the draft is not an EPLB request
]


@pytest.mark.parametrize("data, accepted", CORPUS, ids=[json.dumps(d, ensure_ascii=True)[:60] for d, _ in CORPUS])
def test_the_schema_and_runtime_validation_agree_on_the_corpus(data, accepted):
    # RULES GN5, TA1, TA2, TA4, RQ1, RQ4
    assert (runtime_accepts(data), schema_accepts(data)) == (accepted, accepted)


_SPACES = ["", " ", "\t", "\n", "\u00a0", "\u2003", "\x1c", "\x85", "\ufeff", "\u200b"]


def _spell(token: str, draw) -> str:
    style = draw(st.sampled_from(["as is", "upper", "title", "mixed", "kelvin"]))
    if style == "upper":
        return token.upper()
    if style == "title":
        return token.title()
    if style == "mixed":
        flips = draw(st.lists(st.booleans(), min_size=len(token), max_size=len(token)))
        return "".join(c.upper() if f else c for c, f in zip(token, flips))
    if style == "kelvin":
        return token.replace("k", "\u212a")
    return token


@st.composite
def tactics(draw):
    pool = TOKENS + ["*", "*", "bogus", "", "grouped", "TORCH", "bf 16", "loop.", "\u0130"]
    count = draw(st.integers(1, 6))
    segments = [_spell(draw(st.sampled_from(pool)), draw) for _ in range(count)]
    return draw(st.sampled_from(_SPACES)) + ".".join(segments) + draw(st.sampled_from(_SPACES))


@st.composite
def literals(draw):
    word = draw(st.sampled_from(list(REGISTRY.literals) + ["auto", "Torch", "BOGUS", "", "CUPY"]))
    return draw(st.sampled_from(_SPACES)) + word + draw(st.sampled_from(_SPACES))


EPLB_VALUES = st.sampled_from([True, False, 0, 1, 1.0, 0.0, 2, "yes", "No", "TRUE", "off", " true", "maybe", None])
MOE = st.fixed_dictionaries(
    {}, optional={"backend": literals(), "tactic": st.one_of(st.none(), tactics()), "eplb": EPLB_VALUES}
)
SPEC = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "mode": st.sampled_from(list(SPEC_MODES) + ["bogus", "MTP"]),
            "moe_backend": st.one_of(st.none(), literals()),
            "moe_tactic": st.one_of(st.none(), tactics()),
        },
    ),
)
DEPLOY = st.fixed_dictionaries({}, optional={"moe_config": MOE, "speculative_config": SPEC})


@settings(max_examples=400, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(DEPLOY)
def test_the_schema_and_runtime_validation_agree_on_generated_configs(data):
    # RULES GN5: a hypothesis stream over every field, spelling and combination above
    assert schema_accepts(data) == runtime_accepts(data), data


def test_non_ascii_folds_lists_exactly_the_characters_that_lower_into_ascii():
    # RULES TA1: a tactic is lowercased with str.lower(); the schema must fold the same characters
    folds: dict[str, str] = {}
    for code in range(0x80, sys.maxunicode + 1):
        char = chr(code)
        low = char.lower()
        if len(low) == 1 and low.isascii():
            folds[low] = folds.get(low, "") + char
        elif any(c.isascii() for c in low):
            # Lowers to several characters (U+0130 -> "i" + U+0307): never an ASCII token, so no fold.
            assert not low.isascii(), hex(code)
    assert folds == NON_ASCII_FOLDS


def test_the_whitespace_class_is_exactly_what_str_strip_removes():
    # RULES TA1: a tactic is stored stripped; the schema's class must be strip()'s set, no more, no less
    pattern = re.compile(f"[{WHITESPACE}]")
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        assert bool(pattern.fullmatch(char)) == (f"{char}a{char}".strip() == "a"), hex(code)
