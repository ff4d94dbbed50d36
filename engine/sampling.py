"""Pick the next token of each sequence from its logits, by its own sampling params."""
from __future__ import annotations

import torch

from collections.abc import Callable

from engine.types import SamplingParams, TokenLogprob, TopLogprob


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private random stream per request, so a seeded request replays whatever its batch mates do
    (and, reseeded at each place, see `sample`, however often a scheduler cut and resumed it)."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(torch_seed(params.seed))
    return generator


def torch_seed(seed: int) -> int:
    """`seed` as torch takes it: as it is within torch's range [-2^63, 2^64), else reduced modulo 2^64
    (a client may send any JSON integer, and a seed outside it raised on the engine's thread)."""
    return seed if -(1 << 63) <= seed < (1 << 64) else seed % (1 << 64)


def _sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(params.top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)  # the most likely always stays
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    masks: list[torch.Tensor | None] | None = None,
    histories: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> list[int]:
    """logits: float32 [batch, vocab] on any device. Greedy rows take the argmax. `masks`, where
    given, holds per row None or a bool mask of the tokens a constraint allows (see
    `engine.constraints`); disallowed tokens get no probability, greedy or sampled. `histories`
    holds each row's generated tokens, for presence and frequency penalties, and `prompts` each
    row's prompt, which the repetition penalty counts too."""
    plain = all(p.greedy and not _penalized(p) and not p.logit_bias for p in params)
    if plain and (masks is None or all(m is None for m in masks)):
        return logits.argmax(dim=-1).tolist()  # where the logits are: a GPU sends back B ids, not B x vocab floats
    logits = logits.cpu()
    if histories is not None and any(_penalized(p) for p in params):
        logits = _apply_penalties(logits, params, histories, prompts)
    if any(p.logit_bias for p in params):
        logits = _apply_biases(logits, params)
    if masks is not None and any(m is not None for m in masks):
        logits = _apply_masks(logits, masks)
    chosen = logits.argmax(dim=-1).tolist()
    for row, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            if p.seed is not None and histories is not None:
                # the draw for the answer's n-th token depends on (seed, n) alone, not on how many draws
                # came before in this process: an answer resumed after a cut samples as if never cut
                g.manual_seed(torch_seed(p.seed * 1_000_003 + len(histories[row])))
            chosen[row] = _sample_one(logits[row], p, g)
    return chosen


def _penalized(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                     prompts: list[list[int]] | None) -> torch.Tensor:
    logits = logits.clone()
    width = logits.shape[-1]
    for row, (p, history) in enumerate(zip(params, histories)):
        if history and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(history), minlength=width)[:width].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history) | set(prompts[row] if prompts else ())), dtype=torch.long)
            seen = seen[seen < width]
            picked = logits[row, seen]
            logits[row, seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    return logits


def _apply_biases(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    logits = logits.clone()
    width = logits.shape[-1]
    for row, p in enumerate(params):
        biased = [(token, bias) for token, bias in p.logit_bias.items() if token < width]
        if biased:
            tokens, biases = zip(*biased)
            logits[row, list(tokens)] += torch.tensor(biases, dtype=logits.dtype)
    return logits


def _apply_masks(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    logits = logits.clone()  # the caller's logits may be cached (prefix entries)
    width = logits.shape[-1]
    for row, mask in enumerate(masks):
        if mask is not None:
            n = min(mask.numel(), width)  # a model's vocab may be padded past the tokenizer's
            logits[row, :n].masked_fill_(~mask[:n], float("-inf"))
            logits[row, n:] = float("-inf")
    return logits


def token_logprobs(logits: torch.Tensor, chosen: list[int], tops: list[int],
                   text: Callable[[int], str]) -> list[TokenLogprob]:
    """Each row's chosen token's log probability under the model's raw logits (before temperature,
    penalties and masks, as vLLM reports them by default), and its row's `tops[row]` most likely
    tokens. `text(token)` gives a token's text."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(chosen, device=logprobs.device)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(max(tops), dim=-1)  # k may be 0: empty rows
    values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(token_id=token, token=text(token), logprob=p,
                     top=[TopLogprob(token_id=i, token=text(i), logprob=v) for i, v in zip(ids[row][:k], values[row][:k])])
        for row, (token, p, k) in enumerate(zip(chosen, picked, tops))
    ]
