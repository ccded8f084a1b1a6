"""The one literal printer of generated code (`codegen.render.py_block`): whatever it wraps reads back as the same value."""

from __future__ import annotations

import ast
import random

import pytest

from codegen.render import py_block


def _value(rng: random.Random, depth: int = 0):
    """A random constant of the kinds the templates print: scalars, tuples, lists, dicts with string keys."""
    kind = rng.choice(["int", "float", "str", "none", "bool"] + (["tuple", "list", "dict"] * 2 if depth < 3 else []))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3)
    if kind == "str":
        return "".join(rng.choice("abcxyz._'\"\\ ") for _ in range(rng.randint(0, 30)))
    if kind in ("none", "bool"):
        return None if kind == "none" else rng.random() < 0.5
    items = [_value(rng, depth + 1) for _ in range(rng.randint(1, 12))]
    if kind == "dict":
        return {f"k{rng.randint(0, 99)}_{i}": v for i, v in enumerate(items)}
    return tuple(items) if kind == "tuple" else items


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("fill", [False, True])
def test_a_wrapped_literal_reads_back_as_the_same_value(seed, fill):
    value = _value(random.Random(seed))
    text = py_block(value, width=40, fill=fill)
    back = ast.literal_eval(text)
    assert back == value and type(back) is type(value), text


def test_fill_packs_a_table_of_scalars_and_the_default_puts_one_item_a_line():
    windows = tuple(random.Random(1).choice([128, None]) for _ in range(36))
    packed, listed = py_block(windows, width=100, fill=True), py_block(windows, width=100)
    assert packed.splitlines()[0] == listed.splitlines()[0] == "("
    assert len(listed.splitlines()) == 38
    assert 3 <= len(packed.splitlines()) < 38
    assert ast.literal_eval(packed) == ast.literal_eval(listed) == windows
