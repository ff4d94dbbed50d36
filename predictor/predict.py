"""Length prediction for serving: the serving model with the trained adapter switched on."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from predictor.model import LengthRegressor, PredictorSettings, pad_batch, with_saved_adapter
from predictor.prompt import PredictionInput, chat_prompt_ids

DEFAULT_ADAPTER = Path(__file__).resolve().parent / "adapters" / "smollm2-135m"


class PredictorConfig(BaseModel):
    """Where the adapter is and how prediction is batched."""

    adapter: str = Field(str(DEFAULT_ADAPTER), description="Folder of a trained adapter (predictor.train).")
    batch_size: int = Field(16, ge=1, description="Prompts run through the model together.")


class LengthPredictor:
    """`predict(prompts) -> lengths in tokens`. Built on an already loaded HF causal LM, so a replica
    that also decodes holds one copy of the weights: LoRA layers are added beside them and only
    this class's forward runs through the adapter (the engine reads the base weights directly)."""

    def __init__(self, hf_model, tokenizer, config: PredictorConfig | None = None):
        self.config = config or PredictorConfig()
        path = Path(self.config.adapter)
        if not (path / "settings.json").exists():
            raise FileNotFoundError(f"adapter: no trained length adapter in {path} (run python -m predictor.train)")
        self.settings = PredictorSettings.model_validate_json((path / "settings.json").read_text())
        self.tokenizer = tokenizer
        self.model = with_saved_adapter(LengthRegressor(hf_model.model, self.settings.max_tokens), str(path)).eval()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.seconds = 0.0  # time spent predicting, for the cost figure
        self.input = PredictionInput(tokenizer)

    @property
    def max_tokens(self) -> int:
        return self.settings.max_tokens

    def predict(self, prompts: list[str]) -> list[int]:
        """Lengths of the answers to single user messages given as text."""
        return self.predict_prompt_ids([chat_prompt_ids(self.tokenizer, p) for p in prompts])

    def predict_prompt_ids(self, prompts: list[list[int]]) -> list[int]:
        """Lengths of the answers to prompts given as the decoder's prompt ids."""
        return self.predict_ids([self.input(p) for p in prompts])

    @torch.no_grad()
    def predict_ids(self, sequences: list[list[int]]) -> list[int]:
        """Lengths from ready predictor input ids (see predictor.prompt)."""
        started = time.perf_counter()
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        lengths = [0] * len(sequences)
        for first in range(0, len(order), self.config.batch_size):
            group = order[first : first + self.config.batch_size]
            ids, mask = pad_batch([sequences[i] for i in group], self.pad_id)
            for i, value in zip(group, self.model(ids, mask).tolist()):
                lengths[i] = max(1, min(self.max_tokens, math.ceil(value)))
        self.seconds += time.perf_counter() - started
        return lengths
