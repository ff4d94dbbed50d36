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

from engine.llama import LlamaRunner, PrefillItem, row_ranges
from engine.prefix_cache import PrefixEntry
from predictor.model import (LengthRegressor, PredictorSettings, PromptKV, lora_deltas, pad_batch, predict_estimates,
                             prefill, readout_for, with_saved_adapter)
from predictor.prompt import PredictionInput, chat_prompt_ids

DEFAULT_ADAPTER = Path(__file__).resolve().parent / "adapters" / "smollm2-135m"


class PredictorConfig(BaseModel):
    """Where the adapter is and how prediction is batched."""

    adapter: str = Field(str(DEFAULT_ADAPTER), description="Folder of a trained adapter (predictor.train).")
    batch_size: int = Field(16, ge=1, description="Prompts run through the model together.")
    prompt_pass: Literal["lean", "hf"] = Field(
        "lean", description="How prompts go through the plain model. lean: the decoder engine's own forward "
        "(fused, prepacked weights, prompts packed without padding), the length question folded into the same "
        "pass with the adapter merged into copies of the adapted layers: on the 2-core CPU the prompts go through "
        "1.3x faster than hf's, the question takes a lone request from 0.49 s to 0.35 s, and the KV is bit for bit "
        "what the decoder's prefill computes; it "
        "holds a second, fused copy of the weights (and of the adapted layers). "
        "hf: the Hugging Face modules and peft's LoRA layers (no extra copy).")


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
        self.lean = (LeanPromptPass(hf_model, self.config.batch_size, self.input.max_tokens, len(self.input.suffix))
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
            rows, logits, hidden = self.lean.run([ids for ids, _ in cut], [keep for _, keep in cut], prefixes, given,
                                                 self.input.suffix)
            out = self.regressor.head_output(hidden)
            readout = self.regressor.readout
            got = (readout.lengths(out).tolist(), readout.expected(out).tolist())
            after_keep = logits.__getitem__
        else:
            kv, after_keep = self._hf_prompt_pass(cut, prefixes, given)
            suffix = torch.tensor([self.input.suffix] * len(prompts))
            got = tuple(t.tolist() for t in predict_estimates(self.model, kv, suffix))
            rows = kv.rows() if share else []
        if not share:
            return got, None
        entries = []
        for row, (kv_row, prompt, prefix, (_, keep)) in enumerate(zip(rows, prompts, prefixes, cut)):
            if prefix is not None and len(prefix.token_ids) >= keep:
                entries.append(prefix)
                continue
            kv_kept = kv_row if kv_row[0].shape[2] == keep else (kv_row[0][:, :, :keep].contiguous(),
                                                                  kv_row[1][:, :, :keep].contiguous())
            entries.append(PrefixEntry(tuple(prompt[:keep]), kv_kept, after_keep(row)))
        return got, entries

    def _hf_prompt_pass(self, cut, prefixes, given):
        config = self.regressor.decoder.config
        kv = PromptKV.empty(config, len(cut), self.regressor.device)
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
    decoder is bit for bit the decoder's (on the CPU: on a GPU both group items' attention by length,
    engine.item_attention, and the groups differ in the last bits).

    The length question (the suffix) runs in the same pass: below the first adapted layer it is just
    more tokens after each prompt (the adapter leaves those layers alone); from there on it runs
    through copies of the layers with the adapter merged into their weights, attending to the
    prompt's plain KV. Through the Hugging Face
    modules and peft's unmerged LoRA the suffix cost 0.25 s of the 0.49 s a request took when requests
    come one at a time (as a service meets them): those modules re-read every weight per projection
    with little work to hide it behind. Here a request alone takes 0.35 s, where the engine's own
    prefill of the prompt takes 0.27 s (85-token prompts of the schedule workload, 2-core CPU)."""

    PACK_TOKENS = 2048  # tokens per forward call, as the engine's default max_prefill_tokens

    def __init__(self, hf_model, slots: int, max_len: int, suffix_len: int = 0):
        self.runner = LlamaRunner(hf_model, max_slots=slots, max_len=max_len + suffix_len)
        self.max_prompt, self.suffix_len = max_len, suffix_len
        deltas = [lora_deltas(layer) for layer in hf_model.model.layers]
        self.suffix_layers = [self.runner.fused_layer(i, layer, d) for i, (layer, d) in
                              enumerate(zip(hf_model.model.layers, deltas))]
        self.first_adapted = next((i for i, d in enumerate(deltas) if d), len(deltas))

    def run(self, prompts: list[list[int]], keeps: list[int], prefixes: list[PrefixEntry | None],
            given: list[int], suffix: list[int] = ()
            ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor | None], torch.Tensor | None]:
        """Each prompt's KV ([layers, kv_heads, len(prompt), head_dim] keys and values), starting
        from the first `given[i]` tokens' KV in `prefixes[i]`; the float32 logits after its first
        `keeps[i]` tokens where they were computed here (None where the prefix covers them); and, with
        a `suffix`, the final hidden states (after the final norm) of its last token after each prompt
        with the adapter on [prompts, hidden] (else None)."""
        if len(prompts) > self.runner.max_slots:
            raise ValueError(f"prompts: at most {self.runner.max_slots} a pass, got {len(prompts)}")
        if any(len(p) > self.max_prompt for p in prompts):
            raise ValueError(f"prompts: at most {self.max_prompt} tokens each (cut them first)")
        if len(suffix) > self.suffix_len:
            raise ValueError(f"suffix: at most {self.suffix_len} tokens, got {len(suffix)}")
        logits: list[torch.Tensor | None] = [None] * len(prompts)
        hidden: list[torch.Tensor | None] = [None] * len(prompts)
        items = []
        for slot, (ids, prefix, g) in enumerate(zip(prompts, prefixes, given)):
            if g:
                self.runner.write_slot(slot, (prefix.kv[0][:, :, :g], prefix.kv[1][:, :, :g]))
            if g < len(ids):
                items.append(PrefillItem(slot, list(ids[g:]), g, prefix_end=keeps[slot]))
            if suffix:
                items.append(PrefillItem(slot, list(suffix), len(ids)))
        for pack in _packs(items, self.PACK_TOKENS):
            is_suffix = [bool(suffix) and item.start == len(prompts[item.slot]) for item in pack]
            self._pass(pack, is_suffix, keeps, logits, hidden)
        kv = [self.runner.read_slot(slot, len(ids)) for slot, ids in enumerate(prompts)]
        return kv, logits, torch.stack(hidden) if suffix else None

    def _pass(self, pack: list[PrefillItem], is_suffix: list[bool], keeps: list[int], logits: list,
              hidden: list) -> None:
        """One forward over a pack of prompt and suffix items (a suffix after its prompt, in this pack or
        an earlier one): all together up to the first adapted layer; then the prompts through the rest
        of the plain layers, and after them the suffixes through the adapted copies (a suffix attends to
        its prompt's KV of each layer, in place by then). A prompt's tokens are their own item, so their
        attention, and with it their KV, is bit for bit what a plain prefill computes (on the CPU)."""
        runner, first = self.runner, self.first_adapted
        x, bounds = runner.run_layers(pack, runner.layers[:first])
        parts = {}
        for suffixes, layers in ((False, runner.layers), (True, self.suffix_layers)):
            chosen = [k for k, flag in enumerate(is_suffix) if flag == suffixes]
            items = [pack[k] for k in chosen]
            rows = x[[r for k in chosen for r in range(*bounds[k])]]
            if items:
                rows, _ = runner.run_layers(items, layers[first:], rows, first)
            parts[suffixes] = items, rows
        prompts, prompt_rows = parts[False]
        asked = {}  # slot: the row after its `keep` tokens, where this pass computed it
        for item, (lo, hi) in zip(prompts, row_ranges(prompts)):
            if item.prefix_row() is not None:
                asked[item.slot] = lo + item.prefix_row()
            elif item.start + len(item.token_ids) == keeps[item.slot]:
                asked[item.slot] = hi - 1
        if asked:  # one LM head pass for them all: its weight is the largest the model has
            for slot, row_logits in zip(asked, runner.logits(prompt_rows[list(asked.values())])):
                logits[slot] = row_logits
        suffixes, suffix_rows = parts[True]
        for item, (_, hi) in zip(suffixes, row_ranges(suffixes)):
            hidden[item.slot] = runner.final_hidden(suffix_rows[hi - 1])


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
