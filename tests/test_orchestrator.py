"""The answer modes over a scripted decode client (exact control of plans, answers and timing),
and once over the tiny real engine (whatever it writes, the request finishes)."""
from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.types import FinishReason, GenerationRequest, Result, TokenEvent
from graph.orchestrator import AnswerConfig, EngineClient, Orchestrator
from graph.prompts import NODE_NO_OPENINGS, NODE_SYSTEM

DIAMOND = "1. Find A [needs: none]\n2. Use A for B [needs: 1]\n3. Use A for C [needs: 1]\n4. Join B and C [needs: 2, 3]"


class ScriptedClient:
    """Plans come from `plan_text`, streamed a line at a time with `line_delay` between lines;
    a node's answer is 'answer to <step text>' after `node_delay`. Records everything."""

    def __init__(self, plan_text: str, line_delay: float = 0.02, node_delay: float = 0.01, fail_on: str | None = None,
                 padding: str = "", break_on: str | None = None):
        """`padding` goes after each node's answer; a node whose text has `break_on` fails halfway through
        its stream."""
        self.plan_text, self.line_delay, self.node_delay, self.fail_on = plan_text, line_delay, node_delay, fail_on
        self.padding, self.break_on = padding, break_on
        self.log: list[str] = []
        self.prefixes: list[list[int]] = []
        self.requests: list[GenerationRequest] = []  # node requests, in the order they ran
        self.streamed_requests: list[GenerationRequest] = []  # node requests asked as a stream

    async def encode_chat(self, messages, add_generation_prompt=True):
        """A chat template over characters: each message closes with '</>'; the generation prompt
        opens an assistant message, so a prompt followed by its answer starts the follow-up."""
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [ord(c) for c in text]

    @staticmethod
    def _text(ids) -> str:
        return "".join(map(chr, ids))

    def _result(self, request, text, reason=FinishReason.STOP, hit=0) -> Result:
        return Result(request_id=request.id, prompt_tokens=len(request.prompt_ids), token_ids=[ord(c) for c in text],
                      text=text, finish_reason=reason, ttft_s=0.0, latency_s=self.node_delay, prefix_hit_tokens=hit)

    async def encode(self, text):
        return [ord(c) for c in text]

    async def stream(self, request: GenerationRequest):
        if "in two or three sentences: " in self._text(request.prompt_ids):  # a node, its answer a word at a time
            self.streamed_requests.append(request)
            whole = await self.generate(request.model_copy(update={"resume_ids": []}))
            resumed = self._text(request.resume_ids)
            rest = whole.text[len(resumed):] if whole.text.startswith(resumed) else whole.text
            words = rest.split(" ")
            for i, word in enumerate(words):
                if self.break_on and self.break_on in whole.text and i == len(words) // 2:
                    raise RuntimeError("the stream broke")
                await asyncio.sleep(0)
                yield TokenEvent(request_id=request.id, token_ids=[ord(c) for c in word], text=word + " ")
            yield whole.model_copy(update={"text": resumed + rest + " "})
            return
        if "smaller questions" not in self._text(request.prompt_ids):  # a plain answer, a word at a time
            self.log.append("ar")
            answer, resumed = "a plain answer", self._text(request.resume_ids)
            rest = answer[len(resumed):] if answer.startswith(resumed) else answer
            for word in rest.split(" "):
                word += "" if word == rest.split(" ")[-1] else " "
                await asyncio.sleep(self.node_delay)
                yield TokenEvent(request_id=request.id, token_ids=[ord(c) for c in word], text=word)
            yield self._result(request, resumed + rest)
            return
        self.log.append("plan:start")
        for line in self.plan_text.splitlines(keepends=True):
            await asyncio.sleep(self.line_delay)
            yield TokenEvent(request_id=request.id, token_ids=[1], text=line)
        self.log.append("plan:end")
        yield self._result(request, self.plan_text)

    async def generate(self, request: GenerationRequest) -> Result:
        prompt = self._text(request.prompt_ids)
        await asyncio.sleep(self.node_delay)
        if "in two or three sentences: " in prompt:
            rest = prompt.rsplit("Answer part ", 1)[1].split("</>")[0]
            step, text = rest.split(" in two or three sentences: ", 1)
            self.log.append(f"node:{step}")
            if self.fail_on and self.fail_on in text:
                raise RuntimeError("replica died")
            hit = request.shared_prefix_len  # as if the engine had cached it
            if hit:
                self.prefixes.append(list(request.prompt_ids[:hit]))
            self.requests.append(request)
            result = self._result(request, f"answer to {text}{self.padding}", hit=hit)
            if request.keep_kv:  # as the engine does: all of prompt and answer
                result.kept_kv_tokens = len(request.prompt_ids) + len(result.token_ids)
            return result
        if "Write only point" in prompt:
            point = prompt.rsplit("Write only point ", 1)[1].split(" ")[0]
            self.log.append(f"point:{point}")
            return self._result(request, f"point {point} text")
        if "short numbered list" in prompt:
            self.log.append("skeleton")
            return self._result(request, "1. Alpha\n2. Beta\n3. Gamma")
        self.log.append("ar")
        return self._result(request, "a plain answer")


