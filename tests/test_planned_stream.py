"""Planned answers streamed as they settle, journaled in the context cache, and taken up by another
planner when theirs dies: over the scripted decode client of test_orchestrator (exact plans and
answers), the in-process context cache, and the ingress's planner backend over a fake handle."""
from __future__ import annotations

import asyncio

import pytest

from actors.context_cache import ContextCache
from actors.decode_client import BatcherClient, Tokenizing
from actors.planner import PlannerReplica
from deployments.app import HandleBackend
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest
from engine.types import TokenEvent
from graph.journal import AnswerJournal, Resume
from graph.orchestrator import AnswerConfig, Orchestrator, node_params
from tests.test_orchestrator import DIAMOND, ScriptedClient

QUESTION = "Q?"
SLOW_NODES = {"line_delay": 0.005, "node_delay": 0.05}  # the plan is complete before node 1 is answered


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Mortal:
    """The context cache as one planner replica reaches it: after `die()` nothing it sends arrives,
    as when its process is gone (its tasks may still run here; their writes are lost)."""

    def __init__(self, cache: ContextCache):
        self.cache, self.dead = cache, False

    def die(self) -> None:
        self.dead = True

    def __getattr__(self, name):
        method = getattr(self.cache, name)

        async def call(*args, **kwargs):
            if self.dead:
                raise ConnectionError("this replica is gone")
            return await method(*args, **kwargs)
        return call


class Collect:
    """An emit callback that keeps the pieces and what the client had decoded when each came."""

    def __init__(self, client: ScriptedClient | None = None, on_piece=None):
        self.pieces: list[str] = []
        self.log_at: list[list[str]] = []
        self.client, self.on_piece = client, on_piece

    async def __call__(self, piece: str) -> None:
        self.pieces.append(piece)
        self.log_at.append(list(self.client.log) if self.client else [])
        if self.on_piece:
            self.on_piece(self)


def undisturbed(mode: str = "plato", plan: str = DIAMOND, **client) -> str:
    return run(Orchestrator(ScriptedClient(plan, **client)).answer(QUESTION, mode)).text


def test_a_plan_is_sent_paragraph_by_paragraph_in_plan_order():
    client = ScriptedClient(DIAMOND, line_delay=0.01, node_delay=0.05)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert "".join(sent.pieces) == answer.text and answer.fallback is None
    # the next part's bold lead goes out as soon as it is known, whatever its answer will be
    assert sent.pieces[:2] == ["**Find A.** ", "answer to Find A\n\n**Use A for B.** "]
    assert "node:1" not in sent.log_at[0] and "node:4" not in sent.log_at[1]


def test_parts_go_out_while_the_plan_streams_from_its_first_usable_node():
    client = ScriptedClient(DIAMOND, line_delay=0.05, node_delay=0.01)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert "".join(sent.pieces) == answer.text == undisturbed(line_delay=0.05, node_delay=0.01)
    assert sent.pieces[:3] == ["**Find A.** ", "answer to Find A", "\n\n**Use A for B.** "]
    assert "node:1" not in sent.log_at[0] and "node:2" not in sent.log_at[1]  # each as soon as it was known
    assert "plan:end" not in sent.log_at[2]


ONE_USABLE_LINE = "1. Find A [needs: none]\n2. Find A [needs: none]"  # repair drops the repeated line


def test_a_plan_left_with_one_usable_node_after_its_first_part_went_out_goes_on_plainly_after_it():
    client = ScriptedClient(ONE_USABLE_LINE, line_delay=0.05, node_delay=0.01)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert "".join(sent.pieces) == answer.text and answer.fallback == (
        "fallback to plain decoding: only 1 usable node, nothing to decode in parallel")
    assert sent.pieces[0] == "**Find A.** " and answer.text.startswith("**Find A.** answer to Find A")
    assert answer.text.endswith("a plain answer") and client.log[-1] == "ar"
    # unstreamed, nothing of the plan was shown, so the plain answer is all of it
    assert undisturbed(plan=ONE_USABLE_LINE, line_delay=0.05, node_delay=0.01) == "a plain answer"


