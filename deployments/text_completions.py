"""The legacy /v1/completions shapes that chat has no counterpart for: `echo` (each choice's text
starts with its prompt, and with `logprobs` the prompt's tokens are scored too) and `max_tokens` 0
(score the prompt, generate nothing). lm-evaluation-harness's `local-completions` model computes
loglikelihoods this way: `echo`, `logprobs` 1, and the prompt's token ids."""
from __future__ import annotations

from pydantic import BaseModel, Field

from deployments.openai_logprobs import completion_logprobs, joined, prompt_logprobs
from deployments.openai_schema import TextChoice
from engine.types import FinishReason, Result, TokenEvent, TokenLogprob


class Echo(BaseModel):
    """What a choice echoes of its prompt."""

    text: str = Field(description="The prompt as sent (a token-id prompt decoded).")
    first_token: str = Field(description="The prompt's first token's text: it opens the logprobs, with none of its own.")


def scored_only(result: Result) -> Result:
    """A result of `max_tokens` 0 (run with one token, since the engine always samples one): its
    prompt's scores, and nothing generated."""
    return result.model_copy(update={"token_ids": [], "text": "", "finish_reason": FinishReason.LENGTH,
                                     "logprobs": None if result.logprobs is None else [], "stop_logprob": None})


def _scored(logprobs: list[TokenLogprob] | None, stop: TokenLogprob | None) -> list[TokenLogprob] | None:
    """An answer's token scores as the legacy API lists them: with the end-of-sequence token that
    ended it, as vLLM lists it (lm-evaluation-harness drops the last entry as the generated one)."""
    return None if logprobs is None else logprobs + ([stop] if stop is not None else [])


def text_choice(index: int, result: Result, echo: Echo | None, finish: str) -> TextChoice:
    """A whole answer as a text choice, its prompt in front when echoed."""
    logprobs, scored = None, _scored(result.logprobs, result.stop_logprob)
    if scored is not None:
        logprobs = completion_logprobs(scored, len(echo.text) if echo else 0)[0]
        if echo is not None:
            logprobs = joined(prompt_logprobs(echo.first_token, result.prompt_logprobs or [])[0], logprobs)
    return TextChoice(index=index, text=(echo.text if echo else "") + result.text, finish_reason=finish,
                      logprobs=logprobs)


class StreamedText:
    """One streamed choice's pieces: the echoed prompt with its first event, text offsets that
    continue from piece to piece, and nothing generated shown for `max_tokens` 0."""

    def __init__(self, echo: Echo | None, generates: bool):
        self.echo, self.generates = echo, generates
        self.offset = 0

    def piece(self, event: TokenEvent) -> tuple[str, dict | None]:
        """The text and the logprobs (None unless asked) this event adds to the choice."""
        logprobs = _scored(event.logprobs, event.stop_logprob)
        text, logprobs = (event.text, logprobs) if self.generates else ("", [] if logprobs is not None else None)
        payload = None
        if self.echo is not None:  # an attempt resumed after a cut scores its prompt again: echoed once
            echo, self.echo = self.echo, None
            if logprobs is not None:
                payload, _ = prompt_logprobs(echo.first_token, event.prompt_logprobs or [])
            self.offset = len(echo.text)
            text = echo.text + text
        if logprobs is not None:
            answer, self.offset = completion_logprobs(logprobs, self.offset)
            payload = answer if payload is None else joined(payload, answer)
        return text, payload