def answer(client, mode, **config):
    return asyncio.run(asyncio.wait_for(Orchestrator(client, AnswerConfig(**config)).answer("Q?", mode), 10))


def test_plato_pipelines_nodes_before_the_plan_ends_and_respects_dependencies():
    client = ScriptedClient(DIAMOND)
    result = answer(client, "plato")
    assert result.mode == "plato" and result.fallback is None
    log = client.log
    assert log.index("node:1") < log.index("plan:end")  # pipelining: node 1 ran while planning
    assert log.index("node:4") > max(log.index("node:2"), log.index("node:3"))
    assert [n.status.value for n in result.nodes] == ["done"] * 4
    assert result.text.split("\n\n") == [
        "**Find A.** answer to Find A",
        "**Use A for B.** answer to Use A for B",
        "**Use A for C.** answer to Use A for C",
        "**Join B and C.** answer to Join B and C",
    ]


def test_without_pipelining_no_node_starts_before_the_plan_is_complete():
    client = ScriptedClient(DIAMOND)
    answer(client, "plato", pipelining=False)
    first_node = min(i for i, entry in enumerate(client.log) if entry.startswith("node:"))
    assert first_node > client.log.index("plan:end")


def test_kv_reuse_marks_each_node_prompts_shared_prefix():
    client = ScriptedClient(DIAMOND)
    result = answer(client, "plato")
    assert len(client.prefixes) == 4
    assert result.prefix_hit_tokens > 0
    assert result.prefix_hit_tokens == sum(len(p) for p in client.prefixes)


def test_without_kv_reuse_no_prefix_is_prefilled():
    client = ScriptedClient(DIAMOND)
    result = answer(client, "plato", kv_reuse=False)
    assert client.prefixes == [] and result.prefix_hit_tokens == 0


def test_garbage_plan_falls_back_to_plain_decoding_with_the_reason():
    client = ScriptedClient("I think the answer is simple.\nNo plan here.")
    result = answer(client, "plato")
    assert result.fallback and "fallback" in result.fallback
    assert result.text == "a plain answer" and client.log[-1] == "ar"


def test_a_plan_whose_decoding_fails_partway_falls_back_to_plain_decoding_and_stops_its_nodes():
    class FailingPlan(ScriptedClient):
        async def stream(self, request):
            async for item in super().stream(request):
                if isinstance(item, Result):  # the plan's request faulted before it finished
                    raise RuntimeError("RequestFaulted: the plan grammar broke")
                yield item

        async def generate(self, request):
            self.log.append("call")
            return await super().generate(request)

    client = FailingPlan(DIAMOND, node_delay=0.5)
    result = answer(client, "plato")
    assert result.mode == "plato" and result.text == "a plain answer"
    assert result.fallback.startswith("fallback to plain decoding: the plan failed to decode (RuntimeError")
    # node 1 had started while the plan streamed, and was stopped: the plain answer's call is the only other
    assert client.log == ["plan:start", "call", "plan:end", "call", "ar"]


def test_a_failing_node_marks_itself_and_its_dependants_but_others_finish():
    client = ScriptedClient(DIAMOND, fail_on="Use A for B")
    result = answer(client, "plato")
    status = {n.id: n.status.value for n in result.nodes}
    assert status == {1: "done", 2: "failed", 3: "done", 4: "failed"}
    assert "[not answered:" in result.text and "answer to Use A for C" in result.text


def test_deadline_returns_what_is_done_instead_of_hanging():
    client = ScriptedClient(DIAMOND, line_delay=0.0, node_delay=0.3)
    result = answer(client, "plato", deadline_s=0.45)
    status = [n.status.value for n in result.nodes]
    assert "failed" in status and result.latency_s < 2