def test_a_plan_that_fails_to_decode_after_its_first_part_went_out_goes_on_plainly_after_it():
    class BreaksAfterOneLine(ScriptedClient):
        async def stream(self, request):
            async for item in super().stream(request):
                if isinstance(item, TokenEvent) and "2. " in item.text:
                    raise RuntimeError("the plan's stream broke")
                yield item

    client = BreaksAfterOneLine(DIAMOND, line_delay=0.05, node_delay=0.01)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert answer.fallback.startswith("fallback to plain decoding: the plan failed to decode (RuntimeError")
    assert "".join(sent.pieces) == answer.text and answer.text.startswith("**Find A.** ")
    assert answer.text.endswith("a plain answer") and "node:2" not in client.log


def test_a_plan_whose_decoding_fails_after_its_parts_began_to_go_out_keeps_them():
    class BreaksAfterThreeLines(ScriptedClient):
        async def stream(self, request):
            lines = 0
            async for item in super().stream(request):
                lines += isinstance(item, TokenEvent) and "[needs:" in item.text
                if lines == 4:
                    raise RuntimeError("the plan's stream broke")
                yield item

    client = BreaksAfterThreeLines(DIAMOND, line_delay=0.05, node_delay=0.01)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert answer.fallback is None and len(answer.plan.nodes) == 3 and "".join(sent.pieces) == answer.text
    nodes = sum(len(f"answer to {t}") for t in ("Find A", "Use A for B", "Use A for C"))  # a token a character
    assert answer.completion_tokens == 3 + nodes  # the plan's three lines (a token each) count too
    assert answer.text.startswith("**Find A.** answer to Find A") and "Join B and C" not in answer.text


def test_a_failed_node_is_sent_as_not_answered_in_its_place():
    client = ScriptedClient(DIAMOND, fail_on="Use A for B")
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert "".join(sent.pieces) == answer.text
    assert "**Use A for B.** [not answered: decoding failed: replica died]" in answer.text
    assert "**Join B and C.** [not answered: parent 2 failed" in answer.text


def test_a_plain_answer_and_a_plan_that_falls_back_are_sent_token_by_token():
    for mode, plan in (("ar", DIAMOND), ("plato", "garbage without any plan lines")):
        sent = Collect()
        answer = run(Orchestrator(ScriptedClient(plan)).answer(QUESTION, mode, sent))
        assert sent.pieces == ["a ", "plain ", "answer"] and answer.text == "a plain answer"
        assert (answer.fallback is not None) == (mode == "plato")


def test_a_node_that_fails_after_its_plan_fell_back_sends_nothing_more_of_the_plan():
    # one usable line: its lead goes out and the plan falls back; node 1, started as the line came and
    # failing later, is stopped, and nothing of it is sent
    client = ScriptedClient(ONE_USABLE_LINE, line_delay=0.005, node_delay=0.05, fail_on="Find A")
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert answer.fallback is not None and answer.text == "**Find A.** a plain answer" == "".join(sent.pieces)


def test_outline_points_are_sent_in_order_as_they_settle():
    sent = Collect()
    answer = run(Orchestrator(ScriptedClient(DIAMOND)).answer(QUESTION, "sot", sent))
    assert "".join(sent.pieces) == answer.text and sent.pieces[:2] == ["**Alpha.** ", "point 1 text\n\n**Beta.** "]


async def until_dead(answer, contexts: Mortal, sent: Collect, pieces: int) -> str:
    """Run `answer` (a coroutine sending to `sent`) until `pieces` pieces are out, then let its replica
    die there: its context cache writes stop, and the text the client has is those pieces."""
    died = asyncio.Event()

    def hook(collect: Collect) -> None:
        if len(collect.pieces) == pieces:
            contexts.die()
            died.set()

    sent.on_piece = hook
    task = asyncio.create_task(answer)
    waiting = asyncio.create_task(died.wait())
    await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
    assert died.is_set(), "the answer ended before the replica was to die"
    task.cancel()
    return "".join(sent.pieces[:pieces])


def first_attempt(mode: str, cache: ContextCache, pieces: int, plan: str = DIAMOND, config: AnswerConfig | None = None,
                  **client) -> str:
    """Answer under a journal until `pieces` pieces are sent, then die; the text the client has."""
    contexts, sent = Mortal(cache), Collect()
    orchestrator = Orchestrator(ScriptedClient(plan, **SLOW_NODES, **client), config)
    answer = orchestrator.answer(QUESTION, mode, sent, AnswerJournal(contexts, "k"))
    return run(until_dead(answer, contexts, sent, pieces))  # what is left running is cancelled as the loop ends


