"""Answer one question in a chosen mode over any decode client: `ar` (plain), `sot` (flat outline,
points expanded independently) or `plato` (plan DAG streamed, nodes decoded as soon as their
parents are answered, node prompts sharing one prefix KV cache).

Ray-free: the planner actor holds one of these with a client that reaches the decoder replicas;
tests and benchmarks use `EngineClient` over an in-process `AsyncEngine`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from engine.prefix_cache import common_length
from engine.types import FinishReason, GenerationRequest, Result, SamplingParams, TokenEvent
from graph.assemble import assemble_answer, settled_text, stable_body
from graph.executor import DagExecution, NodeStatus, NodeTiming
from graph.journal import AnswerJournal, NodePrompt, Resume, SavedAnswer
from graph.plan import Plan, PlanNode
from graph.plan_format import StreamingPlanParser, parse_plan
from graph.router import route
from graph.prompts import (
    NODE_NO_OPENINGS,
    follow_up_messages,
    node_messages,
    node_preamble,
    plan_messages,
    shared_prefix_messages,
    sot_point_messages,
    sot_skeleton_messages,
    streaming_prefix_probe,
)

log = logging.getLogger(__name__)

Mode = Literal["ar", "sot", "plato"]
RequestMode = Literal["auto", "ar", "sot", "plato"]
PLAN_END = "\n\n"  # the plan format's end marker (graph.plan_format)
Emit = Callable[[str], Awaitable[None]]


class DecodeClient(Protocol):
    """What the orchestrator needs from the decoding side."""

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...

    async def encode(self, text: str) -> list[int]: ...

    async def generate(self, request: GenerationRequest) -> Result: ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Result]: ...


class PrioritizedClient:
    """A DecodeClient that sends every request at `priority` (`GenerationRequest.priority`: higher goes
    first), so a planned answer's plan, nodes and fallback all wait as their caller asked."""

    def __init__(self, client: DecodeClient, priority: int):
        self.client, self.priority = client, priority

    async def encode_chat(self, messages, add_generation_prompt=True):
        return await self.client.encode_chat(messages, add_generation_prompt)

    async def encode(self, text):
        return await self.client.encode(text)

    async def generate(self, request):
        return await self.client.generate(request.model_copy(update={"priority": self.priority}))

    def stream(self, request):
        return self.client.stream(request.model_copy(update={"priority": self.priority}))


class EngineClient:
    """A DecodeClient over an in-process AsyncEngine."""

    def __init__(self, engine):
        self.engine = engine

    async def encode_chat(self, messages, add_generation_prompt=True):
        return await self.engine.call(lambda e: e.encode_chat(messages, add_generation_prompt))

    async def encode(self, text):
        return await self.engine.call(lambda e: e.encode(text))

    async def generate(self, request):
        return await self.engine.generate(request)

    def stream(self, request):
        return self.engine.stream(request)