def test_sot_expands_every_point_independently():
    client = ScriptedClient(DIAMOND)
    result = answer(client, "sot")
    assert client.log == ["skeleton", "point:1", "point:2", "point:3"]
    assert result.plan is not None and all(not n.depends_on for n in result.plan.nodes)
    assert "point 3 text" in result.text
    # the baseline prefills every point prompt whole, though they share all but the point's number
    assert result.prefix_hit_tokens == 0 and result.node_prompt_shareable_tokens > 0


def test_an_outline_of_one_point_falls_back_to_plain_decoding_and_says_sot():
    client = ScriptedClient(DIAMOND)
    original = client.generate

    async def one_point(request):
        if "short numbered list" in client._text(request.prompt_ids):
            return client._result(request, "1. Alpha")
        return await original(request)

    client.generate = one_point
    result = answer(client, "sot")
    assert result.mode == "sot" and result.fallback == "the outline had fewer than two points"
    assert result.text == "a plain answer"


def test_ar_is_one_plain_generation():
    client = ScriptedClient(DIAMOND)
    result = answer(client, "ar")
    assert client.log == ["ar"] and result.text == "a plain answer" and result.plan is None


@pytest.mark.parametrize("mode", ["ar", "sot", "plato"])
def test_every_mode_finishes_on_the_tiny_real_engine(make_engine, mode):
    engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=512))
    client = EngineClient(engine)
    config = AnswerConfig(max_tokens=12, plan_max_tokens=24, node_max_tokens=8)
    try:
        result = asyncio.run(asyncio.wait_for(Orchestrator(client, config).answer("baba babe", mode), 60))
    finally:
        engine.shutdown()
    assert result.completion_tokens > 0 and result.latency_s > 0
    assert result.mode in ("ar", "sot", "plato")


def test_auto_routes_code_to_plain_decoding_and_advice_to_planning():
    client = ScriptedClient(DIAMOND)
    orchestrator = Orchestrator(client, AnswerConfig())
    code = asyncio.run(orchestrator.answer("Implement a binary search in Python.", "auto"))
    advice = asyncio.run(orchestrator.answer("How can I sleep better and feel rested?", "auto"))
    assert (code.mode, code.routed) == ("ar", "code")
    assert (advice.mode, advice.routed) == ("plato", "several separable parts")


def test_planning_prompts_share_their_instructions_as_a_cached_prefix(make_engine):
    """The plan and skeleton prompts mark everything but the question as their shared prefix: the
    same tokens for any question, so a second plan starts from the first one's cached KV."""
    from engine.types import SamplingParams
    from graph.orchestrator import fixed_prefix_request
    from graph.prompts import plan_messages, sot_skeleton_messages

    engine = AsyncEngine(make_engine(max_batch_size=2, max_model_len=1024))
    client = EngineClient(engine)
    params = SamplingParams(max_tokens=2)

    async def main():
        out = []
        for build in (plan_messages, sot_skeleton_messages):
            first = await fixed_prefix_request(client, build("baba babe?"), params)
            second = await fixed_prefix_request(client, build("a different question entirely"), params)
            results = [await client.generate(first), await client.generate(second)]
            out.append((first, second, results))
        return out

    try:
        runs = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    for first, second, (one, two) in runs:
        n = first.shared_prefix_len
        assert 0 < n < len(first.prompt_ids) and second.shared_prefix_len == n
        assert first.prompt_ids[:n] == second.prompt_ids[:n] and first.prompt_ids[n:] != second.prompt_ids[n:]
        assert two.prefix_hit_tokens >= n


class BudgetRecordingClient(ScriptedClient):
    """Also records the max_tokens of every node and outline point request."""

    def __init__(self, plan_text: str):
        super().__init__(plan_text)
        self.node_budgets: list[int] = []

    async def generate(self, request: GenerationRequest) -> Result:
        prompt = self._text(request.prompt_ids)
        if "in two or three sentences: " in prompt or "Write only point" in prompt:
            self.node_budgets.append(request.params.max_tokens)
        return await super().generate(request)


