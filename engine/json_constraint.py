"""JSON mode (OpenAI's `response_format: {"type": "json_object"}`): a decoding constraint under
which the answer is one JSON object (RFC 8259), and the answer ends where the object closes.

`JsonGrammar` is the character-level pushdown machine; a state is a small tuple holding the open
brackets as a string, so states hash and masks can be cached per state. Whitespace between tokens
is allowed in runs of at most `max_whitespace` characters (a small model otherwise pads forever),
and nesting is limited to `max_depth`.

`JsonObjectConstraint` lifts it to tokens exactly, as graph.plan_constraint does for plan lines:
a token is allowed when the machine accepts its whole decoded string from the current state.
Inside a string, where most of the vocabulary fits, the tokens free of quotes, backslashes and
control characters are allowed as one precomputed set, and only the others are run through the
machine; elsewhere few tokens fit, and they are found through an index on their first two
characters. Masks are cached per state (per tokenizer, shared by every sequence), so a state's
mask is computed once. Tokens holding half a UTF-8 character are never allowed (see
`engine.constraints.token_strings`), so text inside strings is written from whole characters.
"""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from engine.constraints import DONE, CharGrammar, TokenConstraint, first_two_index, narrow_mask, token_strings

WHITESPACE = " \t\n\r"
ESCAPES = '"\\/bfnrt'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CLOSER = {"{": "}", "[": "]"}
NUMBER_ENDS = ("zero", "int", "frac", "expdigit")  # phases where a number may end
NUMBER_DIGITS = 19  # most digits in a number's integer or fraction part (a double holds 17)
EXPONENT_DIGITS = 3


@dataclass(frozen=True)
class JsonGrammar(CharGrammar):
    """One JSON object as a character-level machine. `step(state, ch)` is the next state or None;
    states are tuples whose second item is the stack of open brackets ("{" or "[")."""

    max_depth: int = 32
    max_whitespace: int = 24
    start: ClassVar[tuple] = ("top", "", 0)

    def step(self, state: tuple, ch: str) -> tuple | None:
        mode, stack = state[0], state[1] if len(state) > 1 else ""
        if mode == "str":
            return self._string(state, ch)
        if mode in ("esc", "hex"):
            return self._escape(state, ch)
        if mode == "num":
            return self._number(state, ch)
        if mode == "lit":
            rest = state[2]
            if ch != rest[0]:
                return None
            return ("lit", stack, rest[1:]) if len(rest) > 1 else ("after", stack, 0)
        if mode == "done":
            return None
        if ch in WHITESPACE:  # between tokens: every other mode keeps a run count in state[2]
            return (mode, stack, state[2] + 1) if state[2] < self.max_whitespace else None
        return self._structural(mode, stack, ch)

    def _structural(self, mode: str, stack: str, ch: str) -> tuple | None:
        if mode == "top":
            return ("key_or_end", "{", 0) if ch == "{" else None
        if mode == "colon":
            return ("value", stack, 0) if ch == ":" else None
        if mode in ("key", "key_or_end") and ch == '"':
            return ("str", stack, True)
        if mode in ("key_or_end", "value_or_end", "after") and ch in "}]":  # no trailing commas: not after ","
            if ch != _CLOSER[stack[-1]]:
                return None
            rest = stack[:-1]
            return ("after", rest, 0) if rest else DONE
        if mode == "after":
            if ch != ",":
                return None
            return ("key", stack, 0) if stack[-1] == "{" else ("value", stack, 0)
        if mode in ("value", "value_or_end"):
            return self._value_start(stack, ch)
        return None

    def _value_start(self, stack: str, ch: str) -> tuple | None:
        if ch in "{[":
            if len(stack) >= self.max_depth:
                return None
            return ("key_or_end", stack + ch, 0) if ch == "{" else ("value_or_end", stack + ch, 0)
        if ch == '"':
            return ("str", stack, False)
        start = number_start(ch)
        if start is not None:
            return ("num", stack, *start)
        if ch in LITERALS:
            return ("lit", stack, LITERALS[ch])
        return None

    @staticmethod
    def _string(state: tuple, ch: str) -> tuple | None:
        _, stack, is_key = state
        if ch == '"':
            return ("colon", stack, 0) if is_key else ("after", stack, 0)
        if ch == "\\":
            return ("esc", stack, is_key)
        return None if ord(ch) < 0x20 else state

    @staticmethod
    def _escape(state: tuple, ch: str) -> tuple | None:
        if state[0] == "esc":
            if ch == "u":
                return ("hex", state[1], state[2], 4)
            return ("str", state[1], state[2]) if ch in ESCAPES else None
        _, stack, is_key, left = state
        if ch not in HEX:
            return None
        return ("hex", stack, is_key, left - 1) if left > 1 else ("str", stack, is_key)

    @staticmethod
    def string_budget(state: tuple) -> float | None:
        """Inside a string's text, any token free of quotes, backslashes and control characters may
        come next, whatever its length (`_Vocab` allows those wholesale); elsewhere None."""
        return math.inf if state[0] == "str" else None

    def _number(self, state: tuple, ch: str) -> tuple | None:
        _, stack, phase, digits = state
        nxt = number_step(phase, digits, ch)
        if nxt is not None:
            return ("num", stack, *nxt)
        if phase in NUMBER_ENDS:  # the number ends here; the character is read after it
            return self.step(("after", stack, 0), ch)
        return None


