"""Turn OpenAI chat and text completion requests into engine requests, and engine results into
OpenAI responses.

Ray-free: the Serve decoder deployment holds one of these; tests use it directly."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from deployments.admission import RETRY_AFTER_S
from deployments.openai_schema import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    Choice,
    CompletionRequest,
    CompletionTokensDetails,
    DetokenizeRequest,
    OpenAIRequest,
    PromptTokensDetails,
    RequestError,
    TextCompletion,
    TokenizeRequest,
    Usage,
    check_model,
)
from deployments.openai_logprobs import chat_logprobs
from deployments.text_completions import Echo, StreamedText, scored_only, text_choice
from deployments.tool_call_stream import CallStream, answer_stream, opens_calls
from deployments.tool_calls import may_be_calls, tagged_calls, template_messages, tool_calls
from engine.async_engine import AsyncEngine
from engine.base import chat_ids, template_renders_tools
from engine.constraints import make_constraint
from engine.types import MAX_PREDICTION_TOKENS, FinishReason, GenerationRequest, Result, SamplingParams, TokenEvent
from graph.journal import AnswerJournal, Contexts, Resume
from graph.orchestrator import Answer, Orchestrator, PrioritizedClient
from graph.router import route

PLAIN_MODE = "ar"


def _finish(result: Result) -> str:
    return "length" if result.finish_reason in (FinishReason.LENGTH, FinishReason.CUT) else "stop"


def _usage(results: list[Result], n: int, predicted: bool = False) -> Usage:
    """OpenAI's usage for n choices of each prompt (results in choice order): each prompt counted
    once, every choice's answer; with a prediction (`predicted`), how much of it they took."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    completion = sum(r.completion_tokens for r in results)
    # a resumed attempt's hits may run into the answer it resumes: only the prompt's are the user's
    cached = sum(min(r.prefix_hit_tokens, r.prompt_tokens) for r in results[::n])
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(r.accepted_prediction_tokens for r in results),
        rejected_prediction_tokens=sum(r.rejected_prediction_tokens for r in results)) if predicted else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), completion_tokens_details=details)


def _prediction(request: OpenAIRequest):
    """A chat request's prediction (OpenAI's predicted outputs); None without one, and for text completions."""
    return getattr(request, "prediction", None)


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """`n` engine requests for n choices of one prompt. Their prompt, but for its last token, is
    marked shared, so an engine computes it once and the other choices start from its cached KV;
    with a seed, choice i samples with seed + i, so the choices differ and each replays."""
    if n == 1:
        return [request]
    seed = request.params.seed
    return [request.model_copy(update={
        "id": uuid.uuid4().hex,
        "shared_prefix_len": len(request.prompt_ids) - 1,
        "params": request.params.model_copy(update={"seed": None if seed is None else seed + i}),
    }) for i in range(n)]


def _message(request: ChatCompletionRequest, result: Result) -> AssistantMessage:
    """The assistant's message: the answer's text, or the tool calls it makes (its text, should it be
    cut before they are whole)."""
    if request.calls_tools:
        made = tool_calls(result.text, request.tool_choice)
    elif request.may_call_tools:
        made = tagged_calls(result.text)
    else:
        made = None
    return AssistantMessage(content=None, tool_calls=made) if made is not None else AssistantMessage(content=result.text)


def _chat_finish(request: ChatCompletionRequest, result: Result, message: AssistantMessage) -> str:
    """'tool_calls' where the model chose to call ('auto'), as OpenAI and vLLM say; else the result's."""
    return "tool_calls" if request.may_call_tools and message.tool_calls else _finish(result)