@pytest.mark.parametrize("mode", ["plato", "sot"])
@pytest.mark.parametrize(("max_tokens", "node_max_tokens", "each"), [(192, 192, 48), (192, 32, 32), (2, 96, 1)])
def test_nodes_and_points_share_the_answer_budget(mode, max_tokens, node_max_tokens, each):
    client = BudgetRecordingClient(DIAMOND)
    config = AnswerConfig(max_tokens=max_tokens, node_max_tokens=node_max_tokens, nodes_per_budget=4,
                          node_budget_stagger=0)
    result = asyncio.run(Orchestrator(client, config).answer("How do I paint a room?", mode))
    parts = 4 if mode == "plato" else 3  # the diamond plan; the scripted outline has three points
    assert result.mode == mode and client.node_budgets == [each] * parts


SIX_FLAT = "\n".join(f"{i}. Find {c} [needs: none]" for i, c in enumerate("ABCDEF", start=1))


@pytest.mark.parametrize(("plan", "stagger", "budgets"), [
    (SIX_FLAT, 12, [66, 54, 42, 30, 30, 30]),  # the first four add up to the budget; later ones start last
    (DIAMOND, 12, [66, 30, 30, 30]),  # nodes with parents start once a parent is answered: last
    (SIX_FLAT, 40, [108, 68, 28, 16, 16, 16]),  # never below a third of the equal share (16 of 48)
    (SIX_FLAT, 0, [48] * 6),
])
def test_with_pipelining_nodes_that_start_earlier_take_more_of_the_budget(plan, stagger, budgets):
    client = BudgetRecordingClient(plan)
    answer(client, "plato", max_tokens=192, node_max_tokens=192, node_budget_stagger=stagger)
    assert client.node_budgets == budgets


def test_without_pipelining_or_in_an_outline_every_part_takes_an_equal_share():
    for mode, pipelining in (("plato", False), ("sot", True)):
        client = BudgetRecordingClient(SIX_FLAT)
        answer(client, mode, max_tokens=192, node_max_tokens=192, node_budget_stagger=12, pipelining=pipelining)
        assert client.node_budgets == [48] * (6 if mode == "plato" else 3)


def test_plan_nodes_wrap_up_at_a_sentence_end_and_outline_points_do_not():
    class Recording(ScriptedClient):
        async def generate(self, request):
            prompt = self._text(request.prompt_ids)
            if "in two or three sentences: " in prompt or "Write only point" in prompt:
                asked.append(request.params.wrap_up_tokens)
            return await super().generate(request)

    for mode, wrap_up, expected in (("plato", 16, 16), ("plato", None, None), ("sot", 16, None)):
        asked = []
        answer(Recording(DIAMOND), mode, node_wrap_up_tokens=wrap_up)
        assert len(asked) in (3, 4) and set(asked) == {expected}


def test_a_staggered_share_stays_within_node_max_tokens():
    client = BudgetRecordingClient(SIX_FLAT)
    answer(client, "plato", max_tokens=192, node_max_tokens=50, node_budget_stagger=12)
    assert client.node_budgets == [50, 50, 42, 30, 30, 30]


def test_while_the_plan_streams_nodes_share_the_plan_so_far_up_to_its_last_line():
    """A node started mid-plan marks as shared what every later node prompt starts with: the
    instructions, the question and the plan text seen so far, not the plan message's closing;
    once the plan is complete, nodes share the whole plan message."""
    flat = "1. Find A [needs: none]\n2. Find B [needs: none]\n3. Find C [needs: none]"
    client = ScriptedClient(flat, line_delay=0.05)
    answer(client, "plato")
    texts = [ScriptedClient._text(p) for p in client.prefixes]
    node_1 = texts[0]
    assert node_1.endswith("Plan:\n1. Find A") and "2. Find B" not in node_1
    assert texts[1].endswith("Plan:\n1. Find A\n2. Find B")
    assert all(later.startswith(node_1) for later in texts)
    complete = ScriptedClient(flat)
    answer(complete, "plato", pipelining=False)
    assert all(ScriptedClient._text(p).endswith("Plan:\n1. Find A\n2. Find B\n3. Find C</>") for p in complete.prefixes)