def number_step(phase: str, digits: int, ch: str, integer: bool = False) -> tuple[str, int] | None:
    """A JSON number's next (phase, digits in its current part) after `ch`, or None where `ch` does not
    continue it (the number may end there: `phase in NUMBER_ENDS`). Parts have at most NUMBER_DIGITS
    digits (EXPONENT_DIGITS in the exponent): past what a double holds, more digits are a model
    repeating itself to max_tokens, which the loop stop cannot cut in a JSON answer."""
    if ch in DIGITS:
        if phase == "minus":
            return ("zero" if ch == "0" else "int"), 1
        if phase in ("int", "frac", "expdigit"):
            most = EXPONENT_DIGITS if phase == "expdigit" else NUMBER_DIGITS
            return (phase, digits + 1) if digits < most else None
        return {"dot": ("frac", 1), "exp": ("expdigit", 1), "expsign": ("expdigit", 1)}.get(phase)  # none after a 0
    if ch == "." and phase in ("zero", "int") and not integer:
        return "dot", 0
    if ch in "eE" and phase in ("zero", "int", "frac") and not integer:
        return "exp", 0
    if ch in "+-" and phase == "exp":
        return "expsign", 0
    return None


def number_start(ch: str) -> tuple[str, int] | None:
    """A JSON number's first (phase, digits) after `ch`, or None where it cannot start one."""
    if ch == "-":
        return "minus", 0
    return (("zero" if ch == "0" else "int"), 1) if ch in DIGITS else None


class _Vocab:
    """One tokenizer's token strings, indexed for the grammars, and the masks computed so far."""

    MAX_MASKS = 1024  # a mask is one byte a token: 48 MiB at most for a 49k vocabulary

    def __init__(self, tokenizer):
        self.strings = token_strings(tokenizer)
        self.size = len(self.strings)
        plain = [bool(s) and all(ch not in '"\\' and ord(ch) >= 0x20 for ch in s) for s in self.strings]
        self.plain_in_string = np.array(plain, dtype=bool)  # a string's content whatever the state
        self.lengths = np.array([len(s) for s in self.strings])
        self.string_exits = [(i, s) for i, s in enumerate(self.strings) if s and not plain[i]]
        self.index = first_two_index(self.strings)
        self.single_chars = {s for s in self.strings if len(s) == 1}
        self.masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def mask(self, grammar: CharGrammar, state) -> torch.Tensor:
        key = (grammar, state)
        mask = self.masks.get(key)
        if mask is None:
            budget = grammar.string_budget(state)
            mask = (self._string_mask(grammar, state, budget) if budget is not None
                    else narrow_mask(grammar, state, self.index, self.size))
            self.masks[key] = mask
            if len(self.masks) > self.MAX_MASKS:
                self.masks.popitem(last=False)
        else:
            self.masks.move_to_end(key)
        return mask

    def _string_mask(self, grammar: CharGrammar, state, budget: float) -> torch.Tensor:
        ok = self.plain_in_string & (self.lengths <= budget)
        ok[[i for i, s in self.string_exits if grammar.run(state, s) is not None]] = True
        return torch.from_numpy(ok)

    def spells(self, text: str) -> bool:
        """True when some sequence of tokens writes exactly `text`."""
        reachable = [True] + [False] * len(text)
        for start in range(len(text)):
            if reachable[start]:
                for tokens in self.index.get(text[start], {}).values():
                    for _, s in tokens:
                        if text.startswith(s, start):
                            reachable[start + len(s)] = True
        return reachable[-1]


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_vocab(tokenizer) -> _Vocab:
    """The tokenizer's indexed token strings and mask cache, built once per tokenizer."""
    vocab = _VOCABS.get(tokenizer)
    if vocab is None:
        vocab = _VOCABS[tokenizer] = _Vocab(tokenizer)
    return vocab


JSON_CHARACTERS = set('{}[]:,"\\ ' + DIGITS + "-.eE+" + "truefalsn" + HEX)


