"""The length-predictor actor: batched `predict(prompt_ids) -> tokens` over `LengthPredictor`.

Concurrent calls are gathered into one forward pass (Serve's `@serve.batch` when deployed; see
deployments.app). It loads its own copy of the serving model.

The predictor runs each prompt through the plain serving model before its length question, which
is exactly the decoder's prefill. `predict_and_share_many` therefore publishes each prompt's KV to
the shared context cache (as the decoders publish node prefixes), and the batcher marks the request
so that the decoder replica fetches that KV instead of computing the prompt a second time: the
prediction then costs only its ~16 question tokens on top of work the decoder needed anyway."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from graph.context_store import prefix_key
from predictor.predict import LengthPredictor, PredictorConfig


def load_predictor(engine_config: EngineConfig, predictor_config: PredictorConfig, hf_model=None, tokenizer=None):
    """A LengthPredictor on the given model, or on a fresh load of `engine_config.model`."""
    if hf_model is None:
        from engine.loader import load_hf_model, resolve_model_dir, select_device_and_dtype

        device, dtype = select_device_and_dtype(engine_config)
        hf_model, tokenizer = load_hf_model(resolve_model_dir(engine_config.model, engine_config.cache_dir), dtype, device)
    return LengthPredictor(hf_model, tokenizer, predictor_config)


log = logging.getLogger(__name__)


class LengthPredictorReplica:
    """Runs predictions off the event loop, one batch at a time, on one thread that also loads the
    model: torch's OpenMP workers are per thread, and more of them than cores makes every matmul
    slower (see engine.async_engine.AsyncEngine). `context_cache`: a handle to the ContextCache
    actor, where `predict_and_share_many` publishes prompt KV (None: nothing is shared).
    `predictor`: an already built LengthPredictor (tests); otherwise one is loaded."""

    def __init__(self, engine_config: dict, predictor_config: dict, context_cache=None, name: str = "predictor",
                 predictor: LengthPredictor | None = None):
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor")
        self.predictor = predictor or self._torch_thread.submit(
            load_predictor, EngineConfig(**engine_config), PredictorConfig(**predictor_config)).result()
        self.cache = context_cache
        self.name = name
        self.counts = {"kv_shared": 0, "kv_share_failed": 0}

    async def _on_torch_thread(self, fn, *args):
        """One forward pass at a time (the thread's only worker), using the replica's cores."""
        return await asyncio.get_running_loop().run_in_executor(self._torch_thread, fn, *args)

    async def predict_many(self, prompts: list[list[int]]) -> list[int]:
        return await self._on_torch_thread(self.predictor.predict_prompt_ids, prompts)

    async def predict_and_share_many(self, prompts: list[list[int]]) -> list[dict]:
        """{"length": tokens, "kv_len": n} per prompt, where the KV of the prompt's first n tokens (all
        of it, unless it is longer than the predictor reads) is now in the context cache under
        `prefix_key`; n is 0 where nothing was shared."""
        if self.cache is None:
            return [{"length": n, "kv_len": 0} for n in await self.predict_many(prompts)]
        lengths, entries = await self._on_torch_thread(self.predictor.predict_with_kv, prompts)
        return [{"length": n, "kv_len": await self._publish(entry)} for n, entry in zip(lengths, entries)]

    async def _publish(self, entry) -> int:
        import ray

        try:
            await self.cache.put_prefix.remote(prefix_key(list(entry.token_ids)), [ray.put(entry.to("cpu"))],
                                               entry.nbytes, self.name)
        except Exception as exc:  # the decoder prefills the prompt itself, as without a predictor
            self.counts["kv_share_failed"] += 1
            log.warning("could not publish a prompt's KV to the context cache: %s", exc)
            return 0
        self.counts["kv_shared"] += 1
        return len(entry.token_ids)

    async def stats(self) -> dict:
        return {"predict_seconds": round(self.predictor.seconds, 3), **self.counts}
