"""The length-predictor actor: batched `predict(prompt_ids) -> tokens` over `LengthPredictor`.

Concurrent calls are gathered into one forward pass (Serve's `@serve.batch` when deployed; see
deployments.app). It loads its own copy of the serving model; a decoder replica can instead serve
predictions from its own weights (`DecoderReplica.predict`)."""
from __future__ import annotations

import asyncio

from engine.config import EngineConfig
from predictor.predict import LengthPredictor, PredictorConfig


def load_predictor(engine_config: EngineConfig, predictor_config: PredictorConfig, hf_model=None, tokenizer=None):
    """A LengthPredictor on the given model, or on a fresh load of `engine_config.model`."""
    if hf_model is None:
        from engine.loader import load_hf_model, resolve_model_dir, select_device_and_dtype

        device, dtype = select_device_and_dtype(engine_config)
        hf_model, tokenizer = load_hf_model(resolve_model_dir(engine_config.model, engine_config.cache_dir), dtype, device)
    return LengthPredictor(hf_model, tokenizer, predictor_config)


class LengthPredictorReplica:
    """Runs predictions off the event loop, one batch at a time."""

    def __init__(self, engine_config: dict, predictor_config: dict):
        self.predictor = load_predictor(EngineConfig(**engine_config), PredictorConfig(**predictor_config))
        self._lock = asyncio.Lock()

    async def predict_many(self, prompts: list[list[int]]) -> list[int]:
        async with self._lock:  # one forward pass at a time; torch uses the replica's cores
            return await asyncio.to_thread(self.predictor.predict_prompt_ids, prompts)

    async def stats(self) -> dict:
        return {"predict_seconds": round(self.predictor.seconds, 3)}