class GrammarConstraint(TokenConstraint):
    """A character grammar lifted to tokens for one sequence: JSON's, a schema's, choices, tool calls.
    The first one built for a tokenizer decodes its whole vocabulary (about a second for 49k tokens);
    later ones share that work and the masks. The end of sequence is allowed where the grammar's
    `may_end(state)`, if it has one, says the answer may stop there (elsewhere the answer ends at DONE).

    ValueError when the tokenizer lacks a one-character token for one of `characters` (then some state
    could have no token), or cannot spell one of `texts` (keys, enum values, choices the grammar must
    write whole). `writes` names what is written, for the errors."""

    def __init__(self, tokenizer, grammar: CharGrammar, characters: set[str] = JSON_CHARACTERS,
                 texts: Iterable[str] = (), writes: str = "this JSON answer"):
        self.grammar, self.writes = grammar, writes
        self._vocab = vocab = token_vocab(tokenizer)
        missing = sorted(characters - vocab.single_chars)
        if missing:
            raise ValueError(f"the tokenizer has no one-character token for {missing}, needed to write {writes}")
        unspellable = next((t for t in texts if not vocab.spells(t)), None)
        if unspellable is not None:
            raise ValueError(f"the tokenizer cannot spell {unspellable!r}, needed to write {writes}")
        self.stops = [t for t in (tokenizer.eos_token_id,) if t is not None]
        self.state = self.grammar.start
        self.text = ""
        self.alphabet = "".join(sorted(characters.union(*map(set, texts))))
        self.wrapping_up = False
        self._completion: str | None = None  # while wrapping up: the rest of the shortest completion

    def allowed(self) -> torch.Tensor:
        if self.wrapping_up:
            mask = self._wrap_up_mask()
            if mask is not None:
                return mask
        mask = self._vocab.mask(self.grammar, self.state)
        if self.stops and self.may_end(self.state):
            mask = mask.clone()
            mask[self.stops] = True
        return mask

    def may_end(self, state) -> bool:
        """The answer may stop at `state` with the end of sequence (the grammar's `may_end`, if any)."""
        may_end = getattr(self.grammar, "may_end", None)
        return may_end is not None and may_end(state)

    def wrap_up(self) -> bool:
        """From now on, finish the answer the shortest way the grammar allows (close the string, give
        the required keys their shortest values, close the brackets) rather than let it run on: the
        engine asks this when the answer loops, which it cannot simply cut without leaving the JSON
        unfinished. False (and nothing changes) when no way to the end is found."""
        self._completion = shortest_completion(self.grammar, self.state, self.alphabet, self.may_end)
        if self._completion is None:
            return False
        self.wrapping_up = True
        return True

    def _wrap_up_mask(self) -> torch.Tensor | None:
        """The tokens that begin the shortest completion (the end of sequence once it is written);
        None when there are none, and then decoding goes on under the grammar alone."""
        if self._completion is None:
            self._completion = shortest_completion(self.grammar, self.state, self.alphabet, self.may_end)
        rest = self._completion
        mask = torch.zeros(self._vocab.size, dtype=torch.bool)
        if rest == "":
            mask[self.stops] = True
        elif rest:
            fitting = [i for tokens in self._vocab.index.get(rest[0], {}).values() for i, s in tokens
                       if rest.startswith(s)]
            mask[fitting] = True
        return mask if mask.any() else None

    def advance(self, token_id: int) -> None:
        vocab = self._vocab
        piece = vocab.strings[token_id] if 0 <= token_id < vocab.size else ""
        state = self.grammar.run(self.state, piece) if piece else None
        if state is None:
            raise ValueError(f"token {token_id} ({piece!r}) cannot come next in {self.writes}, after "
                             f"{self.text[-40:]!r}")
        self.state = state
        self.text += piece
        if self._completion is not None:  # what is left of a shortest completion is a shortest one from here
            self._completion = self._completion[len(piece):] if self._completion.startswith(piece) else None

    @property
    def is_complete(self) -> bool:
        return self.state == DONE


MAX_COMPLETION_STATES = 20_000


def shortest_completion(grammar: CharGrammar, state, alphabet: str, may_end=lambda state: False) -> str | None:
    """The shortest text over `alphabet` that takes `grammar` from `state` to its end (DONE, or a
    state where `may_end`), found breadth first; "" when it is there already; None when none is found
    within MAX_COMPLETION_STATES states. Whitespace and string text step to states already seen, so
    the search stays small: a completion closes what is open and writes what is still required."""
    if state == DONE or may_end(state):
        return ""
    frontier, seen = deque([(state, "")]), {state}
    while frontier:
        current, text = frontier.popleft()
        for ch in alphabet:
            nxt = grammar.step(current, ch)
            if nxt is None or nxt in seen:
                continue
            if nxt == DONE or may_end(nxt):
                return text + ch
            if len(seen) >= MAX_COMPLETION_STATES:
                return None
            seen.add(nxt)
            frontier.append((nxt, text + ch))
    return None


class JsonObjectConstraint(GrammarConstraint):
    """Token-level `JsonGrammar` for one sequence (registered in the engine as "json_object")."""

    def __init__(self, tokenizer, max_depth: int = 32, max_whitespace: int = 24):
        super().__init__(tokenizer, JsonGrammar(max_depth, max_whitespace))
