"""What the length predictor reads: the exact prompt the decoder will see (chat template applied,
ending where the answer starts), followed by a fixed question about the answer's length, as if the
assistant began its turn by asking it. Because it only appends to the decoder's prompt ids, any
request can be scored from its ids alone: a chat turn, a raw completion or a plan node."""
from __future__ import annotations

from engine.base import chat_ids

SUFFIX = "(Before I reply: my reply to this will be about this many tokens long:"
MAX_PROMPT_TOKENS = 384  # the labels cut user prompts to this; prediction keeps as much of the prompt
TAIL_TOKENS = 16  # a prompt cut for prediction keeps its end: the template's turn markers live there


def chat_prompt_ids(tokenizer, prompt: str, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> list[int]:
    """The decoder's prompt ids for one user message, cut as the labels cut it."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    return chat_ids(tokenizer, [{"role": "user", "content": tokenizer.decode(ids)}])


class PredictionInput:
    """Turns decoder prompt ids into predictor input ids."""

    def __init__(self, tokenizer, max_tokens: int = MAX_PROMPT_TOKENS + 64):
        self.suffix = tokenizer(SUFFIX, add_special_tokens=False)["input_ids"]
        self.max_tokens = max_tokens

    def cut(self, prompt_ids: list[int]) -> tuple[list[int], int]:
        """The prompt part as the predictor reads it, and how many of its leading ids are the
        decoder prompt's own (all of them unless the prompt was too long and lost its middle)."""
        if len(prompt_ids) > self.max_tokens:
            head = self.max_tokens - TAIL_TOKENS
            return list(prompt_ids[:head]) + list(prompt_ids[-TAIL_TOKENS:]), head
        return list(prompt_ids), len(prompt_ids)

    def __call__(self, prompt_ids: list[int]) -> list[int]:
        return self.cut(prompt_ids)[0] + self.suffix


def prediction_ids(tokenizer, prompt: str) -> list[int]:
    """Predictor input for a user prompt given as text (training and evaluation)."""
    return PredictionInput(tokenizer)(chat_prompt_ids(tokenizer, prompt))
