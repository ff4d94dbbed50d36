"""A JSON Schema `pattern` (an ECMA-262 regular expression, the common subset) as a character machine
for the schema grammar: a Thompson NFA whose state is the set of positions a text may have reached.

Served: literals and escapes (\\d \\w \\s and their negations, \\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH,
escaped punctuation), `.`, classes `[...]` and `[^...]` with ranges, groups `(...)` and `(?:...)`
and named `(?P<name>...)`, alternation `|`, the quantifiers `*`, `+`, `?`, `{n}`, `{n,}`, `{n,m}`
(lazy ones decode alike: only what matches matters here), and `^` and `$` at the ends. JSON Schema's
`pattern` searches (it is not anchored): a pattern without `^` may be preceded by any text, one
without `$` followed by any. Anything else (lookaround, backreferences, `\\b`, anchors inside) is a
ValueError naming it: a pattern read otherwise than the validator reads it could admit a string
that fails it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_REPEAT = 256  # the largest count a {n,m} may give; each copy is more positions
_ECMA_SPACES = " \t\n\r\f\v\u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff" + "".join(map(chr, range(0x2000, 0x200B)))
# ECMA reads \d \w \s in ASCII (\s: _ECMA_SPACES), Python's re in Unicode: a class escape admits what both
# read in it, and a negated one (or one inside [^...]) only what neither does
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_ESCAPE_RANGES = {"d": ((48, 57),), "w": _WORD, "s": tuple((ord(c), ord(c)) for c in _ECMA_SPACES)}
_IN_BOTH = {"d": ((48, 57),), "w": _WORD, "s": tuple((ord(c), ord(c)) for c in _ECMA_SPACES if c.isspace())}
_PYTHON_READS = {"d": str.isdecimal, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_SURROGATES = (0xD800, 0xDFFF)


@dataclass(frozen=True)
class CharClass:
    """The characters of some code point ranges (inclusive), or all others (`negated`); a negated class
    also leaves out the characters Python's re reads as `unless`'s escapes ("d", "w", "s")."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False
    unless: tuple[str, ...] = ()

    def __contains__(self, ch: str) -> bool:
        code = ord(ch)
        if any(low <= code <= high for low, high in self.ranges):
            return not self.negated
        return self.negated and not any(_PYTHON_READS[name](ch) for name in self.unless)

    def writable(self) -> bool:
        """Some character of the class can be written in a JSON string (a lone surrogate cannot)."""
        if self.negated:
            return True  # no pattern Python compiles leaves out every other character here
        return any(low < _SURROGATES[0] or high > _SURROGATES[1] for low, high in self.ranges)

    def example(self) -> str | None:
        """A printable character of the class, for a shortest completion: None when none is found."""
        for code in (*range(ord("a"), ord("z") + 1), *range(ord("0"), ord("9") + 1), *range(ord("A"), ord("Z") + 1),
                     *range(0x20, 0x7F), *(low for low, _ in self.ranges)):
            if code >= 0x20 and not _SURROGATES[0] <= code <= _SURROGATES[1] and chr(code) in self:
                return chr(code)
        return None


ANY = CharClass(((10, 10), (13, 13), (0x2028, 0x2029)), negated=True)  # `.`: all but line ends
EVERYTHING = CharClass((), negated=True)


