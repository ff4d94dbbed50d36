"""JSON Schema patterns as NFAs: agreement with Python's `re.search` (what jsonschema validates with),
exact length feasibility, the formats' patterns, and what is refused."""
from __future__ import annotations

import datetime
import ipaddress
import itertools
import random
import re
import urllib.parse
import uuid

import pytest
from pydantic import IPvAnyAddress, TypeAdapter

from engine.json_schema import FORMATS
from engine.regex_nfa import compile_pattern

PATTERNS = [r"^\d{4}-\d{2}-\d{2}$", r"^[a-z]+@[a-z]+\.(com|org)$", r"ab*c", r"^(ab|cd){2,3}$", r"^x{0,2}y?$",
            r"^[^0-9]*$", r"colou?r", r"^\w+(\.\w+)*$", r"^a{3,}$", r"^(?:a|b)*c$", r"^\s*$", r"^[\d\-]+$",
            r"^\\x$", r"^[.]$", r"^a{2}?$", r"^(?P<word>[a-c]+)-z$", r"^$", r"{x}",
            r"^\x41\u0042[\t ]+$"]
ALPHABET = "abcdxyz0129-.@ \\ABrlmoguw{}\t"


def _walk(nfa, rng: random.Random, alphabet: str, most: int = 30) -> str | None:
    """A random text the NFA accepts, a character at a time among those it takes (None: gave up)."""
    state, text = nfa.initial(), ""
    while len(text) < most:
        if nfa.accepts(state) and rng.random() < 0.3:
            return text
        options = [ch for ch in alphabet if nfa.step(state, ch)]
        if not options:
            break
        ch = rng.choice(options)
        text, state = text + ch, nfa.step(state, ch)
    return text if nfa.accepts(state) else None


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_matches_what_python_finds_it_in(pattern):
    nfa, rng = compile_pattern(pattern), random.Random(4)
    for _ in range(1500):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))
        assert nfa.matches(text) == bool(re.search(pattern, text)), text
    walked = [t for t in (_walk(nfa, rng, ALPHABET) for _ in range(200)) if t is not None]
    assert walked or not pattern.startswith("^")  # a walk seldom spells an unanchored pattern's match by chance
    assert all(re.search(pattern, t) for t in walked)


@pytest.mark.parametrize("pattern", [r"^(aa)*$", r"^(ab|b)*a?$", r"^a{2,4}b?$", r"b+", r"^(?:a|bb){1,3}$",
                                     r"^x{3}$", r"^(a(bc)*)?$"])
def test_whether_a_string_can_still_end_within_its_length_bounds_is_exact(pattern):
    """Against every string of up to 8 characters over the pattern's letters: from each prefix, some
    matching string of a length in [low, high] exists exactly when `can_finish` says so."""
    nfa = compile_pattern(pattern)
    strings = ["".join(t) for n in range(9) for t in itertools.product("abcx", repeat=n)]
    matching = [s for s in strings if re.search(pattern, s)]
    lengths: dict[str, set[int]] = {}  # prefix -> the lengths of the matching strings that begin with it
    for m in matching:
        for k in range(len(m) + 1):
            lengths.setdefault(m[:k], set()).add(len(m))
    for prefix in {s[:k] for s in strings[:400] for k in range(len(s) + 1)}:
        state = nfa.initial()
        for ch in prefix:
            state = state and nfa.step(state, ch)
        if not state:
            continue
        for low, high in itertools.combinations_with_replacement(range(8), 2):
            want = any(low <= n <= high for n in lengths.get(prefix, ()))
            assert nfa.can_finish(state, len(prefix), low, high) == want, (prefix, low, high)
    assert nfa.can_finish(nfa.initial(), 0, 5, None) == any(len(m) >= 5 for m in matching) or "*" in pattern \
        or "+" in pattern


def test_a_length_bound_far_beyond_the_pattern_is_answered_without_counting_to_it():
    nfa = compile_pattern(r"^(?:ab)+$")
    assert nfa.can_finish(nfa.initial(), 0, 2**62, 2**62) and not nfa.can_finish(nfa.initial(), 0, 2**62 + 1, 2**62 + 1)


_PYDANTIC = {"ipv4": TypeAdapter(ipaddress.IPv4Address), "ipv6": TypeAdapter(ipaddress.IPv6Address),
             "ipvanyaddress": TypeAdapter(IPvAnyAddress), "duration": TypeAdapter(datetime.timedelta)}


