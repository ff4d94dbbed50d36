"""Numeric bounds for the schema grammar: which number prefixes can still end within them."""
from __future__ import annotations

import random
from fractions import Fraction

import pytest

from engine.number_bounds import NumberRange


def _range(schema: dict, integer: bool = False) -> NumberRange:
    return NumberRange.from_schema(schema, integer, "schema")


PREFIXES = {"", "-", *(str(n)[:k] for n in range(-300, 301) for k in range(1, 5))}


def test_integer_prefixes_agree_with_counting_every_integer():
    """Against brute force: a prefix is reachable exactly when some integer within the bounds (and a
    multiple of its multipleOf) is written with it ("" and "-" among the prefixes) (bounds kept within +-300, so no integer outside that range counts)."""
    rng = random.Random(5)
    for _ in range(200):
        low, high = sorted(rng.randint(-300, 300) for _ in range(2))
        schema = {"exclusiveMinimum" if rng.random() < 0.3 else "minimum": low,
                  "exclusiveMaximum" if rng.random() < 0.3 else "maximum": high,
                  **({"multipleOf": rng.choice([2, 3, 7, 50.0])} if rng.random() < 0.4 else {})}
        try:
            bounds = _range(schema, integer=True)
        except ValueError:
            step = int(schema.get("multipleOf", 1))
            assert not any(low <= n <= high and n % step == 0 for n in range(low, high + 1)) or low + 1 >= high
            continue
        inside = [str(n) for n in range(-300, 301) if bounds.admits(Fraction(n))]
        inside += ["-0"] if "0" in inside else []  # JSON's -0, which is 0
        begun = {text[:k] for text in inside for k in range(len(text) + 1)}
        for prefix in PREFIXES:
            assert bounds.reachable(prefix) == (prefix in begun), (schema, prefix)


@pytest.mark.parametrize("schema, prefix, reachable", [
    ({"minimum": 0.25, "maximum": 0.25}, "0.2", True),
    ({"minimum": 0.25, "maximum": 0.25}, "0.26", False),
    ({"minimum": 0.25, "maximum": 0.25}, "0.250", True),  # trailing zeros keep the value
    ({"exclusiveMinimum": 9.99, "maximum": 10}, "9.99", True),  # 9.991 and on
    ({"exclusiveMinimum": 9.99, "maximum": 10}, "9.98", False),
    ({"exclusiveMinimum": 9.99, "maximum": 10}, "10.", True),  # 10.0
    ({"exclusiveMinimum": 9.99, "maximum": 10}, "10.1", False),
    ({"maximum": -3}, "-", True),
    ({"maximum": -3}, "-0", False),  # nothing but a point may follow a leading 0: -0.x is above -3
    ({"minimum": 0}, "-", True),  # -0 is 0
    ({"minimum": 0}, "-0.", True),  # -0.0
    ({"minimum": 0}, "-0.1", False),
    ({"exclusiveMinimum": 0}, "-", False),
    ({"minimum": 1000}, "9", True),  # 9000
    ({"maximum": 0.1}, "0.1", True),  # the schema's 0.1 is the decimal 1/10, not the nearest double
])
def test_number_prefixes(schema, prefix, reachable):
    assert _range(schema).reachable(prefix) is reachable


def test_draft_4_flags_make_a_bound_exclusive():
    bounds = _range({"minimum": 0, "exclusiveMinimum": True, "maximum": 1, "exclusiveMaximum": False})
    assert not bounds.admits(Fraction(0)) and bounds.admits(Fraction(1))


def test_the_tighter_of_inclusive_and_exclusive_bounds_holds():
    bounds = _range({"minimum": 2, "exclusiveMinimum": 2, "maximum": 8, "exclusiveMaximum": 9})
    assert not bounds.admits(Fraction(2)) and bounds.admits(Fraction(8)) and not bounds.admits(Fraction(17, 2))


def test_a_window_finer_than_the_grammar_writes_is_refused():
    with pytest.raises(ValueError, match="no number lies within"):
        _range({"exclusiveMinimum": 0, "exclusiveMaximum": 1e-20})


def test_a_whole_multiple_of_writes_whole_numbers_and_anything_else_is_refused():
    bounds = _range({"multipleOf": 2.0, "minimum": 1})
    assert bounds.integer and bounds.admits(Fraction(4)) and not bounds.admits(Fraction(3))
    assert not bounds.reachable("4.")  # a float's remainder would round in a validator: written whole
    for step in (0.5, 0, -2, "2", True):
        with pytest.raises(ValueError, match="multipleOf: only a whole number"):
            _range({"multipleOf": step})
