"""Numeric bounds of a JSON Schema (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, and
a whole `multipleOf`) as the schema grammar needs them: whether a number written so far can still be
finished within them.

Values are exact: the schema's 0.1 is the decimal 1/10, as the answer "0.1" is, never the nearest
double. A bounded number is written without an exponent, at most NUMBER_DIGITS digits a part, as every
number the grammar writes, so the numbers it can write are the multiples of 10^-NUMBER_DIGITS (of 1
for an integer) below 10^NUMBER_DIGITS; `reachable` counts those only, in whole units of that grid,
so a number begun within bounds can always be finished within them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from engine.json_constraint import NUMBER_DIGITS

RANGE_WORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
BOUND_WORDS = (*RANGE_WORDS, "multipleOf")
_LIMIT = 10**NUMBER_DIGITS  # integer parts stay below it, and fractions are multiples of its inverse


def exact(value) -> Fraction:
    """A JSON number as the exact value of its shortest decimal text."""
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


@dataclass(frozen=True)
class NumberRange:
    """low <= value <= high, either end open (strict) or absent; `integer`: whole numbers only; `step`:
    multiples of it only (a whole number: then the number is written as an integer, which any validator
    divides exactly, where a float's remainder would round)."""

    low: Fraction | None = None
    low_open: bool = False
    high: Fraction | None = None
    high_open: bool = False
    integer: bool = False
    step: int = 1
    # the least and the greatest writable number within the bounds, in grid units (None: unbounded)
    least: int | None = field(init=False, default=None, repr=False)
    greatest: int | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        unit = self.unit
        if self.low is not None:
            least = math.ceil(self.low * unit)
            object.__setattr__(self, "least", least + (self.low_open and least == self.low * unit))
        if self.high is not None:
            greatest = math.floor(self.high * unit)
            object.__setattr__(self, "greatest", greatest - (self.high_open and greatest == self.high * unit))

    @property
    def unit(self) -> int:
        """Grid units to 1."""
        return 1 if self.integer else _LIMIT

    @classmethod
    def from_schema(cls, schema: dict, integer: bool, where: str) -> NumberRange | None:
        """The bounds a schema sets (None: none); ValueError naming the keyword when one is not a number,
        or when no number of the kind lies within them."""
        given = {}
        for word in RANGE_WORDS:
            if word not in schema:
                continue
            value = schema[word]
            if isinstance(value, bool) and word.startswith("exclusive"):  # draft 4: a flag on minimum/maximum
                given[word] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                given[word] = exact(value)
            else:
                raise ValueError(f"{where}.{word}: a number, not {value!r}")
        step = schema.get("multipleOf", 1)
        if isinstance(step, float) and step.is_integer():
            step = int(step)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"{where}.multipleOf: only a whole number above 0 is supported, not {step!r}")
        if not given and "multipleOf" not in schema:
            return None
        low, low_open = _tighter(given, "minimum", "exclusiveMinimum", max)
        high, high_open = _tighter(given, "maximum", "exclusiveMaximum", min)
        bounds = cls(low, low_open, high, high_open, integer or "multipleOf" in schema, step)
        if not bounds.reachable(""):
            raise ValueError(f"{where}: no {'integer' if integer else 'number'} lies within its bounds "
                             f"(of at most {NUMBER_DIGITS} digits a part)")
        return bounds

    def admits(self, value: Fraction) -> bool:
        if self.integer and (value.denominator != 1 or value.numerator % self.step):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value < self.high or (not self.high_open and value == self.high)

    def reachable(self, text: str, excluding: frozenset[Fraction] = frozenset()) -> bool:
        """Some number whose text starts with `text` (a prefix of a number without exponent, "" and "-"
        included) lies within the bounds, and is not one of `excluding` (values within them)."""
        if not text:
            return any(self.reachable(start, excluding) for start in "-0123456789")
        negative = text.startswith("-")
        body = text[1:] if negative else text
        whole, point, fraction = body.partition(".")
        taken = [g for g in (v * self.unit for v in excluding) if g.denominator == 1 and not g.numerator % self.step]
        for start, end in _magnitudes(whole, fraction if point else None, self.unit):
            first, last = (1 - end, -start) if negative else (start, end - 1)  # the grid points it covers
            if self.least is not None:
                first = max(first, self.least)
            if self.greatest is not None:
                last = min(last, self.greatest)
            if self._multiples(first, last) > sum(first <= g <= last for g in taken):
                return True
        return False

    def count(self) -> float:
        """How many numbers the grammar can write within the bounds (inf: an end is open)."""
        if self.least is None or self.greatest is None:
            return math.inf
        return self._multiples(self.least, self.greatest)

    def values(self) -> list[Fraction]:
        """The numbers within the bounds, when they are few (see `count`)."""
        low = -(-self.least // self.step)
        return [Fraction(k * self.step, self.unit) for k in range(low, self.greatest // self.step + 1)]

    def _multiples(self, first: int, last: int) -> int:
        """Multiples of the step (of 1, without one) from grid point `first` to `last`."""
        return max(0, last // self.step - -(-first // self.step) + 1)


def _tighter(given: dict, word: str, exclusive_word: str, pick) -> tuple[Fraction | None, bool]:
    """One end of the range: the tighter of the inclusive and the exclusive bound (draft 4's flag makes
    the inclusive one exclusive)."""
    inclusive, exclusive = given.get(word), given.get(exclusive_word)
    if isinstance(exclusive, bool):
        return inclusive, exclusive and inclusive is not None
    if inclusive is None or exclusive is None:
        return (inclusive, False) if exclusive is None else (exclusive, True)
    chosen = pick(inclusive, exclusive)
    return chosen, chosen == exclusive


def _magnitudes(whole: str, fraction: str | None, unit: int) -> list[tuple[int, int]]:
    """The magnitudes, in grid units of which `unit` make 1 (half-open intervals), of the numbers that
    continue a text of integer part `whole` and, after a written point, fraction part `fraction`."""
    if fraction is not None:
        if unit == 1:  # an integer has no point
            return []
        step = _LIMIT // 10 ** len(fraction)
        start = int(whole) * unit + int(fraction or 0) * step
        return [(start, start + step)]
    if not whole:  # a minus sign alone
        return [(0, _LIMIT * unit)]
    if whole == "0":  # nothing but a point may follow a leading 0
        return [(0, unit)]
    value = int(whole)
    return [(value * 10**more * unit, (value + 1) * 10**more * unit) for more in range(NUMBER_DIGITS - len(whole) + 1)]