async def _all(calls) -> list:
    """Await every call side by side; if one fails, cancel the others and raise its error."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


class PlannedCall(BaseModel):
    """How the ingress asks for a planned answer: under a key of its own, so that when the planner
    replica making it dies, the answer can be taken up by another from the context cache, and the
    text (and opening chunk) its client already has."""

    key: str = Field(min_length=1, description="The answer's key in the context cache, the same on every attempt.")
    retry: bool = Field(False, description="An earlier attempt's replica died: the journal may hold the answer.")
    sent: str = Field("", description="The answer's text the client already has, from an earlier attempt.")
    opened: bool = Field(False, description="Whether the client already has the opening (role) chunk.")


def is_planned(request: OpenAIRequest) -> bool:
    """Planning answers one question: a single user message asked in a mode other than `ar`. Any
    other request is answered by plain decoding, whatever its mode."""
    return (isinstance(request, ChatCompletionRequest) and request.mode != PLAIN_MODE and len(request.messages) == 1
            and request.messages[0].role == "user")


class ApiLimits(BaseModel):
    """What a single API request may ask for, and how many requests an ingress replica holds."""

    model_config = ConfigDict(extra="forbid")

    default_max_tokens: int = Field(512, ge=1, description="max_tokens when the request gives none.")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt a request may send, in tokens (chat template included); "
        "default: as long as the model's context leaves room for one answer token.",
    )
    max_choices: int = Field(8, ge=1, le=128, description="Most choices (OpenAI's `n`) one request may ask for; "
                             "each is decoded as a request of its own, the prompt computed once.")
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="Most requests one ingress replica holds at once, decoding or waiting for a decoder, each "
        "choice of each prompt counted (n, several prompts); past it a request is refused at once with HTTP 503 "
        "and Retry-After. Counted per ingress replica.",
    )
    stop_on_loop: bool = Field(
        True,
        description="End an answer once it repeats itself verbatim (engine.loops); an answer held to JSON, a "
        "schema, choices or tool calls is closed the shortest way its grammar allows instead. The length "
        "predictor's labels are made with the same setting.",
    )


class CompletionService:
    """Serves chat and text completions from one engine: checks a request against the served model
    and the limits, decodes it, and shapes the answer the way its endpoint expects."""

    def __init__(self, engine: AsyncEngine, limits: ApiLimits, orchestrator: Orchestrator | None = None,
                 observer=None, contexts: Contexts | None = None):
        """`observer`: deployments.metrics.AnswerMetrics, or None. `contexts`: the context cache, where
        planned answers asked with a `PlannedCall` are journaled (graph.journal), or None."""
        self.engine = engine
        self.contexts = contexts
        self.resumed = {"answers": 0, "nodes_reused": 0}  # planned answers taken up from the context cache
        self.observer = observer
        self.limits = limits
        self.orchestrator = orchestrator  # answers sot / plato / auto; without it every mode is `ar`
        self.model_name = engine.engine.model_name
        self.max_model_len = engine.engine.max_model_len
        self.vocabulary = len(engine.engine.tokenizer)  # token ids a request may name: 0 to this, less one
        self._json_refusal: str | None = None  # why this model cannot do JSON mode, once asked ("" when it can)
        self._renders_tools: bool | None = None  # whether the chat template writes tools, once asked
        self.choices_in_flight = 0  # answers this service is waiting for: the load limits.max_queued_requests bounds

    async def _encode(self, request: OpenAIRequest) -> tuple[list[list[int]], str]:
        """Each prompt's token ids, and the field that holds the prompts. Tokenized on the engine
        thread: the tokenizer is not shared across threads."""
        if isinstance(request, ChatCompletionRequest):
            return [await self._chat_ids(request.messages, request.tools, request.tool_choice)], "messages"
        encoded = []
        for prompt in request.prompts:
            if isinstance(prompt, str):
                encoded.append(await self.engine.call(lambda engine, text=prompt: engine.encode(text)))
                continue
            if max(prompt) >= self.vocabulary:
                raise RequestError("prompt", f"token id {max(prompt)} is not in the model's vocabulary of "
                                   f"{self.vocabulary}")
            encoded.append(list(prompt))
        return encoded, "prompt"

    async def _chat_ids(self, messages: list[ChatMessage], tools=None, tool_choice=None,
                        add_generation_prompt: bool = True) -> list[int]:
        """A conversation's token ids with the model's chat template, `tools` shown to the model the
        way the template can take them (deployments.tool_calls); one it cannot write is a 400."""
        if self._renders_tools is None and (tools or any(m.tool_calls or m.role == "tool" for m in messages)):
            self._renders_tools = await self.engine.call(lambda engine: template_renders_tools(engine.tokenizer))
        written, tools_arg = template_messages([m.for_template() for m in messages], tools, tool_choice,
                                               bool(self._renders_tools))
        try:
            return await self.engine.call(
                lambda engine: chat_ids(engine.tokenizer, written, add_generation_prompt, tools=tools_arg))
        except (TemplateError, TypeError, ValueError) as error:
            raise RequestError("messages", f"the model's chat template cannot write this conversation: {error}"
                               ) from None

    async def to_engine_requests(self, request: OpenAIRequest) -> list[GenerationRequest]:
        """One engine request per prompt (a chat request has one), checked against the served model
        and the limits."""
        check_model(request.model, self.model_name)
        if request.formats:
            await self._check_format(request)
        beyond = [t for t in request.logit_bias or {} if int(t) >= self.vocabulary]
        if beyond:
            raise RequestError("logit_bias", f"token ids {beyond[:5]} are not in the model's vocabulary of "
                               f"{self.vocabulary}")
        prompts, param = await self._encode(request)
        prediction = await self._prediction_ids(request)
        return [self._engine_request(request, prompt_ids, param, prediction) for prompt_ids in prompts]

    async def _prediction_ids(self, request: OpenAIRequest) -> list[int]:
        """The token ids of a chat request's prediction (none without one)."""
        prediction = _prediction(request)
        if prediction is None or not prediction.text:
            return []
        ids = await self.engine.call(lambda engine: engine.encode(prediction.text))
        most = min(self.max_model_len - 1, MAX_PREDICTION_TOKENS)
        if len(ids) > most:
            raise RequestError("prediction", f"it has {len(ids)} tokens; at most {most} are taken (the model's context "
                               f"is {self.max_model_len})")
        return ids

    async def _check_format(self, request: OpenAIRequest) -> None:
        """One format at most. JSON needs a tokenizer that can write JSON's every character alone, and
        a schema's keys and enum values; choices need the tokenizer to spell them: refused up front
        otherwise, rather than by the engine once the request has gone through the batcher. The
        tokenizer does not change, so JSON's characters are tried once; a schema or choices are tried
        per request (a schema's grammar is kept, so that is quick)."""
        asked = request.formats
        if len(asked) > 1:
            raise RequestError(asked[1][0], f"{asked[0][0]} asks for a format already; ask for one")
        field, (name, arg) = asked[0]
        if field == "tool_choice":
            field = "tools"
        if name != "choice":
            if self._json_refusal is None:
                try:
                    await self.engine.call(lambda engine: make_constraint("json_object", engine.tokenizer))
                    self._json_refusal = ""
                except ValueError as error:
                    self._json_refusal = str(error)
            if self._json_refusal:
                raise RequestError(field, f"JSON output is not available with this model: {self._json_refusal}")
        if arg is not None:
            try:
                await self.engine.call(lambda engine: make_constraint(name, engine.tokenizer, arg=arg))
            except ValueError as error:
                raise RequestError(field, str(error)) from None

    def _engine_request(self, request: OpenAIRequest, prompt_ids: list[int], param: str,
                        prediction: list[int] = ()) -> GenerationRequest:
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise RequestError(param, f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {limit}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                param, f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}"
            )
        asked = request.requested_max_tokens
        if asked == 0 and not (isinstance(request, CompletionRequest) and request.echo):
            raise RequestError("max_tokens", "0 generates nothing: it only serves with echo (and logprobs, to score "
                               "the prompt)")
        if asked is not None and asked > self.limits.max_tokens_limit:
            raise RequestError("max_tokens", f"{asked} is above this server's limit of {self.limits.max_tokens_limit}")
        if asked is not None and asked > room:
            raise RequestError(
                "max_tokens",
                f"{asked} new tokens do not fit: the prompt has {len(prompt_ids)} tokens and the context "
                f"is {self.max_model_len}, so at most {room} remain",
            )
        if asked == 0:
            asked = 1  # the engine samples at least one token; scored_only drops it
        max_tokens = asked or min(self.limits.default_max_tokens, room)
        if request.min_tokens > max_tokens:
            raise RequestError("min_tokens", f"{request.min_tokens} is more than the {max_tokens} tokens the answer "
                               "may have")
        constraint, constraint_arg = request.output_constraint or (None, None)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=max(request.top_k or 0, 0),
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            logit_bias={int(token): bias for token, bias in (request.logit_bias or {}).items()},
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            stop=request.stop,
            # a JSON, schema, choice or tool-call answer that loops is closed the shortest way, not cut
            stop_on_loop=self.limits.stop_on_loop,
            logprobs=request.logprobs_asked,
            prompt_logprobs=request.prompt_logprobs_asked,
            constraint=constraint,
            constraint_arg=constraint_arg,
            prediction=list(prediction),
        )
        # the engine's and the batcher's priority is the other way round: higher goes first
        return GenerationRequest(prompt_ids=prompt_ids, params=params, priority=-request.priority)

    def _planned(self, request: OpenAIRequest) -> bool:
        return self.orchestrator is not None and is_planned(request)

    def _journal(self, call: PlannedCall | None) -> AnswerJournal | None:
        return AnswerJournal(self.contexts, call.key) if call is not None and self.contexts is not None else None

    async def _plan_and_answer(self, request: ChatCompletionRequest, engine_request: GenerationRequest,
                               journal: AnswerJournal | None = None, call: PlannedCall | None = None,
                               emit=None) -> Answer:
        budget = {"max_tokens": engine_request.params.max_tokens, "stop_on_loop": self.limits.stop_on_loop}
        client = PrioritizedClient(self.orchestrator.client, engine_request.priority)
        orchestrator = Orchestrator(client, self.orchestrator.config.model_copy(update=budget))
        saved = await journal.load() if journal is not None and call.retry else None  # a first attempt's key is new
        if saved is not None or (call is not None and call.sent):
            self.resumed["answers"] += 1
            self.resumed["nodes_reused"] += len(saved.answers) if saved else 0
        resume = Resume(saved=saved, sent=call.sent if call else "")
        return await orchestrator.answer(request.messages[0].content, request.mode, emit, journal, resume)

    async def _planned_stream(self, request: ChatCompletionRequest, engine_request: GenerationRequest,
                              call: PlannedCall | None, started: float) -> AsyncIterator[dict]:
        """A planned answer's chunks as its text is written (graph.orchestrator: a plan's paragraphs in plan
        order from its first line on, the next one token by token; a plain answer token by token). Taken up
        after a planner's death, it sends only what follows the text the client has, and no second opening
        chunk."""
        journal = self._journal(call)
        pieces: asyncio.Queue = asyncio.Queue()
        ended = object()
        task = asyncio.create_task(self._plan_and_answer(request, engine_request, journal, call, pieces.put))
        task.add_done_callback(lambda _: pieces.put_nowait(ended))
        mode = route(request.messages[0].content)[0] if request.mode == "auto" else request.mode
        chunk = ChatCompletionChunk(model=self.model_name, choices=[], mode=mode)
        sent, opened, skipped = (call.sent, call.opened, "") if call else ("", False, "")
        try:
            while (piece := await pieces.get()) is not ended:
                if len(skipped) < len(sent):
                    cut = len(sent) - len(skipped)
                    skipped, piece = skipped + piece[:cut], piece[cut:]
                    if not sent.startswith(skipped):
                        raise RuntimeError("the answer taken up after its planner died does not start with the "
                                           "text its client already has")
                if not piece:
                    continue
                if not opened:
                    opened = True
                    if self.observer is not None:
                        self.observer.first_token(time.perf_counter() - started)
                    yield chunk.opening()
                yield chunk.piece(piece)
            answer = task.result()
            self._observe(answer.mode, True, answer.fallback is not None, started)
            if not opened:
                yield chunk.opening()
            yield chunk.piece("", "stop")
            if request.include_usage:
                usage = self._planned_response(request, engine_request, answer).usage
                yield chunk.model_copy(update={"choices": [], "usage": usage}).model_dump()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if journal is not None:
                await journal.end()

    def _planned_response(self, request, engine_request, answer: Answer) -> ChatCompletionResponse:
        usage = Usage(prompt_tokens=len(engine_request.prompt_ids), completion_tokens=answer.completion_tokens,
                      total_tokens=len(engine_request.prompt_ids) + answer.completion_tokens)
        plan = None
        if request.return_plan:
            plan = {"nodes": [n.model_dump() for n in answer.plan.nodes] if answer.plan else [],
                    "plan_s": answer.plan_s, "fallback": answer.fallback, "routed": answer.routed,
                    "node_timings": [t.model_dump() for t in answer.nodes]}
        choice = Choice(message=AssistantMessage(content=answer.text), finish_reason="stop")
        return ChatCompletionResponse(model=self.model_name, choices=[choice], usage=usage, mode=answer.mode, plan=plan)

    def _observe(self, mode: str, planned: bool, fell_back: bool, started: float) -> None:
        if self.observer is not None:
            self.observer.answered(mode, planned, fell_back, time.perf_counter() - started)

    def _observe_plain(self, request: OpenAIRequest, started: float) -> None:
        """A plain answer, and the format it was held to, if any."""
        self._observe(PLAIN_MODE, False, False, started)
        asked = request.formats
        if asked and self.observer is not None:
            field, (constraint, _) = asked[0]
            self.observer.formatted("tool_calls" if field == "tool_choice" else constraint)

    def _check_choices(self, request: OpenAIRequest) -> None:
        """n and logprobs are for plain answers: a planned one is one text assembled from its nodes."""
        prompts = len(request.prompts)
        if request.n * prompts > self.limits.max_choices:
            field, asked = ("n", f"{request.n} choices") if prompts == 1 else (
                "prompt", f"{prompts} prompts with {request.n} choices each")
            raise RequestError(field, f"{asked} asked; this server gives at most {self.limits.max_choices} choices "
                               "to a request")
        if request.n > 1 and self._planned(request):
            raise RequestError("n", f"a planned answer (mode '{request.mode}') has one choice; ask n > 1 with mode 'ar'")
        if request.formats and self._planned(request):
            raise RequestError(request.formats[0][0], f"a planned answer (mode '{request.mode}') is assembled "
                               "from its parts as text; ask for a format with mode 'ar'")
        if isinstance(request, ChatCompletionRequest) and request.tools and self._planned(request):
            raise RequestError("tools", f"a planned answer (mode '{request.mode}') is assembled from its parts as "
                               "text; send tools with mode 'ar'")
        if (isinstance(request, ChatCompletionRequest) and (request.calls_tools or request.may_call_tools)
                and request.stream and request.logprobs):
            raise RequestError("logprobs", "a streamed answer of tool calls sends the calls as argument deltas, "
                               "without token log probabilities; ask for them without stream")
        if _prediction(request) is not None and self._planned(request):
            raise RequestError("prediction", f"a planned answer (mode '{request.mode}') is assembled from parts "
                               "decoded apart; send a prediction with mode 'ar'")
        if request.logprobs_asked is not None and self._planned(request):
            raise RequestError("logprobs", f"a planned answer (mode '{request.mode}') has no token log probabilities; "
                               "ask for them with mode 'ar'")

    @contextlib.contextmanager
    def _holding(self, choices: int):
        """Count a request's answers while they decode, or refuse it (503) when they would take this
        replica past `max_queued_requests`: the HTTP admission counts requests, this their answers, so
        a request of n choices or several prompts weighs what it costs. One is always let in when none
        is held, however many answers it asks for."""
        if self.choices_in_flight and self.choices_in_flight + choices > self.limits.max_queued_requests:
            raise RequestError(None, f"this replica holds {self.choices_in_flight} answers; {choices} more would pass "
                               f"its limit of {self.limits.max_queued_requests}; retry in {RETRY_AFTER_S} s",
                               status=503, code="server_overloaded")
        self.choices_in_flight += choices
        try:
            yield
        finally:
            self.choices_in_flight -= choices

    async def complete(self, request: OpenAIRequest, call: PlannedCall | None = None
                       ) -> ChatCompletionResponse | TextCompletion:
        """The whole answer. A planned one asked with `call` is journaled in the context cache, and taken
        up from there when an earlier attempt's planner replica died (its answered nodes are kept)."""
        started = time.perf_counter()
        self._check_choices(request)
        engine_requests = await self.to_engine_requests(request)
        if self._planned(request):
            journal = self._journal(call)
            try:
                answer = await self._plan_and_answer(request, engine_requests[0], journal, call)
            finally:
                if journal is not None:
                    await journal.end()
            self._observe(answer.mode, True, answer.fallback is not None, started)
            return self._planned_response(request, engine_requests[0], answer)
        choices = [c for r in engine_requests for c in choice_requests(r, request.n)]
        with self._holding(len(choices)):
            results = await _all(self.engine.generate(c) for c in choices)
        self._observe_plain(request, started)
        if isinstance(request, CompletionRequest):
            if request.max_tokens == 0:
                results = [scored_only(r) for r in results]
            echoes = await self._echoes(request, engine_requests)
            text_choices = [text_choice(i, r, echoes[i // request.n], _finish(r)) for i, r in enumerate(results)]
            return TextCompletion(model=self.model_name, choices=text_choices, usage=_usage(results, request.n))
        messages = [_message(request, r) for r in results]
        choices = [Choice(index=i, message=m, finish_reason=_chat_finish(request, r, m),
                          logprobs=chat_logprobs(r.logprobs) if r.logprobs is not None else None)
                   for i, (r, m) in enumerate(zip(results, messages))]
        return ChatCompletionResponse(model=self.model_name, choices=choices,
                                      usage=_usage(results, request.n, _prediction(request) is not None),
                                      mode=PLAIN_MODE)

    async def _echoes(self, request: CompletionRequest, engine_requests: list[GenerationRequest]) -> list[Echo | None]:
        """Per prompt, what its choices echo (None each without `echo`)."""
        if not request.echo:
            return [None] * len(engine_requests)

        def echo(engine, prompt: str | list[int], ids: list[int]) -> Echo:
            text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
            return Echo(text=text, first_token=engine.tokenizer.decode(ids[:1]))

        return [await self.engine.call(lambda engine, p=p, r=r: echo(engine, p, r.prompt_ids))
                for p, r in zip(request.prompts, engine_requests)]

    async def stream(self, request: OpenAIRequest, call: PlannedCall | None = None) -> AsyncIterator[dict]:
        """OpenAI chunk dicts (`chat.completion.chunk`, or `text_completion` for a raw prompt): for
        chat the role first, then text pieces as tokens arrive, the finish reason, then usage when
        `stream_options.include_usage` asks; with n choices (of each prompt), each chunk's choice
        carries its index. The request is checked before the first chunk, so a bad one fails before
        anything is sent."""
        started = time.perf_counter()
        self._check_choices(request)
        engine_requests = await self.to_engine_requests(request)
        if self._planned(request):
            async for chunk in self._planned_stream(request, engine_requests[0], call, started):
                yield chunk
            return
        choices = [c for r in engine_requests for c in choice_requests(r, request.n)]
        with self._holding(len(choices)):  # a refusal comes before the first chunk too
            async for chunk in self._stream_choices(request, engine_requests, choices, started):
                yield chunk

    async def _stream_choices(self, request: OpenAIRequest, engine_requests: list[GenerationRequest],
                              choices: list[GenerationRequest], started: float) -> AsyncIterator[dict]:
        texts = None
        if isinstance(request, CompletionRequest):
            chunk = TextCompletion(model=self.model_name, choices=[])
            echoes = await self._echoes(request, engine_requests)
            texts = [StreamedText(echoes[i // request.n], request.max_tokens != 0) for i in range(len(choices))]
        else:
            chunk = ChatCompletionChunk(model=self.model_name, choices=[], mode=PLAIN_MODE)
            for index in range(request.n):
                yield chunk.opening(index)
        first, results = True, {}
        chat = isinstance(request, ChatCompletionRequest)
        # an answer that is calls streams them as OpenAI does (deployments.tool_call_stream)
        streams = {i: answer_stream(request.tool_choice) for i in range(len(choices))} if chat and request.calls_tools else {}
        held = {i: "" for i in range(len(choices))} if chat and request.may_call_tools else {}
        async for index, item in self._events(choices):
            if isinstance(item, Result):
                results[index] = item if texts is None or texts[index].generates else scored_only(item)
                message = _message(request, item) if chat else None
                if index in held or (index in streams and not streams[index].started):
                    held.pop(index, None)  # text held back to the end (it could still have been a call)
                    yield chunk.calls(message.tool_calls, message.content, index)
                finish = _chat_finish(request, item, message) if chat else _finish(results[index])
                yield chunk.piece("", finish, index)
                continue
            if texts is not None:
                text, logprobs = texts[index].piece(item)
            else:
                text, logprobs = item.text, chat_logprobs(item.logprobs) if item.logprobs is not None else None
            if index in held:  # 'auto': hold text back while it may still open a tool call
                held[index] += text
                if opens_calls(held[index]):
                    streams[index] = CallStream()
                elif may_be_calls(held[index]):
                    continue
                text = held.pop(index)
            if index in streams:
                deltas = streams[index].feed(text)
                if deltas:
                    if first and self.observer is not None:
                        self.observer.first_token(time.perf_counter() - started)
                    first = False
                for delta in deltas:  # one a chunk: an opening alone, as OpenAI sends it
                    yield chunk.call_deltas([delta], index)
                continue
            if text or logprobs:
                if first and self.observer is not None:
                    self.observer.first_token(time.perf_counter() - started)
                first = False
                yield chunk.piece(text, index=index, logprobs=logprobs)
        self._observe_plain(request, started)
        if request.include_usage:
            ordered = [results[i] for i in range(len(choices))]
            usage = _usage(ordered, request.n, _prediction(request) is not None)
            yield chunk.model_copy(update={"choices": [], "usage": usage}).model_dump()

    async def _events(self, requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, TokenEvent | Result]]:
        """(choice index, token event or result) of every request, as each comes; one request's
        stream is passed on as it is, several are read side by side and their items interleaved."""
        if len(requests) == 1:
            async for item in self.engine.stream(requests[0]):
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: GenerationRequest) -> None:
            try:
                async for item in self.engine.stream(request):
                    queue.put_nowait((index, item))
            except Exception as exc:  # raised to the reader, which stops the other choices
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            finished = 0
            while finished < len(requests):
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished += isinstance(item, Result)
                yield index, item
        finally:
            for task in tasks:  # a client that goes away, or a choice that failed, aborts the rest
                task.cancel()

    # ---- vLLM's tokenizer routes (lm-evaluation-harness finds and uses them) ----------------------
    async def tokenize(self, request: TokenizeRequest) -> dict:
        check_model(request.model, self.model_name)
        if request.messages is not None:
            tokens = await self._chat_ids(request.messages, add_generation_prompt=request.add_generation_prompt)
        else:
            tokens = await self.engine.call(
                lambda e: e.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": list(tokens)}

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        check_model(request.model, self.model_name)
        if request.tokens and not 0 <= min(request.tokens) <= max(request.tokens) < self.vocabulary:
            raise RequestError("tokens", f"token ids are from 0 to {self.vocabulary - 1} in this vocabulary")
        return {"prompt": await self.engine.call(lambda engine: engine.tokenizer.decode(request.tokens))}

    async def tokenizer_info(self) -> dict:
        def info(engine) -> dict:
            tokenizer = engine.tokenizer
            return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                    "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                    "chat_template": tokenizer.chat_template, "model_max_length": self.max_model_len,
                    "vocab_size": self.vocabulary}

        return await self.engine.call(info)

    async def info(self) -> dict:
        return {"id": self.model_name, "max_model_len": self.max_model_len}

    async def health(self) -> dict:
        return self.engine.health()
