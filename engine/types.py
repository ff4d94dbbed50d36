"""Plain data that crosses the engine boundary: requests in, results and token events out."""
from __future__ import annotations

import enum
import uuid

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


MAX_PREDICTION_TOKENS = 65536  # the longest `SamplingParams.prediction`


class SamplingParams(BaseModel):
    """How one request is decoded. Temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(256, ge=1, le=65536, description="Most new tokens the caller accepts.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(None, description="Seed for sampling: the same seed gives the same output.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every token "
                                    "the answer already contains (OpenAI's semantics).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once for "
                                     "each time the answer already contains it (OpenAI's semantics).")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens only; 0: no limit.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the most "
                         "likely one.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="Divide the positive logits (multiply the "
                                      "negative) of every token in the prompt or the answer by this; 1: off. "
                                      "The Hugging Face and vLLM semantics; greedy decoding too.")
    min_tokens: int = Field(0, ge=0, description="No end of sequence before this many answer tokens (stop strings "
                            "still end it).")
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=1024, description="Token id -> a value "
                                         "(-100 to 100) added to its logit before sampling, greedy too (OpenAI's "
                                         "semantics): -100 bans a token, 100 all but forces it.")
    stop: list[str] = Field(default_factory=list, description="Strings that end the answer (not included).")
    ignore_eos: bool = Field(False, description="Keep going past end-of-sequence (benchmarks).")
    length_cap: int | None = Field(
        None,
        ge=1,
        description="Hard cap on the answer's total length (resumed tokens included), set by a "
        "scheduler below max_tokens; hitting it marks the result CUT (unfinished, to be re-queued) "
        "rather than LENGTH.",
    )
    wrap_up_tokens: int | None = Field(
        None, ge=1, description="In its last this many tokens before max_tokens, the answer ends (STOP) at the first "
        "sentence end: '.', '!' or '?' after a word, then whitespace (the whitespace is not kept). A part of a longer "
        "answer (a plan node) then ends on a whole sentence more often, rather than being cut in the middle of one.")
    stop_on_loop: bool = Field(
        False,
        description="End the answer (STOP) once it repeats one block of tokens three times in a row "
        "(see engine.loops): small models otherwise loop until max_tokens.",
    )
    no_copy: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Texts the answer must not write out again (a plan's sub-questions, for a node's answer): "
        "once the answer's last tokens are the first `no_copy_tokens` tokens of one of them, the token that would "
        "carry the copy on is banned (see engine.copies).",
    )
    no_copy_tokens: int = Field(2, ge=1, le=64, description="How many tokens of a `no_copy` text's beginning "
                                "the answer may copy before the next one is banned.")
    no_openings: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Words no line of the answer may open with (the answer's first, and each after a line break, "
        "past a list marker such as `2.`): `What` and `How` for a plan node's answer, which the embedded model "
        "otherwise often writes as questions (see engine.openings). Only a word that is one token is banned.",
    )
    prediction: list[int] = Field(
        default_factory=list, max_length=MAX_PREDICTION_TOKENS, description="OpenAI's predicted outputs: token ids the answer is "
        "expected to repeat mostly (a file being edited, say). Each step checks the prediction's tokens that follow "
        "where the answer has got to in it (`engine.drafts.PredictionDrafts`) and keeps those the model would have "
        "chosen: the answer is the same, only sooner.")
    logprobs: int | None = Field(
        None, ge=0, le=20,
        description="With a number k, every generated token carries its log probability under the model (its raw "
        "logits, before temperature, penalties and constraints) and the k most likely tokens at its place.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="With a number k, the result carries every prompt token's log probability after the first "
        "(given the tokens before it) and the k most likely tokens at its place: scoring text, as OpenAI's `echo` "
        "with `logprobs` does. The whole prompt is then computed, never taken from the prefix cache.")
    constraint: str | None = Field(
        None,
        description="Name of a decoding constraint (see engine.constraints.CONSTRAINTS), e.g. 'plan_lines': "
        "only tokens its grammar admits are sampled, and the answer ends (STOP) when the grammar does.",
    )
    constraint_arg: dict | None = Field(
        None,
        description="The constraint's argument, for a constraint that takes one: the JSON Schema for 'json_schema'.",
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"token {token}: ids are not negative and biases lie in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TopLogprob(BaseModel):
    """One candidate token at a place in the answer, with its log probability."""

    token_id: int
    token: str = Field(description="The token's text, decoded alone (a piece of a character reads as U+FFFD).")
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token's log probability, and the most likely tokens at its place (most likely first).
    A token a decoding constraint forced has logprob 0: under the constraint it was certain."""

    top: list[TopLogprob] = Field(default_factory=list)