def _valid_format(name: str, text: str) -> bool:
    if name == "date":
        return datetime.date.fromisoformat(text) is not None
    if name in ("time", "date-time"):
        parsed = text.replace("Z", "+00:00")
        return (datetime.time.fromisoformat(parsed) if name == "time" else datetime.datetime.fromisoformat(parsed)) \
            is not None
    if name == "uuid":
        return str(uuid.UUID(text)) == text
    if name in ("ipv4", "ipv6", "ipvanyaddress"):
        kind = {"ipv4": ipaddress.IPv4Address, "ipv6": ipaddress.IPv6Address}.get(name, object)
        return isinstance(ipaddress.ip_address(text), kind) and _PYDANTIC[name].validate_python(text) is not None
    if name == "duration":  # pydantic (speedate) reads it as ISO 8601 does, a superset of RFC 3339's
        return _PYDANTIC[name].validate_python(text) is not None
    if name in ("hostname", "uri"):
        host = urllib.parse.urlsplit(text).hostname if name == "uri" else text
        labels = host.split(".")
        return (name == "hostname" or urllib.parse.urlsplit(text).scheme in ("http", "https")) and len(labels) > 1 \
            and all(0 < len(label) <= 63 and not label.startswith("-") and not label.endswith("-") for label in labels)
    return re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", text) is not None  # email


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_value_a_format_admits_is_valid(name):
    nfa, rng = compile_pattern(FORMATS[name]), random.Random(8)
    alphabet = "0123456789abcdefABCDEFZTxyz-:.+@_/htpsPYMWDHS"
    walked = [t for t in (_walk(nfa, rng, alphabet, most=120) for _ in range(300)) if t is not None]
    assert len(walked) > 50
    for text in walked:
        assert _valid_format(name, text), text


@pytest.mark.parametrize("name, admitted, refused", [
    ("duration", ["P4Y", "PT0S", "P0D", "P1M", "PT1M", "PT36H", "P1DT12H", "P2W", "P1Y2M3DT4H5M6S", "P1Y0M2D",
                  "PT1H0M5S", "P000001Y"],
     ["P", "PT", "P1YT", "P1", "P2D1Y", "P1D2H", "P2S", "P1Y2W", "P1W2D", "PT1S2M", "P1Y2D", "PT1H5S", "1D", "P1.5D",
      "P-1D", "PT1234567S"]),  # the last four: no sign, no fraction, 6 figures at most; the two before: RFC order
    ("ipv6", ["::", "::1", "1::", "2001:db8::1", "fe80::1:2", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8",
              "1::8", "ABCD:ef01::", "0:0:0:0:0:0:0:0"],
     ["", ":", ":::", "1:2:3:4:5:6:7", "1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", "g::", "1:2:3:4:5:6:7:8::",
      "::1:2:3:4:5:6:7:8", "::ffff:1.2.3.4", "fe80::1%eth0"]),  # the last two valid, but not written here
    ("ipvanyaddress", ["10.0.0.1", "::1", "2001:db8::ff00:42:8329"], ["10.0.0.256", "10.0.0", "1::2::3"]),
])
def test_a_format_admits_its_written_forms_and_nothing_invalid(name, admitted, refused):
    nfa = compile_pattern(FORMATS[name])
    for text in admitted:
        assert nfa.matches(text) and _valid_format(name, text), text
    for text in refused:
        assert not nfa.matches(text), text


ODD_CHARACTERS = ["a", "_", "é", "\u0663", "5", " ", "\x1c", "\ufeff", "\u2028", "\n", "\u00a0", "\u0085", "-"]
ECMA_SPACES = set(" \t\n\r\f\v\u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff" + "".join(map(chr, range(0x2000, 0x200B))))
ECMA = {"d": lambda c: "0" <= c <= "9", "w": lambda c: c.isascii() and (c.isalnum() or c == "_"),
        "s": lambda c: c in ECMA_SPACES}


@pytest.mark.parametrize("escape", ["d", "w", "s"])
def test_a_class_escape_admits_only_what_both_ecma_and_python_read_in_it(escape):
    """ECMA reads \\d \\w \\s in ASCII, Python's re (jsonschema's) in Unicode: an Arabic-Indic three is a
    digit to one and not the other. Every character a class admits is in it (or out of it, negated) for
    both, so an answer validates whichever engine checks it."""
    for pattern, inside in ((f"^\\{escape}$", True), (f"^[\\{escape}]$", True), (f"^\\{escape.upper()}$", False),
                            (f"^[^\\{escape}]$", False)):
        nfa = compile_pattern(pattern)
        for ch in ODD_CHARACTERS:
            if nfa.matches(ch):
                assert re.search(pattern, ch) and ECMA[escape](ch) == inside, (pattern, ch)


def test_a_repeat_of_none_is_the_empty_string():
    assert compile_pattern("^a{0}b$").matches("b") and not compile_pattern("^a{0}b$").matches("ab")
    assert compile_pattern("^(ab){0,0}c$").matches("c")


@pytest.mark.parametrize("pattern, refused", [
    ("(?=a)", "lookaround"), ("(?<!a)b", "lookaround"), ("(?i)a", "flag"), (r"(a)\1", r"\\1"), (r"\bword", r"\\b"),
    ("a^b", "inside the pattern"), ("a|^b", "inside the pattern"), ("a$b", "inside the pattern"), ("a{,3}", "{,m}"), ("b+{1,3}", "multiple repeat"),
    ("a{300}", "more than 256"), ("[b-a]", "bad character range"), ("(ab", "missing \\)"), ("[^\\D]", "negated class"),
    ("^[\\ud800-\\udfff]$", "matches no string"),  # lone surrogates, which no JSON text decodes to
    (5, "a regular expression"),
])
def test_what_a_pattern_cannot_be_read_as_is_refused(pattern, refused):
    with pytest.raises(ValueError, match=refused):
        compile_pattern(pattern)
