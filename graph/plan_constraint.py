"""A decoding constraint under which a model can only write well-formed plan lines.

The grammar is the `graph.plan_format` line format, made strict. Line k (k = 1, 2, ...) is

    <k>. <text> [needs: none]\\n    or    <k>. <text> [needs: <a>, <b>, ...]\\n

- text: starts with a letter or digit; printable characters except '[' and ']'; words separated
  by single spaces; 2 to `max_words` words of at most `max_word_chars` characters each. After the
  last allowed word only " [" can follow, so every line ends.
- the ids a, b, ... are distinct, increasing and below k: self-loops, forward references and
  cycles cannot be written.
- after at least MIN_NODES lines a blank line (a "\\n" right after a line's "\\n") ends the plan,
  and so does the end-of-sequence token, right after a line's ']' or its newline (where a chat
  model tends to write it); after `max_nodes` lines one of them must come. The blank line makes
  `is_complete` (the engine stops there); EOS stops the engine by itself. It is allowed nowhere else.
The grammar does not read the text, so two lines may still ask the same thing (repair drops it).

`PlanGrammar` is the character-level machine. `PlanLineConstraint` lifts it to tokens exactly: a
token is allowed when the machine accepts its whole decoded string from the current state, so a
token spanning a boundary ("?\\n", " [", "]\\n\\n") is allowed where its every character is. Per
tokenizer, each token's string and a few counts are computed once (`_Vocab`), so that a step
costs a handful of tensor ops over the vocabulary rather than a Python loop over it:
- inside the text, tokens made only of text characters are judged by their counts (word starts,
  leading and longest runs) in vectorized form, and the few tokens holding '[' (the
  only way out of the text) are run through the machine one by one;
- everywhere else few tokens can fit (digits, the literal "[needs: ", ids, "]", newlines), so the
  tokens are found through an index on their first two characters and run through the machine,
  and the mask is cached per state (those states are few).
Token strings are decoded one token alone; tokens holding half a UTF-8 character (U+FFFD when
alone) and special tokens are never allowed.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from engine.constraints import DONE, CharGrammar, TokenConstraint, first_two_index, narrow_mask, token_strings
from graph.plan import MIN_NODES

MIN_WORDS = 2
NEEDS = "needs: "
_DOT, _SPACE, _WORD = 0, 1, 2  # inside the text: after "k.", after a space, inside a word


def _is_text_char(ch: str) -> bool:
    return ch.isprintable() and not ch.isspace() and ch not in "[]\ufffd"


@dataclass(frozen=True)
class PlanGrammar(CharGrammar):
    """The plan line grammar as a character-level state machine; states are small tuples.

    `step(state, ch)` is the next state or None when `ch` cannot come next; DONE accepts nothing."""

    max_nodes: int = 6
    max_words: int = 16
    max_word_chars: int = 24
    start: ClassVar[tuple] = ("num", 1, 0)

    def __post_init__(self) -> None:
        if self.max_nodes < MIN_NODES or self.max_words < MIN_WORDS or self.max_word_chars < 1:
            raise ValueError(f"max_nodes >= {MIN_NODES}, max_words >= {MIN_WORDS} and max_word_chars >= 1 are needed")

    def step(self, state: tuple, ch: str) -> tuple | None:
        kind = state[0]
        if kind == "text":
            return self._text(state, ch)
        if kind == "num":  # the line's own number and its period
            _, k, i = state
            if i == 0 and ch == "\n" and k > MIN_NODES:
                return DONE
            label = f"{k}."
            if k > self.max_nodes or ch != label[i]:
                return None
            return ("num", k, i + 1) if i + 1 < len(label) else ("text", k, 0, _DOT, 0)
        if kind == "lit":
            _, literal, i, then = state
            if ch != literal[i]:
                return None
            return ("lit", literal, i + 1, then) if i + 1 < len(literal) else then
        if kind == "deps":  # right after "[needs: "
            k = state[1]
            if ch == "n":
                return ("lit", "none]", 1, ("eol", k))
            return self._digit(k, 0, 0, ch)
        if kind == "id":
            _, k, last, cur = state
            if ch == "]" and last < cur < k:
                return ("eol", k)
            if ch == "," and last < cur < k - 1:  # only if a larger id is still possible
                return ("lit", " ", 0, ("idstart", k, cur))
            return self._digit(k, last, cur, ch)
        if kind == "idstart":
            return self._digit(state[1], state[2], 0, ch)
        if kind == "eol":  # after the closing ']'
            return ("num", state[1] + 1, 0) if ch == "\n" else None
        return None

    def _text(self, state: tuple, ch: str) -> tuple | None:
        _, k, words, flag, run = state
        if ch == " ":
            return None if flag == _SPACE else ("text", k, words, _SPACE, 0)
        if flag == _DOT:
            return None
        if ch == "[":
            ok = flag == _SPACE and words >= MIN_WORDS
            return ("lit", NEEDS, 0, ("deps", k)) if ok else None
        if not _is_text_char(ch):
            return None
        if flag == _SPACE:
            if words >= self.max_words or (words == 0 and not ch.isalnum()):
                return None
            return ("text", k, words + 1, _WORD, 1)
        return ("text", k, words, _WORD, run + 1) if run < self.max_word_chars else None

    @staticmethod
    def _digit(k: int, last: int, cur: int, ch: str) -> tuple | None:
        """Extend the id being written with digit `ch` if some id in (last, k) starts that way."""
        if ch not in "0123456789" or cur == 0 and ch == "0":
            return None
        value = cur * 10 + int(ch)
        prefix = str(value)
        if any(str(n).startswith(prefix) for n in range(last + 1, k)):
            return ("id", k, last, value)
        return None

    @staticmethod
    def can_end(state: tuple | None) -> bool:
        """True where the plan may end (by EOS, or by a blank line once at a line start): after
        the ']' or the newline that closes line MIN_NODES or a later one, or at the end itself."""
        if state is None or state == DONE:
            return state == DONE
        kind, k = state[0], state[1]
        return kind == "eol" and k >= MIN_NODES or kind == "num" and state[2] == 0 and k > MIN_NODES


class _Vocab:
    """What the constraint needs to know about one tokenizer's tokens, computed once."""

    def __init__(self, tokenizer):
        self.size = len(tokenizer)
        self.strings = token_strings(tokenizer)
        self.single_chars = {s for s in self.strings if len(s) == 1}
        self.eos = torch.zeros(self.size, dtype=torch.bool)
        eos = tokenizer.eos_token_id
        for i in eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]:
            self.eos[i] = True
        self._text_counts()
        self.exits = [(i, s) for i, s in enumerate(self.strings) if "[" in s and self._texty(s[: s.index("[")])]
        self.index = first_two_index(self.strings)
        self.masks: dict[tuple, torch.Tensor] = {}  # (grammar, state) -> mask, outside the text

    @staticmethod
    def _texty(s: str) -> bool:
        return "  " not in s and all(ch == " " or _is_text_char(ch) for ch in s)

    def _text_counts(self) -> None:
        """Per token made only of text characters and single spaces: does it start with a space,
        how many words start in it (after a space), its leading and longest runs, whether a text
        may start with it. numpy, not torch: torch spreads such small ops over threads, which
        costs milliseconds a step on busy cores."""
        n = self.size
        columns = {name: [0] * n for name in ("pure", "lead", "starts", "head", "maxrun", "alnum", "dot")}
        for i, s in enumerate(self.strings):
            if not s or not self._texty(s):
                continue
            runs = [len(r) for r in s.split(" ")]
            lead = s[0] == " "
            for name, value in (("pure", 1), ("lead", lead), ("starts", sum(1 for r in runs if r)),
                                ("head", runs[0]), ("maxrun", max(runs)), ("alnum", s[0].isalnum()),
                                ("dot", lead and (len(s) == 1 or s[1].isalnum()))):
                columns[name][i] = int(value)
        for name in ("pure", "lead", "alnum", "dot"):
            setattr(self, name, np.array(columns[name], dtype=bool))
        for name in ("starts", "head", "maxrun"):
            setattr(self, name, np.array(columns[name], dtype=np.int32))

    def mask(self, grammar: PlanGrammar, state: tuple) -> torch.Tensor:
        if state[0] == "text":
            return self._text_mask(grammar, state)
        key = (grammar, state)
        if key not in self.masks:
            mask = self.eos.clone() if state == DONE else narrow_mask(grammar, state, self.index, self.size)
            self.masks[key] = mask | self.eos if grammar.can_end(state) else mask
        return self.masks[key]

    def _text_mask(self, grammar: PlanGrammar, state: tuple) -> torch.Tensor:
        _, _, words, flag, run = state
        ok = self.pure & (self.maxrun <= grammar.max_word_chars)
        if flag == _DOT:
            ok &= self.dot
            new_words = self.starts
        elif flag == _SPACE:
            ok &= self.alnum if words == 0 else ~self.lead
            new_words = self.starts + words
        else:  # a token without a leading space continues the current word
            ok &= self.lead | (self.head <= grammar.max_word_chars - run)
            new_words = self.starts + self.lead + (words - 1)
        ok &= new_words <= grammar.max_words
        ok[[i for i, s in self.exits if grammar.run(state, s) is not None]] = True
        return torch.from_numpy(ok)


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab_for(tokenizer) -> _Vocab:
    vocab = _VOCABS.get(tokenizer)
    if vocab is None:
        vocab = _VOCABS[tokenizer] = _Vocab(tokenizer)
    return vocab