@dataclass
class Nfa:
    """Positions 0..n-1; `moves[i]`: (class, next position); `skips[i]`: positions reached with no
    character; `start` and `accept` positions."""

    moves: list[list[tuple[CharClass, int]]] = field(default_factory=list)
    skips: list[list[int]] = field(default_factory=list)
    start: int = 0
    accept: int = 0
    live: frozenset = frozenset()  # the positions from which `accept` can still be reached
    longest: list = field(default_factory=list)
    _profiles: dict = field(default_factory=dict, repr=False)
    _steps: dict = field(default_factory=dict, repr=False)

    def add(self) -> int:
        self.moves.append([])
        self.skips.append([])
        return len(self.moves) - 1

    def closure(self, positions) -> frozenset:
        """The positions given, and all reached from them with no character, less those that cannot
        reach the end (so that a state never holds a dead end)."""
        seen, stack = set(positions), list(positions)
        while stack:
            for nxt in self.skips[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen & self.live)

    def initial(self) -> frozenset:
        return self.closure([self.start])

    def step(self, state: frozenset, ch: str) -> frozenset:
        """The positions after `ch` (empty: `ch` cannot come next). Cached: a token mask runs thousands
        of tokens through the same few states."""
        key = (state, ch)
        after = self._steps.get(key)
        if after is None:
            if len(self._steps) >= 1 << 15:
                self._steps.clear()
            after = self._steps[key] = self.closure(
                [nxt for position in state for cls, nxt in self.moves[position] if ch in cls])
        return after

    def matches(self, text: str) -> bool:
        """The pattern matches the whole of `text` read from the start (searched where it is not anchored)."""
        state = self.initial()
        for ch in text:
            state = self.step(state, ch)
            if not state:
                return False
        return self.accepts(state)

    def accepts(self, state: frozenset) -> bool:
        return self.accept in state

    def can_finish(self, state: frozenset, written: int, low: int, high: int | None) -> bool:
        """Some text that takes `state` to the end brings a string of `written` characters to a length
        within [low, high] (high None: no most): exact, so that a string is never begun, nor a character
        taken, that leaves no way to close the string."""
        if high is None:
            return written + max(self.longest[p] for p in state) >= low
        first, last = max(low - written, 0), high - written
        ends, start = self._profile(state)
        period = len(ends) - start
        for k, ends_here in enumerate(ends):
            if ends_here:
                if k >= start:  # it recurs every period from here on: the first time at or after `first`
                    k += max(0, -(-(first - k) // period)) * period
                if first <= k <= last:
                    return True
        return False

    def _profile(self, state: frozenset) -> tuple[tuple[bool, ...], int]:
        """Whether a text of exactly k characters takes `state` to the end, for k = 0, 1, ... until the
        positions reached repeat: (those flags, the k where the repeating part begins). Cached."""
        found = self._profiles.get(state)
        if found is None:
            seen, ends, current = {}, [], state
            while current not in seen:
                seen[current] = len(ends)
                ends.append(self.accept in current)
                current = self.closure([nxt for p in current for _, nxt in self.moves[p]])
            found = self._profiles[state] = (tuple(ends), seen[current])
            if len(self._profiles) > 4096:
                self._profiles.pop(next(iter(self._profiles)))
        return found

    def _find_longest(self) -> None:
        """`longest[p]`: the most characters a text from p to the end may have (inf: no most)."""
        n = len(self.moves)
        edges = [[(nxt, 0) for nxt in self.skips[p]] + [(nxt, 1) for _, nxt in self.moves[p]] for p in range(n)]
        longest = [-math.inf] * n
        longest[self.accept] = 0
        for _ in range(n + 1):  # longest paths settle within n rounds unless a cycle that reads lengthens them
            changed = False
            for p in self.live:
                best = max((w + longest[q] for q, w in edges[p] if q in self.live), default=-math.inf)
                if p == self.accept:
                    best = max(best, 0)
                if best > longest[p]:
                    longest[p], changed = best, True
            if not changed:
                break
        else:
            growing = {p for p in self.live if max((w + longest[q] for q, w in edges[p] if q in self.live),
                                                   default=-math.inf) > longest[p]}
            for p in self.live:  # whatever reaches a position still growing has no most
                if p in growing or self._reaches(p, growing, edges):
                    longest[p] = math.inf
        self.longest = longest

    @staticmethod
    def _reaches(start: int, targets: set, edges) -> bool:
        seen, stack = {start}, [start]
        while stack:
            for q, _ in edges[stack.pop()]:
                if q in targets:
                    return True
                if q not in seen:
                    seen.add(q)
                    stack.append(q)
        return False

    def examples(self) -> set[str]:
        """A character of every class, so that a completion can be searched over them."""
        return {c for moves in self.moves for cls, _ in moves for c in [cls.example()] if c is not None}

    def _find_live(self) -> None:
        back: dict[int, list[int]] = {}
        for position in range(len(self.moves)):
            for nxt in self.skips[position] + [n for _, n in self.moves[position]]:
                back.setdefault(nxt, []).append(position)
        live, stack = {self.accept}, [self.accept]
        while stack:
            for before in back.get(stack.pop(), ()):
                if before not in live:
                    live.add(before)
                    stack.append(before)
        self.live = frozenset(live)


def compile_pattern(pattern: str, where: str = "pattern") -> Nfa:
    """The NFA of the strings that contain a match of `pattern` (that match it whole, with ^ and $);
    ValueError naming what is not served."""
    if not isinstance(pattern, str):
        raise ValueError(f"{where}: a regular expression, not {pattern!r}")
    try:  # what Python's validators (jsonschema's) cannot read is refused, not read another way
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{where}: {error} (in {pattern!r})") from None
    parser = _Parser(pattern, where)
    anchored_start = pattern.startswith("^")
    body_start = 1 if anchored_start else 0
    anchored_end = pattern.endswith("$") and not _escaped_at(pattern, len(pattern) - 1)
    body_end = len(pattern) - 1 if anchored_end else len(pattern)
    parser.text, parser.at = pattern[:body_end], body_start
    nfa = parser.nfa
    start, end = parser.alternation()
    if parser.at != len(parser.text):
        raise ValueError(f"{where}: unexpected {parser.text[parser.at]!r} at {parser.at}")
    if not anchored_start:
        start = _around(nfa, start, before=True)
    if not anchored_end:
        end = _around(nfa, end, before=False)
    nfa.start, nfa.accept = start, end
    nfa._find_live()
    if start not in nfa.live:
        raise ValueError(f"{where}: matches no string")
    nfa._find_longest()
    return nfa


def _escaped_at(text: str, index: int) -> bool:
    backslashes = 0
    while index - 1 - backslashes >= 0 and text[index - 1 - backslashes] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


def _around(nfa: Nfa, position: int, before: bool) -> int:
    """Any text before (or after) `position`: a new position that loops on every character."""
    loop = nfa.add()
    nfa.moves[loop].append((EVERYTHING, loop))
    if before:
        nfa.skips[loop].append(position)
    else:
        nfa.skips[position].append(loop)
    return loop


class _Parser:
    """Recursive descent over the pattern, building NFA fragments (start, end) as it reads."""

    def __init__(self, text: str, where: str):
        self.text, self.at, self.where = text, 0, where
        self.nfa = Nfa()

    def _fail(self, what: str):
        raise ValueError(f"{self.where}: {what} is not supported (at {self.at} of {self.text!r})")

    def _peek(self) -> str | None:
        return self.text[self.at] if self.at < len(self.text) else None

    def alternation(self) -> tuple[int, int]:
        branches = [self.sequence()]
        while self._peek() == "|":
            self.at += 1
            branches.append(self.sequence())
        if len(branches) == 1:
            return branches[0]
        start, end = self.nfa.add(), self.nfa.add()
        for first, last in branches:
            self.nfa.skips[start].append(first)
            self.nfa.skips[last].append(end)
        return start, end

    def sequence(self) -> tuple[int, int]:
        start = end = self.nfa.add()
        while self._peek() not in (None, "|", ")"):
            first, last = self.quantified()
            self.nfa.skips[end].append(first)
            end = last
        return start, end

    def quantified(self) -> tuple[int, int]:
        atom_at = self.at
        fragment = self.atom()
        low, high = self._quantifier()
        if (low, high) == (1, 1):
            return fragment
        if high == 0:  # x{0}: the empty string
            empty = self.nfa.add()
            return empty, empty
        if self._peek() == "?":  # lazy: the same strings
            self.at += 1
        resume = self.at
        parts = [fragment]
        for _ in range(max(low, 1 if high is None else high) - 1):  # each copy read again: none is shared
            self.at = atom_at
            parts.append(self.atom())
        self.at = resume
        nfa = self.nfa
        start = end = nfa.add()
        exits = []  # positions from which the rest may be skipped
        for i, (first, last) in enumerate(parts):
            if i >= low:
                exits.append(end)
            nfa.skips[end].append(first)
            end = last
        if high is None:  # the last copy repeats ({n,} is n-1 copies and one or more)
            nfa.skips[parts[-1][1]].append(parts[-1][0])
        final = nfa.add()
        for position in exits + [end]:
            nfa.skips[position].append(final)
        return start, final

    def _quantifier(self) -> tuple[int, int | None]:
        ch = self._peek()
        if ch in ("*", "+", "?"):
            self.at += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if ch == "{":
            close = self.text.find("}", self.at)
            inside = self.text[self.at + 1: close] if close > 0 else ""
            low_text, comma, high_text = inside.partition(",")
            if close > 0 and not low_text and high_text.isdigit():
                self._fail("a repeat {,m} (ECMA reads it as text, Python as {0,m})")
            if close < 0 or not low_text.isdigit() or (high_text and not high_text.isdigit()):
                return 1, 1  # ECMA reads a brace that is no quantifier as a literal
            low, high = int(low_text), (int(high_text) if high_text else None) if comma else int(low_text)
            if high is not None and high < low:
                self._fail(f"a repeat {{{inside}}} whose maximum is below its minimum")
            if max(low, high or 0) > MAX_REPEAT:
                self._fail(f"a repeat of more than {MAX_REPEAT}")
            self.at = close + 1
            return low, high
        return 1, 1

    def atom(self) -> tuple[int, int]:
        ch = self._peek()
        if ch == "(":
            self.at += 1
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self.text.startswith(("?P<", "?<"), self.at) and not self.text.startswith(("?<=", "?<!"), self.at):
                close = self.text.find(">", self.at)
                if close < 0:
                    self._fail("an unclosed group name")
                self.at = close + 1
            elif self._peek() == "?":
                self._fail("a lookaround, flag or other (?...) group")
            fragment = self.alternation()
            if self._peek() != ")":
                self._fail("an unclosed group")
            self.at += 1
            return fragment
        if ch in ("*", "+", "?", ")"):
            self._fail(f"{ch!r} with nothing to repeat")
        if ch in ("^", "$"):
            self._fail(f"{ch!r} inside the pattern")
        if ch == "[":
            return self._single(self._class())
        if ch == ".":
            self.at += 1
            return self._single(ANY)
        if ch == "\\":
            escaped = self._escape(in_class=False)
            return self._single(escaped if isinstance(escaped, CharClass) else CharClass(((escaped, escaped),)))
        self.at += 1
        return self._single(CharClass(((ord(ch), ord(ch)),)))

    def _single(self, cls: CharClass) -> tuple[int, int]:
        start, end = self.nfa.add(), self.nfa.add()
        if cls.writable():  # else nothing passes: the positions behind it are dead
            self.nfa.moves[start].append((cls, end))
        return start, end

    def _escape(self, in_class: bool) -> int | CharClass:
        """The character (its code) or the class (\\d, \\w, \\s, negated in upper case) of an escape."""
        self.at += 1
        ch = self._peek()
        if ch is None:
            self._fail("a pattern that ends in a backslash")
        self.at += 1
        if ch.lower() in _ESCAPE_RANGES:
            name = ch.lower()
            if ch.isupper():
                return CharClass(_ESCAPE_RANGES[name], negated=True, unless=(name,))
            return CharClass(_IN_BOTH[name], unless=(name,))  # `unless` marks it an escape, for [^...]
        if ch in _CHAR_ESCAPES:
            code = ord(_CHAR_ESCAPES[ch])
        elif ch in "xu":
            digits = 2 if ch == "x" else 4
            hex_text = self.text[self.at: self.at + digits]
            if len(hex_text) != digits or any(c not in "0123456789abcdefABCDEF" for c in hex_text):
                self._fail(f"\\{ch} without {digits} hex digits")
            self.at += digits
            code = int(hex_text, 16)
        elif ch == "b" and in_class:
            code = 8
        elif ch.isalnum():
            self._fail(f"\\{ch}")
        else:
            code = ord(ch)  # escaped punctuation stands for itself
        return code

    def _class(self) -> CharClass:
        self.at += 1
        negated = self._peek() == "^"
        if negated:
            self.at += 1
        ranges: list[tuple[int, int]] = []
        unless: list[str] = []
        first = True
        while True:
            ch = self._peek()
            if ch is None:
                self._fail("an unclosed class")
            if ch == "]" and not first:
                self.at += 1
                break
            first = False
            low = self._class_member()
            if isinstance(low, CharClass):
                if low.negated:
                    self._fail("a negated class escape (\\D, \\W, \\S) inside a class")
                name = low.unless[0]
                ranges.extend(_ESCAPE_RANGES[name] if negated else _IN_BOTH[name])
                unless.append(name)
                continue
            if self._peek() == "-" and self.at + 1 < len(self.text) and self.text[self.at + 1] != "]":
                self.at += 1
                high = self._class_member()
                if isinstance(high, CharClass) or high < low:
                    self._fail("a class range out of order")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        return CharClass(tuple(ranges), negated, tuple(unless) if negated else ())

    def _class_member(self) -> int | CharClass:
        if self._peek() == "\\":
            return self._escape(in_class=True)
        ch = self.text[self.at]
        self.at += 1
        return ord(ch)