def take_up(cache: ContextCache, sent_text: str, mode: str = "plato", plan: str = DIAMOND,
            config: AnswerConfig | None = None, **client):
    journal = AnswerJournal(cache, "k")
    saved = run(journal.load())
    client = ScriptedClient(plan, **client)
    sent = Collect()
    answer = run(Orchestrator(client, config).answer(QUESTION, mode, sent, journal, Resume(saved=saved, sent=sent_text)))
    assert "".join(sent.pieces) == answer.text
    return saved, client, answer


def test_a_plan_taken_up_by_another_planner_keeps_its_plan_and_answered_nodes():
    cache = ContextCache()
    had = first_attempt("plato", cache, pieces=3)  # node 1's lead, its answer, node 2's
    saved, client, answer = take_up(cache, had)
    assert saved.plan is not None and len(saved.plan.nodes) == 4 and {1, 2} <= set(saved.answers)
    assert answer.text.startswith(had) and answer.text == undisturbed()
    assert "plan:start" not in client.log and "node:1" not in client.log and "node:2" not in client.log
    assert "node:4" in client.log
    # the children it decodes continue a lead parent's conversation, journaled or its own (which holds node 1's)
    node_4 = next(r for r in client.requests if "Answer part 4" in client._text(r.prompt_ids))
    assert "Answer part 1 in two or three sentences" in client._text(node_4.prompt_ids)


def test_failures_a_client_has_seen_stay_failures_when_the_answer_is_taken_up():
    cache = ContextCache()
    had = first_attempt("plato", cache, pieces=3, fail_on="Use A for B")
    assert "[not answered" in had
    saved, client, answer = take_up(cache, had)  # this replica would answer node 2: it is not asked to
    assert answer.text.startswith(had) and "node:2" not in client.log
    assert answer.text == undisturbed(fail_on="Use A for B")


def test_a_plain_answer_taken_up_goes_on_after_the_text_its_client_has():
    cache = ContextCache()
    had = first_attempt("ar", cache, pieces=2)
    assert had == "a plain "
    saved, client, answer = take_up(cache, had, mode="auto")  # the journal's mode wins over a new route
    assert saved.mode == "ar" and answer.mode == "ar" and answer.text == "a plain answer"


def test_a_fallback_taken_up_stays_plain_and_goes_on_after_the_text_sent():
    cache = ContextCache()
    had = first_attempt("plato", cache, pieces=1, plan="garbage without any plan lines")
    saved, client, answer = take_up(cache, had)
    assert saved.fallback is not None and answer.fallback == saved.fallback
    assert answer.text == "a plain answer" and "plan:start" not in client.log


def test_an_outline_taken_up_keeps_its_points():
    cache = ContextCache()
    had = first_attempt("sot", cache, pieces=2)
    saved, client, answer = take_up(cache, had, mode="sot")
    assert saved.plan is not None and "skeleton" not in client.log and "point:1" not in client.log
    assert answer.text.startswith(had) and answer.text == undisturbed("sot")


def test_text_sent_without_a_journal_to_take_up_goes_on_as_a_plain_answer_and_says_so():
    client = ScriptedClient(DIAMOND)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", Collect(), None, Resume(saved=None, sent="a ")))
    assert answer.text == "a plain answer" and "not journaled" in answer.fallback
    assert "plan:start" not in client.log


def test_a_context_cache_that_fails_costs_the_journal_not_the_answer():
    class Broken:
        def __getattr__(self, name):
            async def call(*args, **kwargs):
                raise ConnectionError("down")
            return call

    sent = Collect()
    journal = AnswerJournal(Broken(), "k")
    answer = run(Orchestrator(ScriptedClient(DIAMOND)).answer(QUESTION, "plato", sent, journal))
    assert "".join(sent.pieces) == answer.text == undisturbed() and not journal.working
    assert run(journal.load()) is None


# ---- through the service and the ingress's planner backend --------------------------------------------

class Died(Exception):
    pass


