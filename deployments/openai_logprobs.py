"""Engine token log probabilities (engine.types.TokenLogprob) in OpenAI's two shapes: chat's
`logprobs.content` entries, and the legacy completions' parallel lists."""
from __future__ import annotations

from engine.types import TokenLogprob, TopLogprob


def _entry(candidate: TopLogprob) -> dict:
    return {"token": candidate.token, "logprob": candidate.logprob, "bytes": list(candidate.token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """A chat choice's (or chunk choice's) `logprobs`: one content entry per token, with its alternatives."""
    return {"content": [{**_entry(e), "top_logprobs": [_entry(t) for t in e.top]} for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> tuple[dict, int]:
    """A text choice's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset), the offsets
    counted from `offset` in the answer's text (0 for a whole answer; where the last chunk left off
    when streaming), and the offset after these tokens."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    payload = {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }
    return payload, offset


def prompt_logprobs(first_token: str, entries: list[TokenLogprob]) -> tuple[dict, int]:
    """An echoed prompt's part of a text choice's `logprobs`: its first token (no logprob, nothing
    comes before it to score it by), then each later token's; and the offset after them."""
    payload, offset = completion_logprobs(entries, len(first_token))
    opening = {"tokens": first_token, "token_logprobs": None, "top_logprobs": None, "text_offset": 0}
    return {key: [opening[key]] + values for key, values in payload.items()}, offset


def joined(first: dict, second: dict) -> dict:
    """Two parts of a text choice's `logprobs`, one after the other."""
    return {key: first[key] + second[key] for key in first}