class AnswerConfig(BaseModel):
    """How one answer is produced; the ablation switches apply to `plato`."""

    max_tokens: int = Field(256, ge=1, description="Answer budget of `ar`, and of each mode's total.")
    plan_max_tokens: int = Field(160, ge=8, description="Most tokens the plan or skeleton may take.")
    node_max_tokens: int = Field(96, ge=1, description="Most tokens one plan node or outline point may take.")
    nodes_per_budget: int = Field(
        4, ge=1, description="Plan nodes and outline points share the answer budget: each may take max_tokens // "
        "nodes_per_budget tokens (and at most node_max_tokens), give or take `node_budget_stagger`. 4 is the usual "
        "plan length; a node cannot wait for the plan's final length, since it starts while the plan is still "
        "streaming.")
    node_budget_stagger: int = Field(
        0, ge=0, description="With pipelining, a node that starts earlier writes more: the k-th of the plan's first "
        "nodes_per_budget nodes (counting from 0) takes this many tokens more than the next one, and the shares still "
        "add up to the answer budget; nodes after those, and nodes with parents (they start once a parent is done), "
        "take the last and smallest share. About the decode steps a plan line takes (12 on the embedded model), so "
        "that the nodes started as their lines complete end together, rather than the last one decoding a whole "
        "share after the plan ends. 0 (equal shares) by default: on the CPU, where a step costs about in proportion "
        "to its batch, 12 measured 1.04x faster on Vicuna-80 with 3% fewer tokens, the same tokens a second "
        "(bench/RESULTS.md); where a step costs the same at any batch (a GPU) the lone last node's steps are what it "
        "saves, not measured there yet.")
    node_wrap_up_tokens: int | None = Field(
        16, ge=1, description="In its last this many tokens, a plan node's answer ends at the first sentence end (the "
        "engine's `wrap_up_tokens`), so that its paragraph ends on a whole sentence more often than cut in the middle "
        "of one. None: nodes run to their share. Skeleton-of-Thought's points go without, as that paper's baseline has it.")
    max_nodes: int = Field(6, ge=2, le=20, description="Plan nodes kept after repair.")
    pipelining: bool = Field(True, description="Start nodes while the plan is still streaming.")
    kv_reuse: bool = Field(True, description="Prefill each node prompt's shared prefix once and reuse it.")
    follow_up_prompts: bool = Field(
        True, description="A node with parents continues one parent's conversation (that parent's prompt and "
        "answer, whose KV the engine keeps, then this node's own message) instead of quoting every parent's "
        "answer after the shared plan prefix (graph.prompts.follow_up_messages).")
    plan_constraint: str | None = Field(
        "plan_lines", description="Engine constraint that keeps plan lines well formed; None to plan freely "
        "(also used when the model's tokenizer cannot express the constraint).")
    deadline_s: float | None = Field(None, gt=0, description="Unfinished nodes fail after this many seconds.")
    stop_on_loop: bool = Field(True, description="End an answer or node once it repeats itself verbatim.")
    plan_copy_tokens: int | None = Field(
        2, ge=1, description="A plan node's answer may copy at most this many tokens of the beginning of the question "
        "or of any sub-question in the plan before the next token is banned (the engine's `no_copy`): shown the "
        "plan, the embedded model answered about 1 node in 8 of a Vicuna-80 run by writing the plan out again. None: "
        "no guard. Skeleton-of-Thought's points go unguarded, as that paper's baseline has it.")
    node_no_openings: list[str] = Field(
        default_factory=lambda: list(NODE_NO_OPENINGS), max_length=64,
        description="Words no line of a plan node's answer may open with (the engine's `no_openings`): asked for one "
        "part, the embedded model wrote questions in place of an answer in 12% of the parts of a Vicuna-80 run (the "
        "sub-question again, or a list of new ones). Empty: no guard. Skeleton-of-Thought's points go unguarded, as "
        "that paper's baseline has it.")
    plan_presence_penalty: float = Field(
        1.2, ge=0.0, le=2.0, description="Presence penalty while the plan or outline is written: small models "
        "repeat a sub-question, and repair drops a repeated line, often leaving too few nodes. Measured on 24 "
        "planning-routed Vicuna questions with the embedded model: valid plans 16/24 at 0, 23/24 at 0.6, "
        "24/24 at 1.2 (mean nodes 2.25 -> 3.3).")


