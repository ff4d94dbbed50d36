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

import torch
from pydantic import BaseModel, Field

from engine.prefix_cache import PrefixEntry
from predictor.model import (LengthRegressor, PredictorSettings, PromptKV, pad_batch, predict_lengths, prefill,
                             with_saved_adapter)
from predictor.prompt import PredictionInput, chat_prompt_ids

DEFAULT_ADAPTER = Path(__file__).resolve().parent / "adapters" / "smollm2-135m"


class PredictorConfig(BaseModel):
    """Where the adapter is and how prediction is batched."""

    adapter: str = Field(str(DEFAULT_ADAPTER), description="Folder of a trained adapter (predictor.train).")
    batch_size: int = Field(16, ge=1, description="Prompts run through the model together.")


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
        self.regressor = LengthRegressor(hf_model.model, self.settings.max_tokens)
        self.model = with_saved_adapter(self.regressor, str(path)).eval()
        self.lm_head = hf_model.lm_head
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.seconds = 0.0  # time spent predicting, for the cost figure
        self.input = PredictionInput(tokenizer)

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
        lengths, entries = [0] * len(prompts), [None] * len(prompts)
        for first in range(0, len(order), self.config.batch_size):
            group = order[first : first + self.config.batch_size]
            got, shared = self._batch([prompts[i] for i in group], [prefixes[i] for i in group], share)
            for row, i in enumerate(group):
                lengths[i] = max(1, min(self.max_tokens, math.ceil(got[row])))
                entries[i] = shared[row] if share else None
        self.seconds += time.perf_counter() - started
        return lengths, entries if share else None

    def _batch(self, prompts: list[list[int]], prefixes: list[PrefixEntry | None], share: bool):
        """One batch: given KV stacked, the rest of each prompt prefilled plain, then the question."""
        config = self.regressor.decoder.config
        cut = [self.input.cut(p) for p in prompts]
        given = [min(len(p.token_ids), keep) if p is not None else 0 for p, (_, keep) in zip(prefixes, cut)]
        kv = PromptKV.empty(config, len(prompts))
        if any(given):
            kv = PromptKV.stack(config, [(p.kv[0][:, :, :g], p.kv[1][:, :, :g]) if p is not None else _no_kv(prefixes)
                                         for p, g in zip(prefixes, given)])
        rest = [ids[g:] for (ids, _), g in zip(cut, given)]
        hidden = None
        if any(rest):
            kv, hidden = prefill(self.model, *pad_batch(rest, self.pad_id), kv)
        suffix = torch.tensor([self.input.suffix] * len(prompts))
        got = predict_lengths(self.model, kv, suffix).tolist()
        if not share:
            return got, None
        entries = []
        for row, (kv_row, prompt, prefix, (_, keep), g) in enumerate(zip(kv.rows(), prompts, prefixes, cut, given)):
            if prefix is not None and len(prefix.token_ids) >= keep:
                entries.append(prefix)
                continue
            last = self.regressor.decoder.norm(hidden[row, keep - g - 1])
            entries.append(PrefixEntry(tuple(prompt[:keep]), (kv_row[0][:, :, :keep].contiguous(),
                                                               kv_row[1][:, :, :keep].contiguous()),
                                       self.lm_head(last).float()))
        return got, entries


def _no_kv(prefixes: list[PrefixEntry | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty KV (no tokens) shaped like the given ones, for a row of a batch that has none."""
    keys = next(p for p in prefixes if p is not None).kv[0]
    empty = keys.new_zeros(keys.shape[0], keys.shape[1], 0, keys.shape[3])
    return empty, empty