class GenerationRequest(BaseModel):
    """One prompt, already tokenized, to decode."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, description="Unique request id.")
    prompt_ids: list[int] = Field(description="Prompt token ids (chat template already applied).")
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(0, description="Higher is admitted first; ties go first come first served.")
    predicted_len: int | None = Field(None, description="Predicted answer length in tokens, if known.")
    shared_prefix_len: int = Field(
        0,
        ge=0,
        description="The first this-many prompt tokens are shared with other requests (a plan's node prompts): "
        "the engine keeps their KV cache as a reusable prefix. The whole prompt when the length predictor has "
        "already computed its KV (the decoder fetches it rather than prefilling).",
    )
    preamble_len: int = Field(
        0,
        ge=0,
        description="The first this-many prompt tokens open the prompts of many requests (instructions and worked "
        "examples that do not depend on the question): once a prefill has computed them, the engine keeps their "
        "KV as a reusable prefix, so a request whose `shared_prefix_len` part is not cached yet still starts "
        "after them.",
    )
    resume_ids: list[int] = Field(
        default_factory=list,
        description="Tokens already generated by an earlier, cut-off pass; decoding continues after them.",
    )
    resume_logprobs: list[TokenLogprob] = Field(
        default_factory=list,
        description="With `params.logprobs`: the log probabilities of `resume_ids`, from the pass that made them.",
    )
    keep_kv: bool = Field(
        False,
        description="Once the answer is finished, keep the KV of prompt and answer as a reusable prefix, for "
        "prompts that continue this conversation (a plan node whose children follow up on its answer).",
    )

    @model_validator(mode="after")
    def _non_empty(self) -> "GenerationRequest":
        if not self.prompt_ids:
            raise ValueError("prompt_ids: the prompt is empty")
        if self.shared_prefix_len > len(self.prompt_ids):
            raise ValueError("shared_prefix_len: must not be longer than the prompt")
        if self.preamble_len > len(self.prompt_ids):
            raise ValueError("preamble_len: must not be longer than the prompt")
        if self.params.logprobs is not None and len(self.resume_logprobs) != len(self.resume_ids):
            raise ValueError(f"resume_logprobs: {len(self.resume_logprobs)} given for {len(self.resume_ids)} "
                             "resumed tokens; a request that asks for logprobs needs one for each")
        return self


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # reached max_tokens
    CUT = "cut"  # reached the scheduler's length_cap before max_tokens: unfinished
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # a fault while serving this request alone: it ended there, its batch mates went on


class TokenEvent(BaseModel):
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str = Field(description="Text added by these tokens (may be empty while a character is incomplete).")
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = Field(None, description="With `params.logprobs`: one per token of token_ids.")
    prompt_logprobs: list[TokenLogprob] | None = Field(
        None, description="With `params.prompt_logprobs`, on an attempt's first event only: the prompt's scores, as "
        "`Result.prompt_logprobs`.")
    stop_logprob: TokenLogprob | None = Field(None, description="On the last event, as `Result.stop_logprob`.")


class Result(BaseModel):
    """A finished (or cut-off) request."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = Field(description="All generated tokens, resumed ones included.")
    text: str
    finish_reason: FinishReason
    ttft_s: float = Field(description="Seconds from admission request to first token.")
    latency_s: float = Field(description="Seconds from add() to finish.")
    prefix_hit_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")
    logprobs: list[TokenLogprob] | None = Field(None, description="With `params.logprobs`: one per token of token_ids.")
    prompt_logprobs: list[TokenLogprob] | None = Field(
        None, description="With `params.prompt_logprobs`: one per prompt token after the first (the first has no "
        "context to score it by).")
    stop_logprob: TokenLogprob | None = Field(
        None, description="With `params.logprobs`, when a stop token (end of sequence) ended the answer: its log "
        "probability. The token itself is not part of token_ids or logprobs.")
    kept_kv_tokens: int = Field(
        0, description="With `keep_kv`: how many leading tokens of prompt + answer were kept as a prefix (the "
        "last answer token has none when the answer ran to its length limit); 0 when nothing was kept.")
    error: str | None = Field(None, description="With finish_reason `error`: what went wrong (the exception).")
    accepted_prediction_tokens: int = Field(
        0, description="With `params.prediction`: its tokens drafted and kept (the model wrote them).")
    rejected_prediction_tokens: int = Field(
        0, description="With `params.prediction`: its tokens drafted, checked and not kept (each check counted).")

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