def test_a_node_with_parents_continues_its_lead_parents_conversation():
    """Node 2 of the diamond follows up on node 1's prompt and answer and marks all of them as shared
    (the KV node 1 kept); node 4 continues the longer of its parents' conversations (3: equal length,
    the later wins) and gets the other parent's answer in its own message. Nodes with children keep
    their KV; with the plan complete, the last node, which has none, does not."""
    client = ScriptedClient(DIAMOND)
    result = answer(client, "plato", pipelining=False)
    by_step = {ScriptedClient._text(r.prompt_ids).rsplit("Answer part ", 1)[1][0]: r for r in client.requests}
    text = {step: ScriptedClient._text(r.prompt_ids) for step, r in by_step.items()}
    one = text["1"] + "answer to Find A"
    assert text["2"].startswith(one + "</><user>Answer part 2") and by_step["2"].shared_prefix_len == len(one)
    three = text["3"] + "answer to Use A for C"
    assert text["4"].startswith(three + "</><user>Earlier parts, already answered:\nPart 2 (Use A for B): answer to Use A for B")
    assert "Part 3 (" not in text["4"] and by_step["4"].shared_prefix_len == len(three)
    assert [by_step[s].keep_kv for s in "1234"] == [True, True, True, False]
    assert result.prefix_hit_tokens == sum(r.shared_prefix_len for r in client.requests)
    # what earlier nodes had computed: node 1's prompt and answer (for 2), node 2's prompt up to its
    # part number (for 3: a cache could serve it, though none was kept), node 3's prompt and answer (for 4);
    # for node 1, the preamble every question's node prompts open with
    preamble = f"<system>{NODE_SYSTEM}</>"
    assert result.node_prompt_shareable_tokens == len(preamble) + 2 * len(one) + len("</><user>Answer part ") + len(three)


def test_without_kv_reuse_the_prompts_are_the_same_but_nothing_is_shared_or_kept():
    reusing, plain = ScriptedClient(DIAMOND), ScriptedClient(DIAMOND)
    answer(reusing, "plato", pipelining=False)
    result = answer(plain, "plato", pipelining=False, kv_reuse=False)
    assert [r.prompt_ids for r in plain.requests] == [r.prompt_ids for r in reusing.requests]
    assert not any(r.keep_kv or r.shared_prefix_len or r.preamble_len for r in plain.requests)
    assert result.node_prompt_shareable_tokens > 0 and result.prefix_hit_tokens == 0


def test_every_node_request_names_the_preamble_that_node_prompts_of_every_question_open_with():
    from graph.prompts import node_preamble

    client = ScriptedClient(DIAMOND)
    result = answer(client, "plato")
    preamble = asyncio.run(client.encode_chat(node_preamble(), add_generation_prompt=False))
    assert len(client.requests) == 4
    for request in client.requests:
        assert request.preamble_len == len(preamble) and request.prompt_ids[: len(preamble)] == preamble
        assert request.shared_prefix_len > request.preamble_len
    # the first node shares nothing with an earlier node of its answer, but its preamble is there to reuse
    first = client.requests[0]
    shared_by_others = sum(r.shared_prefix_len for r in client.requests[1:])
    assert result.node_prompt_shareable_tokens >= len(preamble) + shared_by_others > first.shared_prefix_len


def test_the_first_node_of_a_later_question_starts_after_the_cached_preamble(make_engine):
    """On the tiny real engine, with a given plan (the tiny model cannot plan): two questions one after
    the other. The first node of the first question finds nothing cached; the first node of the
    second finds the preamble the first question's nodes left in the engine's cache."""
    from graph.prompts import node_preamble

    plan = "1. Find A [needs: none]\n2. Find B [needs: none]\n\n"

    class GivenPlanClient(EngineClient):
        def __init__(self, engine):
            super().__init__(engine)
            self.runs: list[list] = []  # [request, result] of each node request, in the order sent

        async def _plan(self, request):
            yield TokenEvent(request_id=request.id, token_ids=[7], text=plan)
            yield Result(request_id=request.id, prompt_tokens=len(request.prompt_ids), token_ids=[7], text=plan,
                         finish_reason=FinishReason.STOP, ttft_s=0.0, latency_s=0.0)

        def stream(self, request):
            return self._plan(request)

        async def generate(self, request):
            run = [request, None]
            self.runs.append(run)  # in the order sent (the engine admits them so), not the order they finish
            run[1] = await super().generate(request)
            return run[1]

    engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=512, cache_answers=False))  # marked reuse only
    client = GivenPlanClient(engine)
    config = AnswerConfig(max_tokens=16, node_max_tokens=4, plan_constraint=None)

    async def main():
        orchestrator = Orchestrator(client, config)
        answers = [await orchestrator.answer(q, "plato") for q in ("baba babe", "dada dade dadi")]
        return answers, await client.encode_chat(node_preamble(), add_generation_prompt=False)

    try:
        answers, preamble = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.shutdown()
    assert [a.mode for a in answers] == ["plato", "plato"] and len(client.runs) == 4
    assert all(r.preamble_len == len(preamble) for r, _ in client.runs)
    hits = [result.prefix_hit_tokens for _, result in client.runs]
    first, later = client.runs[0][0], client.runs[2][0]
    assert later.prompt_ids[: len(preamble)] == first.prompt_ids[: len(preamble)]
    assert later.prompt_ids[: later.shared_prefix_len] != first.prompt_ids[: first.shared_prefix_len]
    assert hits[0] == 0 and hits[2] == len(preamble)
    assert hits[1] > len(preamble) and hits[3] > len(preamble)  # each question's own shared prefix