class FakePlannerHandle:
    """`planner.options(stream=True).stream.remote(request, call)` / `planner.complete.remote(...)` over
    planner replicas in turn: each call goes to the next replica; `die_after` chunks into its stream, the
    first replica dies (its context cache writes stop, and the call raises)."""

    def __init__(self, replicas: list[tuple[PlannerReplica, Mortal]], die_after: int):
        self.replicas, self.die_after, self.calls = replicas, die_after, 0
        self.stream, self.complete = self._Method(self, "stream"), self._Method(self, "complete")

    def options(self, stream: bool):
        return self

    class _Method:
        def __init__(self, handle, name):
            self.handle, self.name = handle, name

        def remote(self, request, call):
            handle = self.handle
            replica, contexts = handle.replicas[handle.calls]
            handle.calls += 1
            if self.name == "complete":
                return replica.complete(request, call)
            return handle._stream(replica, contexts, request, call, dies=handle.calls == 1)

    async def _stream(self, replica, contexts, request, call, dies):
        chunks = 0
        async for chunk in replica.stream(request, call):
            yield chunk
            chunks += 1
            if dies and chunks == self.die_after:
                contexts.die()
                raise Died("the planner replica died")


@pytest.fixture
def planners(tiny_tokenizer):
    """Two planner replicas (scripted decoding) sharing one context cache, and the cache."""
    cache = ContextCache()

    def replica() -> tuple[PlannerReplica, Mortal, ScriptedClient]:
        client = ScriptedClient(DIAMOND, **SLOW_NODES)
        contexts = Mortal(cache)
        tokenizing = BatcherClient(None, Tokenizing(tiny_tokenizer, "tiny", 2048))
        service = CompletionService(tokenizing, ApiLimits(), Orchestrator(client, AnswerConfig(plan_constraint=None)),
                                    contexts=contexts)
        planner = PlannerReplica.__new__(PlannerReplica)
        planner.service = service
        return planner, contexts, client

    return cache, replica


def test_the_ingress_takes_a_planned_stream_up_on_another_planner_when_its_replica_dies(planners):
    cache, replica = planners
    (first, first_contexts, _), (second, second_contexts, second_client) = replica(), replica()
    handle = FakePlannerHandle([(first, first_contexts), (second, second_contexts)], die_after=4)  # role + 3 pieces
    backend = HandleBackend(handle, backoff_s=0.0, retry_on=(Died,))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": QUESTION}], mode="plato", stream=True,
                                    stream_options={"include_usage": True})

    async def main():
        return [chunk async for chunk in backend.stream(request)]

    chunks = run(main())
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == undisturbed()
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["usage"]["completion_tokens"] > 0
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]].count("stop") == 1
    resumed = run(second.resumed())
    assert resumed["answers"] == 1 and resumed["nodes_reused"] in (2, 3)  # node 3 may go out with node 2
    assert "plan:start" not in second_client.log and "node:1" not in second_client.log
    assert run(cache.stats())["contexts"] == 0  # closed once the answer was whole


def test_the_ingress_takes_a_whole_planned_answer_up_without_planning_it_again(planners):
    cache, replica = planners
    first, first_contexts, first_client = replica()
    second, second_contexts, second_client = replica()

    class DiesMidAnswer:  # the first replica journals the plan and node 1, then dies
        async def complete(self, request, call):
            sent = Collect()
            answer = Orchestrator(first_client).answer(QUESTION, "plato", sent, AnswerJournal(first_contexts, call["key"]))
            await until_dead(answer, first_contexts, sent, pieces=2)  # node 1's lead, then its answer
            raise Died("the planner replica died")

    handle = FakePlannerHandle([(DiesMidAnswer(), first_contexts), (second, second_contexts)], die_after=0)
    backend = HandleBackend(handle, backoff_s=0.0, retry_on=(Died,))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": QUESTION}], mode="plato")
    response = run(backend.complete(request))
    assert response["choices"][0]["message"]["content"] == undisturbed()
    assert run(second.resumed())["answers"] == 1 and "plan:start" not in second_client.log


# ---- the next node's paragraph, streamed as it is written ---------------------------------------------

LONG = " with a good many more words to say about it"  # node answers long enough to show a start early


def test_the_next_nodes_paragraph_goes_out_as_it_is_written():
    client = ScriptedClient(DIAMOND, padding=LONG, **SLOW_NODES)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert "".join(sent.pieces) == answer.text == undisturbed(padding=LONG, **SLOW_NODES)
    first = "**Find A.** answer to Find A" + LONG
    assert first.startswith(sent.pieces[0]) and len(sent.pieces[0]) < len(first)  # a start of node 1's paragraph
    assert len(sent.pieces) > 8  # word by word, not a paragraph at a time
    streamed = {client._text(r.prompt_ids).rsplit("Answer part ", 1)[1][0] for r in client.streamed_requests}
    assert streamed == {"1", "2", "4"}  # each node whose paragraph was next when it started; 3 waited on 2


def test_a_streamed_node_that_breaks_after_its_start_went_out_ends_there_marked():
    client = ScriptedClient(DIAMOND, padding=LONG, break_on="Find A", **SLOW_NODES)
    sent = Collect(client)
    answer = run(Orchestrator(client).answer(QUESTION, "plato", sent))
    assert "".join(sent.pieces) == answer.text
    paragraph = answer.text.split("\n\n**")[0]
    assert paragraph.startswith("**Find A.** answer to Find A with") and "[cut short: decoding failed: the stream broke]" in paragraph
    assert "[not answered" not in answer.text  # its children went on from what it had written


def test_a_node_whose_start_a_client_has_goes_on_from_there_when_taken_up():
    cache = ContextCache()
    had = first_attempt("plato", cache, pieces=3, padding=LONG)  # node 1's paragraph, three words in
    assert had.startswith("**Find A.** answer to") and not had.endswith(LONG)
    saved, client, answer = take_up(cache, had, padding=LONG, **SLOW_NODES)
    assert not saved.answers and answer.text.startswith(had) and answer.text == undisturbed(padding=LONG, **SLOW_NODES)
    node_1 = next(r for r in client.streamed_requests if "Answer part 1" in client._text(r.prompt_ids))
    assert client._text(node_1.resume_ids) == had[len("**Find A.** "):]  # decoding goes on after the client's text
    assert run(AnswerJournal(cache, "k").load()).clean_heads == [1]  # its start stays as the client has it


def test_a_plan_journaled_with_one_line_when_its_planner_died_is_taken_up_as_a_plain_answer():
    cache = ContextCache()
    contexts, sent = Mortal(cache), Collect()
    client = ScriptedClient(DIAMOND, line_delay=0.2, node_delay=0.01)
    answer = Orchestrator(client).answer(QUESTION, "plato", sent, AnswerJournal(contexts, "k"))
    had = run(until_dead(answer, contexts, sent, pieces=1))
    assert had == "**Find A.** "
    saved, client, answer = take_up(cache, had, line_delay=0.2, node_delay=0.01)
    assert [n.text for n in saved.plan.nodes] == ["Find A"]
    assert answer.fallback == "fallback to plain decoding: only 1 usable node, nothing to decode in parallel"
    assert answer.text == had + "a plain answer" and client.log == ["ar"]
    # the plan's line (one token here) the dead replica wrote counts, as does the text the plain answer resumed
    assert saved.tokens == 1 and answer.completion_tokens == 1 + len(answer.text)


def test_a_node_taken_up_keeps_the_share_of_the_budget_it_started_with():
    """Node 1 started first, so it has the largest share (AnswerConfig.node_budget_stagger); taken up
    once the plan is complete, it still has that share, so it ends where it would have."""
    cache, config = ContextCache(), AnswerConfig(node_budget_stagger=12)
    had = first_attempt("plato", cache, pieces=3, config=config, padding=LONG)
    _, client, _ = take_up(cache, had, config=config, padding=LONG, **SLOW_NODES)
    budgets = {client._text(r.prompt_ids).rsplit("Answer part ", 1)[1][0]: r.params.max_tokens for r in client.requests}
    first, last = node_params(config, start_rank=0).max_tokens, node_params(config, start_rank=3).max_tokens
    assert first > last and budgets == {"1": first, "2": last, "3": last, "4": last}


def test_a_plan_still_streaming_when_its_planner_died_is_taken_up_as_far_as_it_was_journaled():
    cache = ContextCache()
    contexts, sent = Mortal(cache), Collect()
    client = ScriptedClient(DIAMOND, line_delay=0.05, node_delay=0.01)
    answer = Orchestrator(client).answer(QUESTION, "plato", sent, AnswerJournal(contexts, "k"))
    had = run(until_dead(answer, contexts, sent, pieces=3))  # node 1's lead, its answer, node 2's lead
    assert "plan:end" not in client.log and had == "**Find A.** answer to Find A\n\n**Use A for B.** "
    saved, client, answer = take_up(cache, had, line_delay=0.05, node_delay=0.01)
    assert [n.text for n in saved.plan.nodes] == ["Find A", "Use A for B"]  # the two lines it had when text went out
    assert [n.text for n in answer.plan.nodes] == ["Find A", "Use A for B"] and answer.text.startswith(had)
    assert "plan:start" not in client.log and "node:1" not in client.log
