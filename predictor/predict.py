"""Length prediction for serving: the prompt through the plain serving model, then the length
question through the model with the trained adapter on (predictor/model.py).

Because the prompt pass is the plain model's prefill, its KV can be shared with the decoder both
ways. `predict_with_kv` returns each prompt's KV as an engine `PrefixEntry` (what
`LLMEngine.import_prefix` takes), and every `predict*` accepts `prefixes`: `PrefixEntry`s of
prompts or of their leading parts (e.g. from `LLMEngine.export_prefix`, or returned earlier), whose
tokens are then not computed again; with a whole prompt given, only the ~16 question tokens run.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field

from engine.llama import LlamaRunner, PrefillItem
from engine.prefix_cache import PrefixEntry
from predictor.model import (LengthRegressor, PredictorSettings, PromptKV, pad_batch, predict_estimates, prefill,
                             readout_for, with_saved_adapter)
from predictor.prompt import PredictionInput, chat_prompt_ids

DEFAULT_ADAPTER = Path(__file__).resolve().parent / "adapters" / "smollm2-135m"


class PredictorConfig(BaseModel):
    """Where the adapter is and how prediction is batched."""

    adapter: str = Field(str(DEFAULT_ADAPTER), description="Folder of a trained adapter (predictor.train).")
    batch_size: int = Field(16, ge=1, description="Prompts run through the model together.")
    prompt_pass: Literal["lean", "hf"] = Field(
        "lean", description="How prompts go through the plain model. lean: the decoder engine's own forward "
        "(fused, prepacked weights, prompts packed without padding): 1.3x faster on the 2-core CPU, and the KV is "
        "bit for bit what the decoder's prefill computes; it holds a second, fused copy of the weights. "
        "hf: the Hugging Face modules (no extra copy).")


class LengthPredictor:
    """`predict(prompts) -> lengths in tokens`. Built on an already loaded HF causal LM, so a replica
    that also decodes holds one copy of the weights: LoRA layers are added beside them and only
    this class's suffix pass runs through the adapter (the engine reads the base weights directly)."""

    def __init__(self, hf_model, tokenizer, config: PredictorConfig | None = None):
        self.config = config or PredictorConfig()
        path = Path(self.config.adapter)
        if not (path / "settings.json").exists():
            raise FileNotFoundError(f"adapter: no trained length adapter in {path} (run python -m predictor.train)")
        self.settings = PredictorSettings.load(path)
        self.tokenizer = tokenizer
        self.regressor = LengthRegressor(hf_model.model, self.settings.max_tokens, readout_for(self.settings))
        self.model = with_saved_adapter(self.regressor, str(path)).eval()
        self.lm_head = hf_model.lm_head
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.seconds = 0.0  # time spent predicting, for the cost figure
        self.input = PredictionInput(tokenizer)
        self.lean = (LeanPromptPass(hf_model, self.config.batch_size, self.input.max_tokens)
                     if self.config.prompt_pass == "lean" else None)

    @property
    def max_tokens(self) -> int:
        return self.settings.max_tokens

    def predict(self, prompts: list[str]) -> list[int]:
        """Lengths of the answers to single user messages given as text."""
        return self.predict_prompt_ids([chat_prompt_ids(self.tokenizer, p) for p in prompts])

    def predict_prompt_ids(self, prompts: list[list[int]],
                           prefixes: list[PrefixEntry | None] | None = None) -> list[int]:
        """Lengths of the answers to prompts given as the decoder's prompt ids."""
        return self._run(prompts, prefixes, share=False)[0]

    def predict_with_kv(self, prompts: list[list[int]], prefixes: list[PrefixEntry | None] | None = None
                        ) -> tuple[list[int], list[PrefixEntry]]:
        """Lengths, and each prompt's plain KV as a `PrefixEntry`: token_ids = the prompt (or, for one
        longer than the predictor reads, its first part), kv = (keys, values), each [layers,
        kv_heads, tokens, head_dim] in the model's dtype, keys after the rotary embedding; and
        last_logits [vocab] (float32) after its last token. A given prefix at least that long is
        returned as it is."""
        lengths, _, entries = self.estimate_with_kv(prompts, prefixes)
        return lengths, entries

    def estimate_with_kv(self, prompts: list[list[int]], prefixes: list[PrefixEntry | None] | None = None
                         ) -> tuple[list[int], list[float], list[PrefixEntry]]:
        """`predict_with_kv` with, from the same pass, each answer's expected length (the mean of a
        bucket head's distribution; a one-unit head's length as it is): the lengths are what to cap and
        bin by, the expected lengths what to order requests by (shortest first)."""
        return self._run(prompts, prefixes, share=True)  # type: ignore[return-value]

    def predict_ids(self, sequences: list[list[int]]) -> list[int]:
        """Lengths from predictor input ids: prompt ids followed by the length question (see predictor.prompt)."""
        n = len(self.input.suffix)
        if any(list(s[-n:]) != self.input.suffix or len(s) <= n for s in sequences):
            raise ValueError("sequences: each must be prompt ids followed by the length question (PredictionInput)")
        return self.predict_prompt_ids([list(s[:-n]) for s in sequences])

    @torch.no_grad()
    def _run(self, prompts: list[list[int]], prefixes: list[PrefixEntry | None] | None, share: bool):
        started = time.perf_counter()
        prefixes = prefixes or [None] * len(prompts)
        if len(prefixes) != len(prompts):
            raise ValueError("prefixes: one entry (or None) per prompt")
        for i, (prompt, prefix) in enumerate(zip(prompts, prefixes)):
            if prefix is not None and list(prefix.token_ids) != list(prompt[: len(prefix.token_ids)]):
                raise ValueError(f"prefixes: entry {i} is not a prefix of its prompt")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        lengths, expected, entries = [0] * len(prompts), [0.0] * len(prompts), [None] * len(prompts)
        for first in range(0, len(order), self.config.batch_size):
            group = order[first : first + self.config.batch_size]
            (got, means), shared = self._batch([prompts[i] for i in group], [prefixes[i] for i in group], share)
            for row, i in enumerate(group):
                lengths[i] = max(1, min(self.max_tokens, math.ceil(got[row])))
                expected[i] = means[row]
                entries[i] = shared[row] if share else None
        self.seconds += time.perf_counter() - started
        return lengths, expected, entries if share else None

    def _batch(self, prompts: list[list[int]], prefixes: list[PrefixEntry | None], share: bool):
        """One batch: given KV stacked, the rest of each prompt prefilled plain, then the question."""
        cut = [self.input.cut(p) for p in prompts]
        given = [min(len(p.token_ids), keep) if p is not None else 0 for p, (_, keep) in zip(prefixes, cut)]
        if self.lean is not None:
            kv, after_keep = self._lean_prompt_pass(cut, prefixes, given)
        else:
            kv, after_keep = self._hf_prompt_pass(cut, prefixes, given)
        suffix = torch.tensor([self.input.suffix] * len(prompts))
        got = tuple(t.tolist() for t in predict_estimates(self.model, kv, suffix))
        if not share:
            return got, None
        entries = []
        for row, (kv_row, prompt, prefix, (_, keep)) in enumerate(zip(kv.rows(), prompts, prefixes, cut)):
            if prefix is not None and len(prefix.token_ids) >= keep:
                entries.append(prefix)
                continue
            entries.append(PrefixEntry(tuple(prompt[:keep]), (kv_row[0][:, :, :keep].contiguous(),
                                                               kv_row[1][:, :, :keep].contiguous()),
                                       after_keep(row)))
        return got, entries

    def _lean_prompt_pass(self, cut, prefixes, given):
        """PromptKV of the cut prompts through the engine's forward, and `after_keep(row)`: the
        logits after the row's `keep` tokens (asked only for rows whose prefix does not cover them)."""
        rows, logits = self.lean.run([ids for ids, _ in cut], [keep for _, keep in cut], prefixes, given)
        return PromptKV.stack(self.regressor.decoder.config, rows), logits.__getitem__

    def _hf_prompt_pass(self, cut, prefixes, given):
        config = self.regressor.decoder.config
        kv = PromptKV.empty(config, len(cut))
        if any(given):
            kv = PromptKV.stack(config, [(p.kv[0][:, :, :g], p.kv[1][:, :, :g]) if p is not None else _no_kv(prefixes)
                                         for p, g in zip(prefixes, given)])
        rest = [ids[g:] for (ids, _), g in zip(cut, given)]
        hidden = None
        if any(rest):
            kv, hidden = prefill(self.model, *pad_batch(rest, self.pad_id), kv)

        def after_keep(row: int) -> torch.Tensor:
            keep, g = cut[row][1], given[row]
            return self.lm_head(self.regressor.decoder.norm(hidden[row, keep - g - 1])).float()

        return kv, after_keep


