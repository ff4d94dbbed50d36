"""The length predictor's network: the serving model's own transformer, a LoRA adapter on its top
layers, and a one-unit head on the last token's hidden state.

LoRA only on the top layers is what makes training affordable on a CPU: the layers below are the
unchanged serving model, so their output for each training prompt is computed once
(`bottom_features`) and every epoch runs only the top layers. At prediction time the full model runs
with the adapter switched on; with it off, the same weights are the plain serving model.
"""
from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from pydantic import BaseModel, Field
from torch import nn
from transformers.masking_utils import create_causal_mask

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PredictorSettings(BaseModel):
    """Shape of the adapter; stored beside it (settings.json) so loading rebuilds the same network."""

    max_tokens: int = Field(256, ge=1, description="Largest length predicted: the labels' max_tokens.")
    lora_layers: int = Field(8, ge=1, description="How many of the top decoder layers get LoRA.")
    rank: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout while training.")


class LengthRegressor(nn.Module):
    """Predicted length in tokens = max_tokens * sigmoid(head(final hidden state of the last token))."""

    def __init__(self, decoder: nn.Module, max_tokens: int):
        super().__init__()
        self.decoder = decoder  # a HF *Model (embeddings, layers, norm, rotary), not the LM head
        self.head = nn.Linear(decoder.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.max_tokens = max_tokens

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    def run_layers(self, hidden: torch.Tensor, attention_mask: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Decoder layers [start, end) over right-padded hidden states."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.decoder.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=None, position_ids=positions)
        rotary = self.decoder.rotary_emb(hidden, position_ids=positions)
        for layer in self.decoder.layers[start:end]:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        return hidden

    def predict_from(self, hidden: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
        """Lengths (float tokens) from the hidden states entering layer `start`."""
        hidden = self.decoder.norm(self.run_layers(hidden, attention_mask, start, self.num_layers))
        last = hidden[torch.arange(hidden.shape[0]), attention_mask.sum(dim=1) - 1]
        return self.max_tokens * torch.sigmoid(self.head(last.to(self.head.weight.dtype)).squeeze(-1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.predict_from(self.decoder.embed_tokens(input_ids), attention_mask, 0)

    @torch.no_grad()
    def bottom_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, upto: int) -> torch.Tensor:
        """Hidden states entering layer `upto`: what the frozen lower layers give for this batch."""
        return self.run_layers(self.decoder.embed_tokens(input_ids), attention_mask, 0, upto)


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
    """Right-padded ids and their attention mask (the last real token is read, so right is safe)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask
