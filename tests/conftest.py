"""Shared fixtures: a tiny random Llama and an in-process tokenizer, so engine tests need no hub,
no downloads and no real weights, and run in well under a second each on a shared CPU; and a watchdog
that stops the run, with every thread's stack, when one test hangs."""
from __future__ import annotations

import _thread
import faulthandler
import os
import sys
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The slowest test (the decoders' scale-out) takes about 7 minutes on 2 cores. One stuck far past that
# (a Ray call on a broken cluster blocks forever) must not hang the whole run until CI kills it with
# nothing printed.
STUCK_TEST_S = float(os.environ.get("PLATO_TEST_TIMEOUT_S", 1800))


def _stop_stuck_test(item: pytest.Item) -> None:
    """Print every thread's stack, then interrupt the main thread. A KeyboardInterrupt is what ray.get
    gives up on (it swallows other exceptions raised by signal handlers), and pytest answers it by
    stopping the run and reporting every failure so far; if even that hangs, exit."""
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # else the stacks would land in the stuck test's captured output, never shown
        capture.suspend_global_capture(in_=False)
    nodeid = item.nodeid
    sys.stderr.write(f"\n{nodeid} ran past {STUCK_TEST_S:.0f} s (PLATO_TEST_TIMEOUT_S); its threads:\n")
    faulthandler.dump_traceback(all_threads=True)
    _thread.interrupt_main()
    exit_timer = threading.Timer(120, lambda: (sys.stderr.flush(), os._exit(3)))
    exit_timer.daemon = True
    exit_timer.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    watchdog = threading.Timer(STUCK_TEST_S, _stop_stuck_test, args=(item,))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()

TINY_VOCAB_SIZE = 256
TINY_EOS_ID = 2  # "<|im_end|>" in the tiny tokenizer
TINY_MAX_POSITIONS = 512

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_model():
    """A randomly initialised 2-layer `LlamaForCausalLM` (vocab 256, hidden 64, 4 heads, 2 KV heads,
    512 positions, eos id 2), float32, eval mode, fixed seed.

    `initializer_range` is raised so greedy answers vary from token to token (the default 0.02
    gives near-uniform logits), and the lm_head row of the EOS token is zeroed so greedy decoding
    practically never stops by itself: greedy tests run to max_tokens. Tests that need a model that
    stops set `engine.stop_token_ids` or use stop strings. Do not modify it: it is shared."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=TINY_EOS_ID,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight[TINY_EOS_ID].zero_()
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A word-level `PreTrainedTokenizerFast` built in-process (no hub): ids 0-2 are `<unk>`,
    `<|im_start|>` (bos) and `<|im_end|>` (eos), 3-5 are `user`/`assistant`/`system`, the rest are
    4-letter words; exactly as many ids as the tiny model's vocab, so every id decodes. Decoding
    joins words with single spaces. Has a ChatML-like `chat_template`."""
    from bench.random_model import word_tokenizer

    leading = ("<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system")
    tokenizer = word_tokenizer(TINY_VOCAB_SIZE, leading, bos="<|im_start|>", eos="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    assert len(tokenizer) == TINY_VOCAB_SIZE and tokenizer.eos_token_id == TINY_EOS_ID
    return tokenizer


@pytest.fixture
def make_engine(tiny_model, tiny_tokenizer):
    """Factory: `make_engine(**overrides)` builds a fresh `LLMEngine` over the tiny model and
    tokenizer with `EngineConfig(**overrides)` (e.g. `max_batch_size=2`, `prefix_cache_bytes=0`).
    max_model_len is capped at the model's 512 positions. Each call gets its own KV cache.
    torch runs single-threaded meanwhile: tiny tensors gain nothing from threads, and CPUs are shared."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    def build(**overrides):
        return LLMEngine(tiny_model, tiny_tokenizer, EngineConfig(**overrides))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build
    torch.set_num_threads(threads)


@pytest.fixture
def decode_alone(make_engine):
    """`decode_alone(prompt_ids, **sampling)` -> the `Result` of that one request decoded on its
    own in a fresh engine: the reference that batched, prefix-cached or resumed runs must match."""
    from engine.types import GenerationRequest, SamplingParams

    def run(prompt_ids, **sampling):
        engine = make_engine(max_batch_size=1)
        [result] = engine.generate([GenerationRequest(prompt_ids=list(prompt_ids), params=SamplingParams(**sampling))])
        return result

    return run