def test_a_parent_whose_answer_was_not_kept_still_leads_but_nothing_is_marked_shared():
    class ForgetfulClient(ScriptedClient):  # an engine whose cache had no room for the answers
        async def generate(self, request):
            result = await super().generate(request)
            result.kept_kv_tokens = 0
            return result

    client = ForgetfulClient(DIAMOND)
    result = answer(client, "plato", pipelining=False)
    assert result.mode == "plato" and all(n.status.value == "done" for n in result.nodes)
    assert [r.shared_prefix_len > 0 for r in client.requests] == [True, False, False, False]


def test_without_follow_up_prompts_every_node_quotes_its_parents_after_the_plan_prefix():
    client = ScriptedClient(DIAMOND)
    answer(client, "plato", pipelining=False, follow_up_prompts=False)
    texts = [ScriptedClient._text(r.prompt_ids) for r in client.requests]
    assert all(t.count("<user>") == 2 for t in texts)  # the question, then the node's own message
    four = next(t for t in texts if "Answer part 4" in t)
    assert "Part 2 (Use A for B): answer to Use A for B" in four and "Part 3 (Use A for C): answer to Use A for C" in four


def test_plan_nodes_may_not_copy_the_question_or_the_plan_so_far_but_outline_points_may():
    client = ScriptedClient(DIAMOND)
    asyncio.run(Orchestrator(client, AnswerConfig()).answer("Q?", "plato"))
    guards = [(r.params.no_copy, r.params.no_copy_tokens) for r in client.requests]
    lines = ["Find A", "Use A for B", "Use A for C", "Join B and C"]
    # node 1 starts as soon as its line is complete, so its guard holds the plan up to that line
    assert guards[0] == (["Q?", "Find A"], 2) and guards[-1] == (["Q?", *lines], 2)
    unguarded = ScriptedClient(DIAMOND)
    asyncio.run(Orchestrator(unguarded, AnswerConfig(plan_copy_tokens=None)).answer("Q?", "plato"))
    assert all(r.params.no_copy == [] for r in unguarded.requests)
    points = RecordingPointsClient(DIAMOND)
    asyncio.run(Orchestrator(points, AnswerConfig()).answer("Q?", "sot"))
    assert len(points.point_params) == 3 and all(p.no_copy == [] for p in points.point_params)


def test_plan_nodes_open_no_line_with_a_question_word_but_outline_points_may():
    client = ScriptedClient(DIAMOND)
    asyncio.run(Orchestrator(client, AnswerConfig()).answer("Q?", "plato"))
    nodes = [r for r in client.requests if r.params.no_copy]
    assert len(nodes) == 4 and all(r.params.no_openings == list(NODE_NO_OPENINGS) for r in nodes)
    assert "What" in NODE_NO_OPENINGS and "How" in NODE_NO_OPENINGS
    unguarded = ScriptedClient(DIAMOND)
    asyncio.run(Orchestrator(unguarded, AnswerConfig(node_no_openings=[])).answer("Q?", "plato"))
    assert all(r.params.no_openings == [] for r in unguarded.requests)
    points = RecordingPointsClient(DIAMOND)
    asyncio.run(Orchestrator(points, AnswerConfig()).answer("Q?", "sot"))
    assert len(points.point_params) == 3 and all(p.no_openings == [] for p in points.point_params)


class RecordingPointsClient(ScriptedClient):
    """Also records the params of every outline point request."""

    def __init__(self, plan_text: str):
        super().__init__(plan_text)
        self.point_params = []

    async def generate(self, request: GenerationRequest) -> Result:
        if "Write only point" in self._text(request.prompt_ids):
            self.point_params.append(request.params)
        return await super().generate(request)