def node_params(config: AnswerConfig, no_copy: list[str] | None = None, start_rank: int | None = None,
                wrap_up: bool = False, openings: bool = False) -> SamplingParams:
    """Sampling params of one plan node or outline point: its share of the answer budget, and the
    texts (question and sub-questions) it may not write out again, under `plan_copy_tokens`.
    `start_rank`: how many of the plan's nodes start before this one while the plan streams (see
    `AnswerConfig.node_budget_stagger`); None for an equal share. `wrap_up`: end at a sentence end
    near the share's end (`AnswerConfig.node_wrap_up_tokens`). `openings`: no line opens with a word of
    `AnswerConfig.node_no_openings`."""
    share = config.max_tokens // config.nodes_per_budget
    if start_rank is not None and config.node_budget_stagger:
        last = config.nodes_per_budget - 1
        share = max(share // 3, round(share + config.node_budget_stagger * (last / 2 - min(start_rank, last))))
    tokens = max(1, min(config.node_max_tokens, share))
    guard = {"no_copy": no_copy, "no_copy_tokens": config.plan_copy_tokens} if no_copy and config.plan_copy_tokens else {}
    if openings and config.node_no_openings:
        guard["no_openings"] = config.node_no_openings
    wrap = config.node_wrap_up_tokens if wrap_up else None
    return SamplingParams(max_tokens=tokens, stop_on_loop=config.stop_on_loop, wrap_up_tokens=wrap, **guard)


class Answer(BaseModel):
    """The answer and how it was made."""

    mode: Mode = Field(description="The mode that produced the text (plato falls back to ar text).")
    routed: str | None = Field(None, description="For `auto`: the router's reason for the mode.")
    text: str
    latency_s: float
    completion_tokens: int = Field(description="Tokens generated for the answer, plan included.")
    plan: Plan | None = None
    plan_s: float | None = Field(None, description="Seconds until the plan was complete.")
    fallback: str | None = Field(None, description="Why planning fell back to plain decoding.")
    nodes: list[NodeTiming] = Field(default_factory=list)
    prefix_hit_tokens: int = Field(0, description="Node prompt tokens served from the prefix cache.")
    node_prompt_tokens: int = Field(0, description="Node prompt tokens in all (plan nodes, outline points).")
    node_prompt_shareable_tokens: int = Field(
        0, description="Node prompt tokens that an earlier node of the same answer had already computed (the "
        "longest common start with an earlier node's prompt, or prompt and answer), or at least the preamble "
        "that node prompts of every question open with: the most any prefix cache "
        "could serve with these prompts.")


async def fixed_prefix_request(client: DecodeClient, messages: list[dict], params: SamplingParams) -> GenerationRequest:
    """A planning request whose instructions and worked examples (every message but the question)
    are marked as its shared prefix: the same for every question, so the decoder replica prefills
    them once and later plans start from their cached KV (a few hundred prompt tokens each).
    The prefix closes with the template's end-of-turn token, so it is a token prefix of the whole."""
    ids = await client.encode_chat(messages)
    prefix = await client.encode_chat(messages[:-1], add_generation_prompt=False)
    shared = len(prefix) if len(prefix) < len(ids) and ids[: len(prefix)] == prefix else 0
    return GenerationRequest(prompt_ids=ids, params=params, shared_prefix_len=shared)


class TextEmitter:
    """Hands a streamed answer's text on as it grows: `to(text)` sends what `text` adds to what was
    sent. What it is given always starts with what it sent (settled text is never taken back). Without
    `emit` (an answer nobody streams) it sends nothing."""

    def __init__(self, emit: Emit | None = None):
        self.emit, self.sent = emit, ""
        self.lock = asyncio.Lock()

    @property
    def live(self) -> bool:
        return self.emit is not None

    async def to(self, text: str, strict: bool = True) -> None:
        """Send what `text` adds. Text that does not go on from what was sent is an error, or, not
        `strict` (text settled so far, which the whole answer will settle anyway), held back."""
        if not self.live:
            return
        async with self.lock:  # pieces go out in order, whichever node's task sends; a shorter text is older
            if len(text) <= len(self.sent):
                return
            if not text.startswith(self.sent):
                if not strict:
                    log.warning("held back a streamed answer's text that does not go on from what was sent")
                    return
                raise RuntimeError("a streamed answer's text changed after it was sent")
            piece, self.sent = text[len(self.sent):], text
            await self.emit(piece)

    async def settled(self, plan: Plan, answers: dict[int, str], journaled: set[int], failures: dict[int, str],
                      heads: set[int] = frozenset(), partials: dict[int, str] | None = None) -> None:
        """Send a planned answer's settled text (graph.assemble.settled_text), counting only the answers in
        `journaled`: a paragraph a client has must be one that another replica can rebuild. `plan`: as far as
        it is known (nodes are only ever added after it); `partials`: what nodes still decoding have written
        so far (the next node's goes out as it grows; see _PlatoRun._take_up)."""
        if self.live:
            kept = {i: a for i, a in answers.items() if i in journaled}
            await self.to(settled_text(plan, kept, failures, heads, partials)[0], strict=False)


_SILENT = TextEmitter()  # sends nothing: for an answer nobody streams


class Orchestrator:
    """Runs the three modes. All decoding goes through `client`; nothing here blocks."""

    def __init__(self, client: DecodeClient, config: AnswerConfig | None = None):
        self.client = client
        self.config = config or AnswerConfig()

    async def answer(self, question: str, mode: RequestMode, emit: Emit | None = None,
                     journal: AnswerJournal | None = None, resume: Resume | None = None) -> Answer:
        """The answer; with `emit`, its text is also handed on as it settles, from its start (a plan's
        paragraphs in plan order once the plan is complete, a plain answer token by token). With
        `journal`, what is made is written down as it comes (opened here; the caller closes it once the
        answer has reached its client); with `resume`, the answer goes on from what an earlier replica
        journaled and the text its client already has (`emit` starts over from the beginning all the
        same: the caller skips what was sent)."""
        started = time.perf_counter()
        emitter = TextEmitter(emit)
        saved = resume.saved if resume else None
        sent = resume.sent if resume else ""
        if saved is not None and saved.mode is not None:
            mode, reason = saved.mode, saved.routed
        else:
            reason = None
            if mode == "auto":
                mode, reason = route(question)
            if journal is not None and saved is None:
                await journal.begin(question, mode=mode, routed=reason)
            elif journal is not None:
                await journal.note(mode=mode, routed=reason)
        if saved is not None and saved.fallback is not None:
            answer = await self._ar(question, saved.fallback, saved.tokens, mode, emitter, sent)
        elif sent and (mode == "ar" or saved is None or saved.plan is None):
            # the text sent was a plain answer's, or its plan is lost with the context: go on from the text
            why = None if mode == "ar" else "resumed from the text already sent: the plan was not journaled"
            answer = await self._ar(question, why, saved.tokens if saved else 0, mode, emitter, sent)
        elif mode == "ar":
            answer = await self._ar(question, emitter=emitter)
        elif mode == "sot":
            answer = await self._sot(question, emitter, journal, saved)
        else:
            answer = await _PlatoRun(self.client, self.config, question, emitter, journal, saved, sent).execute()
        await emitter.to(answer.text)
        answer.latency_s = time.perf_counter() - started
        answer.routed = reason
        return answer

    async def _ar(self, question: str, fallback: str | None = None, spent: int = 0, planned_as: Mode = "plato",
                  emitter: TextEmitter = _SILENT, continue_from: str = "") -> Answer:
        """A plain answer; with `fallback`, the one a `planned_as` answer fell back to (it keeps that mode).
        With `continue_from`, it goes on after that text (a client has it already)."""
        ids = await self.client.encode_chat([{"role": "user", "content": question}])
        resume_ids = await self.client.encode(continue_from) if continue_from else []
        mode = planned_as if fallback else "ar"
        if len(resume_ids) >= self.config.max_tokens:  # the text sent was the whole answer
            return Answer(mode=mode, text=continue_from, latency_s=0.0, completion_tokens=spent + len(resume_ids),
                          fallback=fallback)
        request = GenerationRequest(prompt_ids=ids, resume_ids=resume_ids, params=SamplingParams(
            max_tokens=self.config.max_tokens, stop_on_loop=self.config.stop_on_loop))
        if not emitter.live:
            result = await self.client.generate(request)
            text = result.text
        else:
            text, result = continue_from, None
            await emitter.to(text)
            async for item in self.client.stream(request):
                if isinstance(item, Result):
                    result = item
                else:
                    text += item.text
                    await emitter.to(text)
        return Answer(mode=mode, text=text, latency_s=0.0, fallback=fallback,
                      completion_tokens=spent + result.completion_tokens)  # the resumed tokens count: they are the answer's

    async def _sot(self, question: str, emitter: TextEmitter = _SILENT, journal: AnswerJournal | None = None,
                   saved: SavedAnswer | None = None) -> Answer:
        tokens = saved.tokens if saved else 0
        if saved is not None and saved.plan is not None:
            plan = saved.plan
        else:
            params = SamplingParams(max_tokens=self.config.plan_max_tokens, stop=[PLAN_END],
                                    presence_penalty=self.config.plan_presence_penalty)
            skeleton = await self.client.generate(
                await fixed_prefix_request(self.client, sot_skeleton_messages(question), params))
            tokens += skeleton.completion_tokens
            outline = parse_plan(question, skeleton.text, truncated=skeleton.finish_reason is FinishReason.LENGTH)
            points = [node.text for node in outline.nodes][: self.config.max_nodes]
            if len(points) < 2:
                why = "the outline had fewer than two points"
                if journal is not None:
                    await journal.note(fallback=why, tokens=tokens)
                return await self._ar(question, fallback=why, spent=tokens, planned_as="sot", emitter=emitter)
            plan = Plan(question=question, nodes=[PlanNode(id=i, text=t, depends_on=[]) for i, t in enumerate(points, 1)])
            if journal is not None:
                await journal.plan(plan, tokens=tokens)
        points = [node.text for node in plan.nodes]
        point_params = node_params(self.config)
        prompts = [await self.client.encode_chat(sot_point_messages(question, points, i)) for i in range(1, len(points) + 1)]
        answers = dict(saved.answers) if saved else {}

        async def point(i: int) -> None:
            nonlocal tokens
            result = await self.client.generate(GenerationRequest(prompt_ids=prompts[i - 1], params=point_params))
            answers[i] = result.text
            tokens += result.completion_tokens
            if journal is not None:
                await journal.nodes(answers={i: result.text}, tokens=tokens)
            journaled.add(i)
            await emitter.settled(plan, answers, journaled, {})

        journaled = set(answers)
        await emitter.settled(plan, answers, journaled, {})  # the points a resumed answer already has
        await asyncio.gather(*(point(i) for i in range(1, len(points) + 1) if i not in answers))
        return Answer(
            mode="sot", text=assemble_answer(plan, answers), latency_s=0.0, plan=plan, completion_tokens=tokens,
            node_prompt_tokens=sum(map(len, prompts)),
            node_prompt_shareable_tokens=sum(max((common_length(p, q) for q in prompts[:i]), default=0)
                                             for i, p in enumerate(prompts)),
        )


@dataclass
class _NodeConversation:
    """A finished node's prompt and answer, which the prompts of its children may continue."""

    messages: list[dict]
    answer: str
    length: int  # tokens of prompt and answer
    kept: list[int]  # the leading tokens of prompt + answer whose KV the engine kept (`keep_kv`)


class _PlatoRun:
    """One plato answer: stream the plan, dispatch ready nodes as lines complete, assemble."""

    def __init__(self, client: DecodeClient, config: AnswerConfig, question: str, emitter: TextEmitter,
                 journal: AnswerJournal | None = None, saved: SavedAnswer | None = None, sent: str = ""):
        self.client, self.config, self.question = client, config, question
        self.emitter, self.journal, self.saved, self.sent = emitter, journal, saved, sent
        self.plan_journaled = 0  # nodes of the plan in the journal
        self.journaled: set[int] = set()  # answered nodes whose answers are journaled (all, without a journal)
        self.partials: dict[int, str] = {}  # what each node streamed to a client has written so far
        self.failures_journaled: set[int] = set()
        self.heads: set[int] = set()  # nodes whose answers go on from a start a client has (cleaned already)
        deadline = time.monotonic() + config.deadline_s if config.deadline_s else None
        self.execution = DagExecution(question, config.max_nodes, deadline=deadline, pipelining=config.pipelining)
        self.tasks: set[asyncio.Task] = set()
        self.tokens = 0
        self.plan_tokens_seen = 0  # the plan's tokens as they stream (its result counts them once it is whole)
        self.prefix_hit_tokens = 0
        self.node_prompt_tokens = 0
        self.shareable_tokens = 0
        self.conversations: dict[int, _NodeConversation] = {}
        self.computed: list[list[int]] = []  # node prompts, and prompts with answers, computed so far
        self.preamble_ids: list[int] | None = None

    async def execute(self) -> Answer:
        if self.saved is not None and self.saved.plan is not None:
            fallback = await self._restore(self.saved)
            if fallback:
                return await self._fall_back(fallback)
            return await self._finish(self.saved.plan_s)
        started = time.perf_counter()
        try:
            plan_result, plan_s = await self._stream_plan()
        except ValueError:  # the request's own fault (a question too long to plan, say): the caller's to hear
            raise
        except Exception as exc:  # the plan's decoding failed: a plain answer may still be had
            why = f"fallback to plain decoding: the plan failed to decode ({type(exc).__name__}: {exc})"
            self.tokens += self.plan_tokens_seen
            if self.emitter.sent and not self.execution.plan_complete():  # its parts are going out: keep them
                log.warning("a plan whose parts were going out was cut where its decoding failed: %r", exc)
                return await self._finish(time.perf_counter() - started)
            return await self._fall_back(why)
        self.tokens += plan_result.completion_tokens
        fallback = self.execution.plan_complete()
        if fallback:
            return await self._fall_back(fallback)
        if self.journal is not None:
            await self.journal.plan(self.execution.plan, plan_s=plan_s, tokens=self.tokens)
        return await self._finish(plan_s)

    async def _fall_back(self, why: str) -> Answer:
        """Answer plainly instead. A client may have the plan's first part already (its first line, alone,
        did not yet settle that the plan would not fall back): the plain answer goes on after it. Taken up,
        the client's text is the one it was sent before (this emitter starts from the beginning again)."""
        for task in self.tasks:  # nodes of a plan that will not be used
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if self.journal is not None:
            await self.journal.note(fallback=why, tokens=self.tokens)
        orchestrator = Orchestrator(self.client, self.config)
        return await orchestrator._ar(self.question, fallback=why, spent=self.tokens, emitter=self.emitter,
                                      continue_from=max(self.emitter.sent, self.sent, key=len))

    async def _restore(self, saved: SavedAnswer) -> str | None:
        """Take up a journaled answer: its plan (complete, or as far as it had gone when its parts began to
        go out: kept as complete), the nodes already answered or failed (failures that were journaled were
        sent as such) and the prompts their children continue. Returns why to answer plainly instead: a
        plan journaled with one line, as its first part went out, is too short to execute."""
        for node in saved.plan.nodes:  # repaired already: repair keeps it as it is
            self.execution.add_node(node)
        self.tokens = saved.tokens
        fallback = self.execution.plan_complete()
        if fallback:
            return fallback
        for node_id, reason in saved.failures.items():
            self.execution.node_failed(node_id, reason)
        for node_id, text in saved.answers.items():
            if self.execution.status(node_id) is NodeStatus.PENDING:
                self.execution.node_restored(node_id, text)
                prompt = saved.prompts.get(node_id)
                if prompt is not None:  # no KV kept on this replica to claim (`kept` empty)
                    self.conversations[node_id] = _NodeConversation(prompt.messages, text, prompt.length, [])
        self.journaled |= set(saved.answers)
        self.heads |= set(saved.clean_heads)
        self._take_up(self.sent)
        return None

    def _take_up(self, sent: str) -> None:
        """A client may have the start of the next node's paragraph (streamed as it was written): that
        node goes on from there, its start kept as the client has it."""
        settled, node = settled_text(self.execution.plan, self.execution.answers, self.execution.failures, self.heads)
        if len(sent) <= len(settled):
            return
        if node is None or not sent.startswith(settled):
            raise RuntimeError("the text a client has does not continue the journaled answer")
        self.partials[node.id] = sent[len(settled):]
        self.heads.add(node.id)

    async def _finish(self, plan_s: float | None) -> Answer:
        """Decode the plan's open nodes, sending the text as it settles, and assemble the answer."""
        await self._settle()
        self._dispatch()
        await self._drain()
        execution = self.execution
        if self.journal is not None:  # all of it, before the last of the text goes out
            missing = {i: a for i, a in execution.answers.items() if i not in self.journaled}
            await self.journal.nodes(answers=missing, failures=execution.failures, tokens=self.tokens,
                                     clean_heads=sorted(self.heads))
        return Answer(
            mode="plato", latency_s=0.0, plan=execution.plan, plan_s=plan_s, completion_tokens=self.tokens,
            text=assemble_answer(execution.plan, execution.answers, execution.failures, self.heads),
            nodes=execution.timings(), prefix_hit_tokens=self.prefix_hit_tokens,
            node_prompt_tokens=self.node_prompt_tokens, node_prompt_shareable_tokens=self.shareable_tokens,
        )

    async def _stream_plan(self) -> tuple[Result, float]:
        started = time.perf_counter()
        params = SamplingParams(max_tokens=self.config.plan_max_tokens, stop=[PLAN_END],
                                constraint=self.config.plan_constraint,
                                presence_penalty=self.config.plan_presence_penalty)
        request = await fixed_prefix_request(self.client, plan_messages(self.question, self.config.max_nodes), params)
        parser, result = StreamingPlanParser(), None
        try:
            stream = self.client.stream(request)
            async for item in stream:
                if isinstance(item, Result):
                    result = item
                    continue
                self.plan_tokens_seen += len(item.token_ids)
                if self._add_nodes(parser.feed(item.text)):
                    await self._settle()  # the new line's part, and what its nodes wrote, may go out
        except ValueError as exc:
            if params.constraint is None or not str(exc).startswith("constraint"):
                raise
            self.config = self.config.model_copy(update={"plan_constraint": None})  # this tokenizer can't
            return await self._stream_plan()
        self._add_nodes(parser.close(truncated=result.finish_reason is FinishReason.LENGTH))
        return result, time.perf_counter() - started

    def _add_nodes(self, nodes: list[PlanNode]) -> int:
        """Add parsed nodes and start those that may; returns how many were kept."""
        kept = sum(self.execution.add_node(node) is not None for node in nodes)
        self._dispatch()
        return kept

    def _dispatch(self) -> None:
        for node in self.execution.dispatchable():
            self.tasks.add(asyncio.create_task(self._run_node(node)))

    async def _run_node(self, node: PlanNode) -> None:
        execution = self.execution
        try:
            plan_so_far = execution.plan
            parents = execution.parent_answers(node.id)
            lead_id = self._lead_parent(node) if self.config.follow_up_prompts else None
            if lead_id is None:
                messages = node_messages(self.question, plan_so_far, node, parents)
            else:
                lead = self.conversations[lead_id]
                others = {p: a for p, a in parents.items() if p != lead_id}
                messages = follow_up_messages(lead.messages, lead.answer, plan_so_far, node, others)
            ids = await self.client.encode_chat(messages)
            shared, keep = 0, False
            if self.config.kv_reuse:
                if lead_id is not None:  # the lead's prompt and answer, kept by the engine
                    shared = common_length(ids, self.conversations[lead_id].kept)
                else:
                    shared = await self._plan_prefix_length(ids, plan_so_far)
                # a node with children (or that may get some: the plan is still streaming) keeps its KV
                may_have_children = not execution.plan_is_complete or execution.has_children(node.id)
                keep = self.config.follow_up_prompts and may_have_children
            preamble = await self._preamble_length(ids) if self.config.kv_reuse else 0
            no_copy = [self.question, *(n.text for n in plan_so_far.nodes)]
            params = node_params(self.config, no_copy, self._start_rank(node), wrap_up=True, openings=True)
            start = self.partials.get(node.id, "")  # the start a client has of a node taken up
            resume_ids = await self.client.encode(start) if start else []
            request = GenerationRequest(prompt_ids=ids, params=params, preamble_len=preamble, resume_ids=resume_ids,
                                        shared_prefix_len=shared if shared < len(ids) else 0, keep_kv=keep)
            self.shareable_tokens += max((common_length(ids, seen) for seen in self.computed), default=preamble)
            self.computed.append(ids)
            if len(resume_ids) >= params.max_tokens:  # the client has all of it
                result, text = None, start
            elif start or self._is_next(node.id):
                result, text = await self._stream_node(node.id, request, start)
            else:
                result = await self.client.generate(request)
                text = result.text
        except Exception as exc:  # one failed node must not sink the others
            if not self._cut_short(node.id, f"decoding failed: {exc}"):
                execution.node_failed(node.id, f"decoding failed: {exc}")
            await self._node_settled(node.id)
            return
        prompt = None
        if result is not None:
            self.tokens += result.completion_tokens  # a start taken up counts: the journal had not counted it
            self.prefix_hit_tokens += result.prefix_hit_tokens
            self.node_prompt_tokens += len(ids)
            sequence = ids + result.token_ids
            self.computed.append(sequence)
            self.conversations[node.id] = _NodeConversation(messages, text, len(sequence),
                                                            sequence[: result.kept_kv_tokens])
            prompt = NodePrompt(messages=messages, length=len(sequence))
        if not execution.node_done(node.id, text, result.latency_s if result else 0.0):
            return
        self._dispatch()
        await self._node_settled(node.id, prompt)

    def _start_rank(self, node: PlanNode) -> int | None:
        """How many nodes start before this one, for its share of the budget (`node_params`): its place
        in the plan for a node without parents, which starts as soon as its line is written; last for a
        node with parents, which waits for one to be answered. A function of the plan alone, so that
        a planner taking the answer up gives a node the budget it had."""
        if not self.config.pipelining:
            return None  # every node starts once the plan is complete
        if node.depends_on:
            return self.config.nodes_per_budget - 1
        return [n.id for n in self.execution.plan.nodes].index(node.id)

    def _is_next(self, node_id: int) -> bool:
        """Whether every node before this one in plan order is answered or failed: this one's paragraph
        is the next to go out, so it is streamed as it is written (the others are sent whole)."""
        if not self.emitter.live:
            return False
        return all(self.execution.status(n.id) in (NodeStatus.DONE, NodeStatus.FAILED)
                   for n in self.execution.plan.nodes if n.id < node_id)

    async def _stream_node(self, node_id: int, request: GenerationRequest, start: str) -> tuple[Result, str]:
        """Decode a node as a stream, its text so far in `partials`, sending each stable piece."""
        text, result = start, None
        self.partials[node_id] = text
        async for item in self.client.stream(request):
            if isinstance(item, Result):
                result = item
            else:
                text += item.text
                self.partials[node_id] = text
                await self._settle()
        return result, text

    def _cut_short(self, node_id: int, why: str) -> bool:
        """A streamed node whose start may have gone out ends there, marked, when it fails: its paragraph
        cannot become `[not answered: ...]` after the client has a start of it."""
        partial = self.partials.get(node_id)
        if partial is None or not stable_body(partial, self.execution.plan.node(node_id), self.question,
                                              node_id in self.heads):
            return False
        return self.execution.node_done(node_id, f"{partial}\n[cut short: {why}]", 0.0)

    async def _node_settled(self, node_id: int, prompt: NodePrompt | None = None) -> None:
        """Journal a node's answer, if it has one (not when it failed), then send what is settled."""
        answered = self.execution.status(node_id) is NodeStatus.DONE
        if self.journal is not None and answered:
            await self.journal.nodes(answers={node_id: self.execution.answers[node_id]},
                                     prompts={node_id: prompt} if prompt else None, tokens=self.tokens,
                                     clean_heads=sorted(self.heads))
        if answered:
            self.journaled.add(node_id)
        await self._settle()

    async def _settle(self) -> None:
        """Send what is settled now (nodes failed meanwhile included: those are journaled first). While
        the plan streams, from its first usable node on: later lines only add paragraphs after it. A plan
        of one usable node falls back to plain decoding (graph.plan.PlanNormalizer.verdict), which then
        goes on after what was sent; from the second on it cannot. Measured on the embedded model, the
        first line comes about 0.8 s before the second. The plan so far is journaled first: a planner that
        takes the answer up keeps it, as complete."""
        if not self.emitter.live or self.execution.fallback_reason is not None:
            return  # a plan that fell back sends the plain answer instead
        plan = self.execution.plan
        if not self.execution.plan_is_complete:
            if not plan.nodes:
                return
            if self.journal is not None and len(plan.nodes) > self.plan_journaled:
                await self.journal.plan(plan, tokens=self.tokens + self.plan_tokens_seen)
                self.plan_journaled = max(self.plan_journaled, len(plan.nodes))
        failures = self.execution.failures
        unjournaled = {i: r for i, r in failures.items() if i not in self.failures_journaled}
        if self.journal is not None and unjournaled:
            await self.journal.nodes(failures=unjournaled)
        self.failures_journaled |= set(unjournaled)
        await self.emitter.settled(plan, self.execution.answers, self.journaled, failures, self.heads, self.partials)

    def _lead_parent(self, node: PlanNode) -> int | None:
        """The parent whose conversation this node's prompt continues: the longest one (most KV to
        reuse), the later one on a tie; None for a node without parents."""
        parents = [p for p in node.depends_on if p in self.conversations]
        return max(parents, key=lambda p: (self.conversations[p].length, p), default=None)

    async def _preamble_length(self, ids: list[int]) -> int:
        """How many leading tokens of a node prompt are the preamble that node prompts of every question
        open with (graph.prompts.node_preamble): computed once per replica, then reused by the first
        node of every later question too."""
        if self.preamble_ids is None:
            self.preamble_ids = await self.client.encode_chat(node_preamble(), add_generation_prompt=False)
        n = len(self.preamble_ids)
        return n if n < len(ids) and ids[:n] == self.preamble_ids else 0

    async def _plan_prefix_length(self, ids: list[int], plan_so_far: Plan) -> int:
        """How much of a parentless node's prompt to mark as shared: the instructions, the question and
        the plan. Marked, not prefilled apart: the engine caches the prefix as this node's prompt is
        prefilled (a separate prefill step would stall the plan still being decoded), and later nodes
        whose prompts start with it reuse it. While the plan streams, what every later node prompt
        starts with ends with the plan text so far, before the plan message's end-of-turn token
        (graph.prompts.streaming_prefix_probe)."""
        prefix = await self.client.encode_chat(shared_prefix_messages(self.question, plan_so_far),
                                               add_generation_prompt=False)
        if not self.execution.plan_is_complete:
            probe = await self.client.encode_chat(streaming_prefix_probe(self.question, plan_so_far),
                                                  add_generation_prompt=False)
            prefix = prefix[: common_length(prefix, probe)]
        return len(prefix) if len(prefix) < len(ids) and ids[: len(prefix)] == prefix else 0

    async def _drain(self) -> None:
        """Wait for running nodes; on the deadline, fail what is left and stop waiting."""
        while self.tasks:
            timeout = None
            if self.execution.deadline is not None:
                timeout = max(0.0, self.execution.deadline - time.monotonic())
            done, _ = await asyncio.wait(self.tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            self.tasks -= done
            if not done:
                if self.execution.deadline is not None and time.monotonic() >= self.execution.deadline:
                    for node_id in list(self.partials):
                        if self.execution.status(node_id) is NodeStatus.RUNNING:
                            self._cut_short(node_id, "the request's deadline passed")
                self.execution.expire()
                for task in self.tasks:
                    task.cancel()
                self.tasks.clear()
                await self._settle()
            self._dispatch()