class LeanPromptPass:
    """Prompts through the plain model on the decoder engine's forward (`engine.llama.LlamaRunner`):
    fused and prepacked weights, a batch's prompts packed into one pass without padding. On 128
    prompts of the schedule benchmark's workload (2-core CPU, quiet) it took 25.8 s against 34.8 s for
    the Hugging Face modules, as long as the engine's own prefill of them (25.9 s); and what it
    computes is exactly what the decoder's own prefill computes, so the KV handed to the
    decoder is bit for bit the decoder's."""

    PACK_TOKENS = 2048  # tokens per forward call, as the engine's default max_prefill_tokens

    def __init__(self, hf_model, slots: int, max_len: int):
        self.runner = LlamaRunner(hf_model, max_slots=slots, max_len=max_len)

    def run(self, prompts: list[list[int]], keeps: list[int], prefixes: list[PrefixEntry | None],
            given: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor | None]]:
        """Each prompt's KV ([layers, kv_heads, len(prompt), head_dim] keys and values), starting
        from the first `given[i]` tokens' KV in `prefixes[i]`; and the float32 logits after its
        first `keeps[i]` tokens where they were computed here (None where the prefix covers them)."""
        if len(prompts) > self.runner.max_slots:
            raise ValueError(f"prompts: at most {self.runner.max_slots} a pass, got {len(prompts)}")
        if any(len(p) > self.runner.max_len for p in prompts):
            raise ValueError(f"prompts: at most {self.runner.max_len} tokens each (cut them first)")
        logits: list[torch.Tensor | None] = [None] * len(prompts)
        items = []
        for slot, (ids, keep, prefix, g) in enumerate(zip(prompts, keeps, prefixes, given)):
            if g:
                self.runner.write_slot(slot, (prefix.kv[0][:, :, :g], prefix.kv[1][:, :, :g]))
            if g < len(ids):
                items.append(PrefillItem(slot, list(ids[g:]), g, prefix_end=keep))
        for pack in _packs(items, self.PACK_TOKENS):
            out = self.runner.prefill(pack)
            asking = [item for item in pack if item.prefix_row() is not None]
            for item, last in zip(pack, out):
                if item.start + len(item.token_ids) == keeps[item.slot]:
                    logits[item.slot] = last
            for item, at_keep in zip(asking, out[len(pack):]):
                logits[item.slot] = at_keep
        return [self.runner.read_slot(slot, len(ids)) for slot, ids in enumerate(prompts)], logits


def _packs(items: list[PrefillItem], tokens: int) -> list[list[PrefillItem]]:
    """Items in order, grouped into packs of about `tokens` new tokens (one item may exceed it alone)."""
    packs, size = [[]], 0
    for item in items:
        if packs[-1] and size + len(item.token_ids) > tokens:
            packs.append([])
            size = 0
        packs[-1].append(item)
        size += len(item.token_ids)
    return [pack for pack in packs if pack]


def _no_kv(prefixes: list[PrefixEntry | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty KV (no tokens) shaped like the given ones, for a row of a batch that has none."""
    keys = next(p for p in prefixes if p is not None).kv[0]
    empty = keys.new_zeros(keys.shape[0], keys.shape[1], 0, keys.shape[3])
    return empty, empty