class PlanLineConstraint(TokenConstraint):
    """Token-level `PlanGrammar` for one sequence (registered in the engine as "plan_lines").

    The first one built for a tokenizer decodes its whole vocabulary (about a second for 49k
    tokens); later ones share that work. ValueError when the tokenizer lacks a one-character
    token for some character of the format, since then some states could have no token at all."""

    def __init__(self, tokenizer, max_nodes: int = 6, max_words: int = 16, max_word_chars: int = 24):
        self.grammar = PlanGrammar(max_nodes, max_words, max_word_chars)
        self._vocab = _vocab_for(tokenizer)
        needed = set(".[]:, \n" + NEEDS + "none" + "".join(str(k) for k in range(1, max_nodes + 1)))
        missing = sorted(needed - self._vocab.single_chars)
        if missing:
            raise ValueError(f"the tokenizer has no one-character token for {missing}, needed to write plan lines")
        self.state: tuple = self.grammar.start
        self.text = ""
        self._mask: tuple[tuple | None, torch.Tensor | None] = (None, None)  # (state, its mask)

    def allowed(self) -> torch.Tensor:
        # asked twice per state under jump-forward (`forced`, then sampling): free-text masks are not cached
        if self._mask[0] != self.state:
            self._mask = (self.state, self._vocab.mask(self.grammar, self.state))
        return self._mask[1]

    def advance(self, token_id: int) -> None:
        vocab = self._vocab
        if self.grammar.can_end(self.state) and 0 <= token_id < vocab.size and vocab.eos[token_id]:
            self.state = DONE
            return
        piece = vocab.strings[token_id] if 0 <= token_id < vocab.size else ""
        state = self.grammar.run(self.state, piece) if piece else None
        if state is None:
            raise ValueError(f"token {token_id} ({piece!r}) cannot come next in a plan, after {self.text[-40:]!r}")
        self.state = state
        self.text += piece

    @property
    def is_complete(self) -> bool:
        return self.state == DONE
