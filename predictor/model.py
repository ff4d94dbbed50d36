"""The length predictor's network: the serving model's own transformer, a LoRA adapter on its top
layers that is switched on only for the fixed length question (the suffix, predictor/prompt.py),
and a one-unit head on the question's last final hidden state.

The forward runs in two passes. The prompt goes through with the adapter off, which is exactly the
serving model's plain prefill, so its KV cache is the one the decoder computes for that prompt
anyway: it can be handed in (prediction then costs only the suffix) and handed on to the decoder.
The suffix then runs with the adapter on, attending to that plain KV.

That also makes training cheap: the prompt pass has no gradient and the layers below the first
LoRA layer are the plain model for the suffix too, so for each training prompt the top layers'
plain KV and the suffix's hidden states entering the first LoRA layer are computed once
(`suffix_features`), and every epoch runs only the suffix's few tokens through the top layers.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from pydantic import BaseModel, Field
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [layers, kv_heads, length, head_dim] each, as PrefixEntry.kv


class PredictorSettings(BaseModel):
    """Shape of the adapter; stored beside it (settings.json) so loading rebuilds the same network."""

    max_tokens: int = Field(256, ge=1, description="Largest length predicted: the labels' max_tokens.")
    lora_layers: int = Field(8, ge=1, description="How many of the top decoder layers get LoRA.")
    rank: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout while training.")
    head: Literal["regression", "buckets"] = Field(
        "regression", description="What the head reads out. regression: one unit, length = max_tokens x "
        "sigmoid, trained with L1 loss (the median). buckets: a distribution over length buckets of "
        "`bucket_width` tokens plus one class for answers cut at max_tokens, trained with cross-entropy on "
        "targets smoothed over neighbouring buckets; the length given is the one with the most probability "
        "within 50 and within 100 tokens of it (a bimodal case, short or cut, is not split down the middle).")
    bucket_width: int = Field(8, ge=1, description="Tokens per length bucket (head: buckets).")
    bucket_smoothing: float = Field(
        16.0, gt=0, description="Width (tokens, a Gaussian's sigma) over which a training label's probability "
        "is spread across neighbouring buckets (head: buckets).")
    adapter_on: Literal["suffix"] = Field(
        "suffix", description="Tokens the adapter runs on: only the length question, over the prompt's plain KV. "
        "Adapters saved without this field ran it on the prompt too and are refused by `load`.")

    @classmethod
    def load(cls, folder: Path) -> PredictorSettings:
        raw = json.loads((Path(folder) / "settings.json").read_text())
        if raw.get("adapter_on") != "suffix":
            raise ValueError(f"adapter: {folder} was trained with the adapter on the prompt tokens as well (its "
                             "settings.json lacks adapter_on: 'suffix'); this predictor runs the prompt through the "
                             "plain model, so that adapter would be mis-used. Retrain it: python -m predictor.train")
        return cls.model_validate(raw)


@dataclass
class PromptKV:
    """Plain KV of a batch of prompts. `cache` layers hold [batch, kv_heads, width, head_dim], right
    padded; `mask` [batch, width] marks real tokens; `lengths` [batch] counts them (= the next
    position). Real tokens need not be contiguous: a prompt extended in two passes has padding
    between its parts, which the attention mask hides and the positions skip."""

    cache: DynamicCache
    mask: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, config, batch: int, device: torch.device | str = "cpu") -> PromptKV:
        return cls(DynamicCache(config=config), torch.zeros(batch, 0, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))

    @classmethod
    def stack(cls, config, rows: list[KV], first_layer: int = 0, dtype: torch.dtype | None = None) -> PromptKV:
        """Batch per-prompt KV whose layers start at `first_layer` (the cache's lower layers stay empty)."""
        layers, heads, _, dim = rows[0][0].shape
        lengths = [k.shape[2] for k, _ in rows]
        dtype, device = dtype or rows[0][0].dtype, rows[0][0].device
        keys = torch.zeros(2, layers, len(rows), heads, max(lengths), dim, dtype=dtype, device=device)
        mask = torch.zeros(len(rows), max(lengths), dtype=torch.long, device=device)
        for i, (k, v) in enumerate(rows):
            keys[0, :, i, :, : lengths[i]] = k
            keys[1, :, i, :, : lengths[i]] = v
            mask[i, : lengths[i]] = 1
        cache = DynamicCache(config=config)
        for j in range(layers):
            cache.layers[first_layer + j].update(keys[0, j], keys[1, j])
        return cls(cache, mask, torch.tensor(lengths, device=device))

    def rows(self, first_layer: int = 0) -> list[KV]:
        """Per-prompt KV of layers `first_layer`.., padding dropped (copies, safe to keep)."""
        layers = self.cache.layers[first_layer:]
        keys = torch.stack([layer.keys for layer in layers])
        values = torch.stack([layer.values for layer in layers])
        return [(keys[:, i][:, :, real], values[:, i][:, :, real]) for i, real in enumerate(self.mask.bool())]


class RegressionReadout:
    """One unit: length = max_tokens x sigmoid(unit); L1 loss, so it learns the median length."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.outputs = 1

    def lengths(self, out: torch.Tensor) -> torch.Tensor:
        return self.max_tokens * torch.sigmoid(out.squeeze(-1))

    def expected(self, out: torch.Tensor) -> torch.Tensor:
        """The one length it has (a median, not a mean)."""
        return self.lengths(out)

    def loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (self.lengths(out) - labels).abs().mean() / self.max_tokens


class BucketReadout:
    """A distribution over lengths: classes 0..n-1 are buckets of `width` tokens ([0, width),
    [width, 2 width), ...) and class n is "cut at max_tokens", which holds a large share of the labels
    (the serving model often runs to its cap). Trained with cross-entropy on a label's probability
    spread over neighbouring classes (Gaussian, `smoothing` tokens), so that nearby lengths share
    what they learn. The length read out is the whole number that the distribution puts most
    probability within `RADII` tokens of (both radii weighted alike): where a prompt is either answered
    briefly or runs to the cap, that picks one of the two instead of the median between them."""

    RADII = (50, 100)

    def __init__(self, max_tokens: int, width: int, smoothing: float):
        self.max_tokens, self.width, self.smoothing = max_tokens, width, smoothing
        self.buckets = math.ceil(max_tokens / width)
        self.outputs = self.buckets + 1
        lows = [k * width for k in range(self.buckets)]
        highs = [min(low + width, max_tokens) for low in lows]  # exclusive
        self.values = torch.tensor([(low + high - 1) / 2 for low, high in zip(lows, highs)] + [float(max_tokens)])
        self.candidates = torch.arange(1, max_tokens + 1, dtype=torch.float32)
        reach = torch.zeros(len(self.candidates), self.outputs)  # P(within a radius of candidate | class), summed
        for radius in self.RADII:
            for k, (low, high) in enumerate(zip(lows, highs)):
                inside = ((self.candidates + radius + 1).clamp(max=high) - (self.candidates - radius).clamp(min=low))
                reach[:, k] += inside.clamp(min=0) / (high - low)
            reach[:, -1] += ((self.candidates - max_tokens).abs() <= radius).float()
        # among lengths that tie on reach (every one from max_tokens - 50 up covers "cut"), the one with
        # the least expected error: an answer surely cut reads max_tokens, not max_tokens - 50
        distance = (self.candidates[:, None] - self.values[None, :]).abs() / max_tokens
        self.reach, self.score = reach, reach - 1e-4 * distance

    def classes(self, labels: torch.Tensor) -> torch.Tensor:
        """Each label's class: its bucket, or the last class for a label at the cap."""
        return torch.where(labels >= self.max_tokens, self.buckets,
                           (labels // self.width).clamp(max=self.buckets - 1)).long()

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        distance = self.values.to(labels.device)[None, :] - labels.float()[:, None]
        weights = torch.exp(-0.5 * (distance / self.smoothing) ** 2)
        rows = torch.arange(len(labels), device=labels.device)
        weights[rows, self.classes(labels)] += 1e-6  # a label never lands on all zeros
        return weights / weights.sum(dim=1, keepdim=True)

    def lengths(self, out: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(out.float(), dim=-1)
        best = (probabilities @ self.score.to(out.device).T).argmax(dim=-1)
        return self.candidates.to(out.device)[best]

    def expected(self, out: torch.Tensor) -> torch.Tensor:
        """The distribution's mean length (each bucket at its middle). Worse than `lengths` at landing
        within 50 or 100 tokens, but better at ordering answers by length: where a prompt may be answered
        briefly or run to the cap, it lies between the two instead of choosing one."""
        return torch.softmax(out.float(), dim=-1) @ self.values.to(out.device)

    def loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return -(self.targets(labels) * torch.log_softmax(out.float(), dim=-1)).sum(dim=-1).mean()


def readout_for(settings: PredictorSettings) -> RegressionReadout | BucketReadout:
    if settings.head == "buckets":
        return BucketReadout(settings.max_tokens, settings.bucket_width, settings.bucket_smoothing)
    return RegressionReadout(settings.max_tokens)


class LengthRegressor(nn.Module):
    """Predicted length in tokens from head(final hidden state of the last suffix token), read out by
    `readout` (one unit: max_tokens * sigmoid; or a distribution over length buckets)."""

    def __init__(self, decoder: nn.Module, max_tokens: int, readout: RegressionReadout | BucketReadout | None = None):
        super().__init__()
        self.decoder = decoder  # a HF *Model (embeddings, layers, norm, rotary), not the LM head
        self.readout = readout or RegressionReadout(max_tokens)
        # On the decoder's device (a GPU replica's), in float32 whatever the decoder's dtype.
        device = next(decoder.parameters()).device
        self.head = nn.Linear(decoder.config.hidden_size, self.readout.outputs, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.max_tokens = max_tokens

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    def extend(self, kv: PromptKV, hidden: torch.Tensor, mask: torch.Tensor, start: int = 0,
               end: int | None = None) -> tuple[torch.Tensor, PromptKV]:
        """Decoder layers [start, end) over new tokens (`hidden` entering layer `start`, right padded,
        `mask` marks real ones) that follow the tokens in `kv`; their KV is appended to kv.cache.
        Returns their hidden states out of the last layer run, and the extended PromptKV."""
        positions = kv.lengths[:, None] + torch.arange(hidden.shape[1], device=hidden.device)[None]
        full = torch.cat([kv.mask, mask], dim=1)
        # layer_idx: the training pass keeps only the top layers' KV, so the cache below `start` is empty
        causal = create_causal_mask(config=self.decoder.config, inputs_embeds=hidden, attention_mask=full,
                                    cache=kv.cache, position_ids=positions, layer_idx=start)
        rotary = self.decoder.rotary_emb(hidden, position_ids=positions)
        for layer in self.decoder.layers[start:end]:
            hidden = layer(hidden, attention_mask=causal, position_embeddings=rotary, position_ids=positions,
                           cache=kv.cache)
        return hidden, PromptKV(kv.cache, full, kv.lengths + mask.sum(dim=1))

    def suffix_output(self, kv: PromptKV, suffix: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The head's raw output [batch, readout.outputs] from the suffix's hidden states entering layer
        `start` [batch, suffix, hidden], over the prompts' KV (`readout` turns it into lengths); `kv` is
        left as it was (the suffix's KV is dropped again)."""
        layers = [layer for layer in kv.cache.layers[start:] if layer.is_initialized]
        saved = [(layer.keys, layer.values) for layer in layers]
        try:
            hidden, _ = self.extend(kv, suffix, torch.ones(suffix.shape[:2], dtype=torch.long, device=suffix.device),
                                    start)
        finally:
            for layer, (keys, values) in zip(layers, saved):
                layer.keys, layer.values = keys, values
        return self.head_output(self.decoder.norm(hidden[:, -1]))

    def head_output(self, final: torch.Tensor) -> torch.Tensor:
        """The head's raw output from the suffix's last final hidden states, after the final norm."""
        return self.head(final.to(self.head.weight.dtype))


def regressor_of(model: LengthRegressor | PeftModel) -> LengthRegressor:
    return model.base_model.model if isinstance(model, PeftModel) else model


@contextmanager
def adapter_off(model: nn.Module) -> Iterator[None]:
    """The plain model inside: what PeftModel.disable_adapter does, but found from the LoRA layers
    themselves, so a regressor that was wrapped in place is plain here too."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@torch.no_grad()
def lora_deltas(layer: nn.Module) -> dict[str, torch.Tensor]:
    """What the active LoRA adapter(s) add to each adapted projection of one decoder layer, by
    projection name (e.g. "q_proj"): merged into a copy of the layer's weights, they give what the
    adapted layer computes. Empty for a layer the adapter leaves alone."""
    deltas = {}
    for name, module in layer.named_modules():
        if isinstance(module, BaseTunerLayer) and not module.disable_adapters:
            short = name.rsplit(".", 1)[-1]
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):
                    delta = module.get_delta_weight(adapter)
                    deltas[short] = deltas[short] + delta if short in deltas else delta
    return deltas


@torch.no_grad()
def prefill(model: LengthRegressor | PeftModel, ids: torch.Tensor, mask: torch.Tensor,
            kv: PromptKV | None = None) -> tuple[PromptKV, torch.Tensor]:
    """The plain serving model (adapter off) over right-padded prompt ids that follow `kv` (or start
    fresh). Returns the extended KV and the new tokens' final hidden states (before the norm)."""
    regressor = regressor_of(model)
    ids, mask = ids.to(regressor.device), mask.to(regressor.device)
    kv = kv if kv is not None else PromptKV.empty(regressor.decoder.config, ids.shape[0], regressor.device)
    with adapter_off(model):
        hidden, kv = regressor.extend(kv, regressor.decoder.embed_tokens(ids), mask)
    return kv, hidden


def predict_lengths(model: LengthRegressor | PeftModel, kv: PromptKV, suffix_ids: torch.Tensor) -> torch.Tensor:
    """Lengths for prompts whose plain KV is `kv`, from the suffix ids [batch, suffix] (adapter on)."""
    return predict_estimates(model, kv, suffix_ids)[0]


def predict_estimates(model: LengthRegressor | PeftModel, kv: PromptKV, suffix_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`predict_lengths` and, from the same pass, the expected lengths (`readout.expected`)."""
    regressor = regressor_of(model)
    out = regressor.suffix_output(kv, regressor.decoder.embed_tokens(suffix_ids.to(regressor.device)))
    return regressor.readout.lengths(out), regressor.readout.expected(out)


@torch.no_grad()
def suffix_features(regressor: LengthRegressor, ids: torch.Tensor, mask: torch.Tensor, suffix_ids: torch.Tensor,
                    start: int) -> tuple[list[KV], torch.Tensor]:
    """What training needs of the plain model, once per prompt: each prompt's KV of layers start..
    and the suffix's hidden states entering layer `start` [batch, suffix, hidden]."""
    kv, _ = prefill(regressor, ids, mask)
    rows = kv.rows(start)
    with adapter_off(regressor):
        suffix_ids = suffix_ids.to(regressor.device)
        embedded = regressor.decoder.embed_tokens(suffix_ids)
        hidden, _ = regressor.extend(kv, embedded, torch.ones_like(suffix_ids), 0, start)
    return rows, hidden


def with_new_adapter(regressor: LengthRegressor, settings: PredictorSettings) -> PeftModel:
    first = regressor.num_layers - settings.lora_layers
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=LORA_TARGETS,
        layers_to_transform=list(range(first, regressor.num_layers)), layers_pattern="layers",
        modules_to_save=["head"],
    )
    return get_peft_model(regressor, config)


def with_saved_adapter(regressor: LengthRegressor, path: str) -> PeftModel:
    return PeftModel.from_pretrained(regressor, path, is_trainable=False)


def pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask
