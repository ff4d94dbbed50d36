"""The batcher actor's push mode, without Ray: its own loop hands micro-batches to a (fake) decoder,
streams come back token by token across cut-off attempts and replica failures, with no token
lost or repeated; predictions are asked for and their failures tolerated."""
from __future__ import annotations

import asyncio
import contextvars

import pytest

from actors.batcher import BatcherActor, RequestFailed
from engine.types import GenerationRequest, SamplingParams

LENGTHS = {f"r{i}": 2 + 5 * i for i in range(6)}  # 2 to 27 tokens


class FakeDecoder:
    """Answers request r with tokens 0..LENGTHS[r]-1, honouring resume_ids and length_cap; can die
    after a few tokens of its first batch, or refuse a request."""

    def __init__(self, die_after: int | None = None, refuse: str | None = None):
        self.die_after, self.refuse, self.batches = die_after, refuse, []

    async def __call__(self, batch: dict):
        self.batches.append(batch)
        first_call, sent = len(self.batches) == 1, 0
        for request in batch["requests"]:
            rid = request["id"]
            if rid == self.refuse:
                yield {"error": {"request_id": rid, "message": "ValueError: prompt_ids: too long"}}
                continue
            start, total = len(request["resume_ids"]), LENGTHS[rid]
            cap = request["params"]["length_cap"] or total
            end = min(total, cap)
            for token in range(start, end):
                if first_call and sent == self.die_after:
                    raise ConnectionError("replica died")
                sent += 1
                await asyncio.sleep(0)
                yield {"event": {"request_id": rid, "token_ids": [token], "text": f"<{token}>"}}
            reason = "cut" if end < total else "stop"
            yield {"result": {"request_id": rid, "prompt_tokens": 2, "token_ids": list(range(end)),
                              "text": "", "finish_reason": reason, "ttft_s": 0.0, "latency_s": 0.0}}


def request(rid: str, predicted: int | None = 3) -> dict:
    return GenerationRequest(id=rid, prompt_ids=[5, 6], params=SamplingParams(max_tokens=64),
                             predicted_len=predicted).model_dump()


async def collect(actor: BatcherActor, rid: str) -> tuple[list[int], dict]:
    tokens, result = [], None
    async for item in actor.stream(request(rid)):
        if "event" in item:
            tokens.extend(item["event"]["token_ids"])
        else:
            result = item["result"]
    return tokens, result


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


@pytest.mark.parametrize("die_after", [None, 7])
def test_streams_are_complete_and_never_repeat_across_cuts_and_a_dead_replica(die_after):
    async def main():
        decoder = FakeDecoder(die_after=die_after)
        actor = BatcherActor({"bins": {"edges": [4, 8, 16]}, "token_budget": 40}, send_batch=decoder)
        outs = await asyncio.gather(*(collect(actor, rid) for rid in LENGTHS))
        plain = await actor.submit(request("plain"))  # not streamed: the same path, the final result only
        return outs, plain, await actor.stats()

    LENGTHS["plain"] = 9
    outs, plain, stats = run(main())
    for (tokens, result), (rid, n) in zip(outs, LENGTHS.items()):
        assert tokens == list(range(n)), rid  # every token once, in order
        assert result["token_ids"] == list(range(n)) and result["finish_reason"] == "stop"
    assert plain["token_ids"] == list(range(9))
    assert stats["requeues"] > 0 and stats["pending"] == stats["in_flight"] == 0
    assert stats["failed_batches"] == (1 if die_after else 0)
    # with a dead replica, tokens == range(n) above means the retry resumed after what had been
    # streamed: starting over would have streamed those tokens twice


def test_a_request_the_decoder_refuses_fails_with_its_reason_and_others_are_answered():
    async def main():
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=FakeDecoder(refuse="r1"))
        ok = asyncio.create_task(actor.submit(request("r0")))
        with pytest.raises(RequestFailed, match="too long"):
            await actor.submit(request("r1"))
        return await ok, await actor.stats()

    ok, stats = run(main())
    assert ok["token_ids"] == list(range(2)) and stats["refused"] == 1


def test_a_request_that_kills_every_replica_is_answered_with_an_error_and_its_batch_mates_are_answered():
    class PoisonedFleet(FakeDecoder):
        async def __call__(self, batch):
            if any(r["id"] == "poison" for r in batch["requests"]):
                self.batches.append(batch)
                raise ConnectionError("the replica died")
            async for item in super().__call__(batch):
                yield item

    class Observer:  # what the metrics hear: failed micro-batches, errors
        heard: dict = {}

        def __getattr__(self, name):
            return lambda *args: self.heard.__setitem__(name, self.heard.get(name, 0) + 1)

    observer = Observer()

    async def main():
        fleet = PoisonedFleet()
        actor = BatcherActor({"bins": {"edges": [64]}, "max_failed_attempts": 3}, send_batch=fleet, observer=observer)
        mates = [asyncio.create_task(actor.submit(request(rid))) for rid in ("r0", "r1")]
        poison = asyncio.create_task(actor.submit(request("poison")))
        with pytest.raises(RequestFailed, match="failed 3 times"):
            await poison
        return [await m for m in mates], fleet, await actor.stats()

    LENGTHS["poison"] = 5
    (r0, r1), fleet, stats = run(main())
    assert r0["token_ids"] == list(range(2)) and r1["token_ids"] == list(range(7))
    assert stats["failed_out"] == 1 and stats["refused"] == 1 and stats["pending"] == stats["in_flight"] == 0
    poisoned = [[r["id"] for r in b["requests"]] for b in fleet.batches if any(r["id"] == "poison" for r in b["requests"])]
    assert len(poisoned) == 3 and poisoned[1:] == [["poison"], ["poison"]]  # retried alone
    assert observer.heard["failed_batch"] == 3 and observer.heard["error"] == 1


SERVING = contextvars.ContextVar("serving", default=None)  # as Serve keeps the request being served


def test_micro_batches_are_sent_outside_the_context_of_the_request_that_started_dispatch():
    """Serve names a handle call after the request in the caller's context: micro-batches that
    carried the first request's would all share its id, which Serve's router matches calls by."""
    seen = []

    async def send_batch(batch: dict):
        seen.append(SERVING.get())
        async for item in FakeDecoder()(batch):
            yield item

    async def submit(actor: BatcherActor, rid: str) -> dict:
        SERVING.set(rid)
        return await actor.submit(request(rid))

    async def main():
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=send_batch)
        return await submit(actor, "r0"), await submit(actor, "r1")

    first, second = run(main())
    assert first["token_ids"] == [0, 1] and second["token_ids"] == list(range(7))
    assert seen == [None, None]


def test_predictions_are_asked_for_and_a_failing_predictor_means_the_default_bin():
    asked = []

    async def predict(prompt_ids, share):
        asked.append(prompt_ids)
        if len(asked) == 2:
            raise RuntimeError("predictor down")
        return 5

    async def main():
        actor = BatcherActor({"bins": {"edges": [8, 64]}}, send_batch=FakeDecoder(), predict=predict)
        await actor.submit(request("r0", predicted=None))
        await actor.submit(request("r1", predicted=None))
        await actor.submit(request("r2", predicted=7))  # already predicted: not asked again
        return await actor.stats()

    stats = run(main())
    assert len(asked) == 2 and stats["predictions"] == 1 and stats["prediction_failures"] == 1
    assert stats["default_bin_uses"] == 1


def test_a_request_whose_answer_fits_the_lowest_bin_is_not_predicted_and_a_scored_prompt_shares_no_kv():
    asked = []

    async def predict(prompt_ids, share):
        asked.append(share)
        return 5

    def ask(rid: str, max_tokens: int, **params) -> dict:
        return GenerationRequest(id=rid, prompt_ids=[5, 6], params=SamplingParams(max_tokens=max_tokens, **params)
                                 ).model_dump()

    async def main():
        actor = BatcherActor({"bins": {"edges": [8, 64]}}, send_batch=FakeDecoder(), predict=predict)
        await actor.submit(ask("r0", 8))  # at most 8 tokens: the lowest bin whatever the prediction
        await actor.submit(ask("r1", 16))
        await actor.submit(ask("r2", 16, prompt_logprobs=1))  # its prompt is computed whole: no KV to share
        return await actor.stats()

    stats = run(main())
    assert asked == [True, False]
    assert stats["predictions_skipped"] == 1 and stats["predictions"] == 2 and stats["default_bin_uses"] == 0


def test_the_observer_hears_of_batches_queues_lengths_and_requeues():
    class Recorder:
        def __init__(self):
            self.batches, self.depths, self.lengths, self.requeues = [], [], [], 0

        def batch(self, size, tokens):
            self.batches.append((size, tokens))

        def queues(self, depths):
            self.depths.append(list(depths))

        def finished(self, predicted, actual):
            self.lengths.append((predicted, actual))

        def requeue(self):
            self.requeues += 1

    recorder = Recorder()

    async def main():
        actor = BatcherActor({"bins": {"edges": [4, 64]}}, send_batch=FakeDecoder(), observer=recorder)
        await asyncio.gather(*(actor.submit(request(rid)) for rid in ("r0", "r1")))

    run(main())
    assert sorted(recorder.lengths) == [(3, 2), (3, 7)]  # r0 is 2 tokens long, r1 7: predicted 3 for both
    assert recorder.requeues == 1  # r1 overran the 4-token bin once
    assert sum(size for size, _ in recorder.batches) == 3 and all(len(d) == 2 for d in recorder.depths)


class GatedDecoder:
    """Holds every micro-batch open until `release` is set, recording the requests out at once."""

    def __init__(self):
        self.release, self.out, self.most_out, self.sizes = asyncio.Event(), 0, 0, []

    async def __call__(self, batch: dict):
        self.sizes.append(len(batch["requests"]))
        self.out += len(batch["requests"])
        self.most_out = max(self.most_out, self.out)
        await self.release.wait()
        for r in batch["requests"]:
            yield {"result": {"request_id": r["id"], "prompt_tokens": 2, "token_ids": [1], "text": "",
                              "finish_reason": "stop", "ttft_s": 0.0, "latency_s": 0.0}}
        self.out -= len(batch["requests"])


@pytest.mark.parametrize("limits, first_sizes", [
    ({"max_requests_in_flight": 4, "max_batches_in_flight": 16}, [1, 3]),  # slots, not batches, run out
    ({"max_requests_in_flight": 32, "max_batches_in_flight": 2}, [1, 9]),  # batches run out first
])
def test_dispatch_fills_the_decoders_free_slots_then_holds_the_rest_in_the_bins(limits, first_sizes):
    """A lone first request goes at once; what arrives while it runs joins the decoders in the next
    micro-batch, up to the free slots; the rest waits for room, and every request is answered."""
    async def main():
        decoder = GatedDecoder()
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=decoder, dispatch=limits)
        first = asyncio.create_task(actor.submit(request("a")))
        while not decoder.sizes:
            await asyncio.sleep(0)
        rest = [asyncio.create_task(actor.submit(request(f"b{i}"))) for i in range(9)]
        for _ in range(50):
            await asyncio.sleep(0)
        held = (list(decoder.sizes), (await actor.stats())["pending"])
        decoder.release.set()
        answers = await asyncio.gather(first, *rest)
        return held, decoder.most_out, answers

    (sizes, pending), most_out, answers = run(main())
    assert sizes == first_sizes and pending == 10 - sum(first_sizes)
    assert most_out <= limits["max_requests_in_flight"]
    assert len(answers) == 10 and all(a["token_ids"] == [1] for a in answers)


def test_what_a_dying_replica_finished_is_final_and_only_the_rest_runs_again():
    """r0 (2 tokens) finishes, then the replica dies 2 tokens into r1: r0 is answered as it was (not
    re-run after its end, which a real engine would decode past its stop), r1 resumes after [0, 1]."""
    async def main():
        decoder = FakeDecoder(die_after=4)
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=decoder)
        outs = await asyncio.gather(collect(actor, "r0"), collect(actor, "r1"))
        return decoder.batches, outs, await actor.stats()

    batches, outs, stats = run(main())
    assert [r["id"] for r in batches[0]["requests"]] == ["r0", "r1"]
    assert [(r["id"], r["resume_ids"]) for b in batches[1:] for r in b["requests"]] == [("r1", [0, 1])]
    assert outs[0][0] == [0, 1] and outs[1][0] == list(range(7))
    assert stats["failed_batches"] == 1 and stats["finished"] == 2 and stats["pending"] == stats["in_flight"] == 0


class StaggeredDecoder:
    """Answers every request of a batch at once, except `held`, which waits for `release`."""

    def __init__(self, held: str):
        self.held, self.release, self.batches = held, asyncio.Event(), []

    async def __call__(self, batch: dict):
        self.batches.append([r["id"] for r in batch["requests"]])
        for r in sorted(batch["requests"], key=lambda r: r["id"] == self.held):
            if r["id"] == self.held:
                await self.release.wait()
            yield {"result": {"request_id": r["id"], "prompt_tokens": 2, "token_ids": [1], "text": "",
                              "finish_reason": "stop", "ttft_s": 0.0, "latency_s": 0.0}}


def test_a_finished_request_frees_its_slot_while_its_batch_mates_still_run():
    """Two slots, a batch of a and b: once a is answered, c is dispatched and answered while b still
    runs (a decoder batching continuously has room for it), instead of waiting for the whole batch."""
    async def main():
        decoder = StaggeredDecoder(held="b")
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=decoder, dispatch={"max_requests_in_flight": 2})
        a, b = (asyncio.create_task(actor.submit(request(rid))) for rid in ("a", "b"))
        await a
        await actor.submit(request("c"))
        batches_while_b_runs = list(decoder.batches)
        decoder.release.set()
        await b
        return batches_while_b_runs

    assert run(main()) == [["a", "b"], ["c"]]


class SlowDecoder:
    """One token every 10 ms for request "s", 20 tokens, like engine steps."""

    async def __call__(self, batch: dict):
        for token in range(20):
            await asyncio.sleep(0.01)
            yield [{"event": {"request_id": "s", "token_ids": [token], "text": f"<{token}>"}}]
        yield [{"result": {"request_id": "s", "prompt_tokens": 2, "token_ids": list(range(20)), "text": "",
                           "finish_reason": "stop", "ttft_s": 0.0, "latency_s": 0.0}}]


@pytest.mark.parametrize("interval", [0.0, 0.05])
def test_streamed_tokens_after_the_first_are_gathered_per_interval(interval):
    async def main():
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=SlowDecoder(),
                             dispatch={"stream_interval_s": interval})
        return [item async for item in actor.stream(request("s"))]

    items = run(main())
    events = [i["event"] for i in items if "event" in i]
    assert [t for e in events for t in e["token_ids"]] == list(range(20))
    assert "".join(e["text"] for e in events) == "".join(f"<{t}>" for t in range(20))
    assert events[0]["token_ids"] == [0] and "result" in items[-1]
    if interval:
        assert len(events) <= 10  # about five engine steps per message
    else:
        assert len(events) == 20


class BatchStepDecoder:
    """Every request of the batch gets a token each 10 ms step, 20 steps, like a running engine batch."""

    async def __call__(self, batch: dict):
        ids = [r["id"] for r in batch["requests"]]
        for token in range(20):
            await asyncio.sleep(0.01)
            yield [{"event": {"request_id": rid, "token_ids": [token], "text": f"<{token}>"}} for rid in ids]
        yield [{"result": {"request_id": rid, "prompt_tokens": 2, "token_ids": list(range(20)), "text": "",
                           "finish_reason": "stop", "ttft_s": 0.0, "latency_s": 0.0}} for rid in ids]


@pytest.mark.parametrize("cap", [None, 40.0])
def test_a_message_cap_stretches_each_streams_interval_by_how_many_stream(cap):
    async def main(ids):
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=BatchStepDecoder(),
                             dispatch={"stream_interval_s": 0.0, "max_stream_messages_per_s": cap})

        async def one(rid):
            return [item async for item in actor.stream(request(rid))]

        return await asyncio.gather(*(one(rid) for rid in ids))

    streams = run(main(["a", "b", "c", "d"]))
    events = [[i["event"] for i in items if "event" in i] for items in streams]
    for per_stream in events:  # gathered or not, every token arrives once, in order
        assert [t for e in per_stream for t in e["token_ids"]] == list(range(20))
        assert per_stream[0]["token_ids"] == [0]
    counts = [len(e) for e in events]
    if cap is None:
        assert counts == [20] * 4
    else:  # four streaming at 40 messages/s: a message per stream each 0.1 s over 0.2 s of tokens
        assert all(n <= 8 for n in counts), counts


def test_events_gathered_into_one_message_keep_the_prompts_scores_of_the_first():
    from actors.batcher import _merged

    score = {"token_id": 7, "token": "x", "logprob": -1.5, "top": []}
    events = [{"request_id": "s", "token_ids": [1], "text": "a", "prompt_logprobs": [score]},
              {"request_id": "s", "token_ids": [2], "text": "b", "prompt_logprobs": None}]
    merged = _merged(events)
    assert merged["token_ids"] == [1, 2] and merged["text"] == "ab" and merged["prompt_logprobs"] == [score]
    assert _merged(events[1:] * 2)["prompt_logprobs"] is None


class HoldingDecoder:
    """Streams nothing until `release` is set; records each request id it was handed, in order."""

    def __init__(self):
        self.handed, self.release = [], asyncio.Event()

    async def __call__(self, batch: dict):
        self.handed.extend(r["id"] for r in batch["requests"])
        await self.release.wait()
        for r in batch["requests"]:
            yield {"result": {"request_id": r["id"], "prompt_tokens": 2, "token_ids": [1], "text": "",
                              "finish_reason": "stop", "ttft_s": 0.0, "latency_s": 0.0}}


@pytest.mark.parametrize("preempt", [True, False])
def test_with_every_slot_taken_a_higher_priority_still_goes_to_the_decoders(preempt):
    def at(rid: str, priority: int) -> dict:
        return GenerationRequest(id=rid, prompt_ids=[5, 6], params=SamplingParams(max_tokens=64), predicted_len=3,
                                 priority=priority).model_dump()

    async def main():
        decoder = HoldingDecoder()
        actor = BatcherActor({"bins": {"edges": [4, 64]}}, send_batch=decoder,
                             dispatch={"max_requests_in_flight": 2, "preempt": preempt})
        asks = [asyncio.create_task(actor.submit(at(f"job{i}", -1))) for i in range(3)]
        await asyncio.sleep(0.2)
        handed_first = list(decoder.handed)
        asks.append(asyncio.create_task(actor.submit(at("chat", 0))))
        await asyncio.sleep(0.2)
        handed_then = list(decoder.handed)
        decoder.release.set()
        await asyncio.gather(*asks)
        return handed_first, handed_then, decoder.handed

    first, then, everything = run(main())
    assert first == ["job0", "job1"]  # two slots
    # the decoder's engine preempts a job answer for the chat; without, the chat waits for a slot
    assert then == (["job0", "job1", "chat"] if preempt else ["job0", "job1"])
    assert sorted(everything) == ["chat", "job0", "job1", "job2"]  # all answered, none twice


def test_a_queued_request_whose_caller_goes_away_is_never_handed_to_a_decoder():
    class CancelCounter:
        cancelled = 0
        batch = queues = finished = requeue = lambda *args: None

        def cancel(self):
            self.cancelled += 1

    counter = CancelCounter()

    async def main():
        decoder = HoldingDecoder()
        actor = BatcherActor({"bins": {"edges": [4, 64]}}, send_batch=decoder, dispatch={"max_requests_in_flight": 1},
                             observer=counter)
        first = asyncio.create_task(actor.submit(request("first")))
        gone = asyncio.create_task(actor.submit(request("gone")))
        await asyncio.sleep(0.2)
        gone.cancel()  # Serve cancels the call when the client disconnects
        await asyncio.sleep(0.1)
        queued = (await actor.stats())["pending"]
        decoder.release.set()
        await first
        return decoder.handed, queued, await actor.stats()

    handed, queued, stats = run(main())
    assert handed == ["first"] and queued == 0
    assert stats["cancelled"] == counter.cancelled == 1 and stats["pending"] == stats["in_flight"] == 0


class ServeLikeStream:
    """A decoder call as Serve hands it back: an async iterator with `cancel()`, which cancelling
    the task reading it does not call. Streams a token of each request every 10 ms until its
    `length` tokens are out (forever for a request not in `lengths`)."""

    def __init__(self, batch: dict, lengths: dict[str, int], log: dict):
        self.batch, self.lengths, self.log = batch, lengths, log
        self.items = self._items()

    async def _items(self):
        ids = [r["id"] for r in self.batch["requests"]]
        for step in range(10_000):
            await asyncio.sleep(0.01)
            for rid in list(ids):
                self.log.setdefault("steps", {})[rid] = step
                if rid in self.log.get("aborted", ()):
                    ids.remove(rid)
                    yield {"error": {"request_id": rid, "message": "aborted: its caller went away"}}
                elif step == self.lengths.get(rid, 10_000):
                    ids.remove(rid)
                    yield {"result": {"request_id": rid, "prompt_tokens": 2, "token_ids": [1] * step, "text": "",
                                      "finish_reason": "stop", "ttft_s": 0.0, "latency_s": 0.0}}
                else:
                    yield {"event": {"request_id": rid, "token_ids": [1], "text": "x"}}
            if not ids:
                return

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self) -> None:
        self.log.setdefault("cancelled", []).append([r["id"] for r in self.batch["requests"]])


async def read_some(actor: BatcherActor, rid: str, events: int) -> None:
    """Read a stream's first events, then stay, as a client that never reads on."""
    seen = 0
    async for _ in actor.stream(request(rid)):
        seen += 1
        if seen == events:
            await asyncio.Event().wait()


def test_a_micro_batch_whose_every_caller_went_away_is_cancelled_on_the_decoder():
    async def main():
        log: dict = {}
        actor = BatcherActor({"bins": {"edges": [4, 64]}}, send_batch=lambda batch: ServeLikeStream(batch, {}, log))
        reader = asyncio.create_task(read_some(actor, "endless", 2))
        await asyncio.sleep(0.2)
        reader.cancel()
        await asyncio.sleep(0.1)
        return log, await actor.stats(), actor._out_batches, actor._out_tasks, actor._progress

    log, stats, out_batches, out_tasks, progress = run(main())
    assert log["cancelled"] == [["endless"]]
    assert stats["cancelled"] == 1 and stats["pending"] == stats["in_flight"] == 0
    assert out_batches == 0 and out_tasks == {} and progress == {}


@pytest.mark.parametrize("abort_on_decoder", [True, False])
def test_a_request_whose_caller_went_away_leaves_its_batch_mates_to_finish(abort_on_decoder):
    """With the decoder reachable for aborts (the Serve app), the request is aborted there at once;
    without, it decodes on, unread, to its end."""
    async def abort(call: dict) -> int:
        log.setdefault("abort_calls", []).append(call)
        log.setdefault("aborted", set()).update(call["abort"])
        return len(call["abort"])

    log: dict = {}

    async def main():
        actor = BatcherActor({"bins": {"edges": [4, 64]}, "token_budget": 64},
                             send_batch=lambda batch: ServeLikeStream(batch, {"stays": 20, "goes": 30}, log),
                             abort_on_decoder=abort if abort_on_decoder else None)
        reader = asyncio.create_task(read_some(actor, "goes", 2))
        stays = asyncio.create_task(collect(actor, "stays"))  # both queued before the first micro-batch forms
        await asyncio.sleep(0.05)
        reader.cancel()
        tokens, result = await stays
        await asyncio.sleep(0.2)  # the batch runs on for the request nobody reads, then ends
        return log, tokens, result, await actor.stats(), actor._progress

    log, tokens, result, stats, progress = run(main())
    assert "cancelled" not in log and len(tokens) == 20 and result["finish_reason"] == "stop"
    if abort_on_decoder:
        assert [call["abort"] for call in log["abort_calls"]] == [["goes"]] and log["steps"]["goes"] < 15
        assert stats["decoder_aborts"] == 1
    else:
        assert "abort_calls" not in log and log["steps"]["goes"] == 30  # decoded on to its end
    assert stats["cancelled"] == 1 and stats["finished"] == 1 and stats["pending"] == stats["in_flight"] == 0
    assert progress == {}


@pytest.mark.parametrize("split, max_batches, kept_apart", [(True, 32, True), (False, 32, False), (True, 2, False)])
def test_the_push_loop_sends_prompts_of_different_holders_in_different_micro_batches(split, max_batches, kept_apart):
    """With split_by_holder, requests queued together whose prompts two replicas hold leave as two
    micro-batches (each then routed to its holder); without it, as one; and as one when only one more
    micro-batch may go out, since the held-back one would wait for a micro-batch to end."""
    class Observer:  # what the metrics hear: requests held back for their holder
        held_apart = 0

        def split(self, requests):
            self.held_apart += requests

        def __getattr__(self, name):  # batches, queues, lengths: not looked at here
            return lambda *args: None

    observer = Observer()

    async def main():
        decoder = GatedDecoder()
        holder = {5: "a", 6: "b", 7: "a"}
        dispatch = {"split_by_holder": split, "max_batches_in_flight": max_batches}
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=decoder, dispatch=dispatch,
                             holder_of=lambda prompt_ids: holder.get(prompt_ids[0]), observer=observer)
        first = asyncio.create_task(actor.submit(request("first")))  # prompt [5, 6]: held by "a"
        while not decoder.sizes:
            await asyncio.sleep(0)
        queued = []
        for rid, token in (("b1", 6), ("a1", 7), ("b2", 6)):
            queued.append(asyncio.create_task(actor.submit({**request(rid), "prompt_ids": [token, 1]})))
            await asyncio.sleep(0)
        for _ in range(50):
            await asyncio.sleep(0)
        decoder.release.set()
        answers = await asyncio.gather(first, *queued)
        return decoder.sizes, answers, await actor.stats()

    sizes, answers, stats = run(main())
    assert len(answers) == 4 and all(a["token_ids"] == [1] for a in answers)
    if kept_apart:
        assert sizes == [1, 2, 1] and stats["holder_splits"] >= 1 and observer.held_apart == stats["holder_splits"]
    else:
        assert sizes == [1, 3] and stats["holder_splits"] == observer.held_apart == 0


def test_requests_in_flight_follow_the_running_decoder_replicas():
    """With `requests_per_replica`, the decoders get that many a running replica (one replica's worth
    while their number is unknown, never past max_requests_in_flight); a replica added lets more out
    at once, with no request ending to make room."""
    async def main():
        replicas = {"n": None}
        decoder = HoldingDecoder()
        actor = BatcherActor({"bins": {"edges": [64]}}, send_batch=decoder,
                             dispatch={"requests_per_replica": 2, "max_requests_in_flight": 5},
                             decoder_replicas=lambda: replicas["n"])
        asks = [asyncio.create_task(actor.submit(request(f"r{i}"))) for i in range(8)]
        seen = []
        for n in (None, 1, 2, 4):
            replicas["n"] = n
            await asyncio.sleep(1.3)  # past the loop's recheck
            seen.append((len(decoder.handed), (await actor.stats())["request_limit"]))
        decoder.release.set()
        answers = await asyncio.gather(*asks)
        return seen, answers

    seen, answers = run(main())
    assert seen == [(2, 2), (2, 2), (4, 4), (5, 5)]
    assert len(answers) == 8 and all(a["token_ids"] == [1] for a in answers)


def test_without_requests_per_replica_the_replica_count_is_not_read():
    def never():
        raise AssertionError("read the replicas")

    actor = BatcherActor({"bins": {"edges": [64]}}, dispatch={"max_requests_in_flight": 7}, decoder_replicas=never)
    assert actor.request_limit() == 7


class Died(Exception):
    """Stands for Ray's ActorDiedError: the batcher's replica went away mid-call."""


class StreamHandle:
    """A Serve handle's `options(stream=True).stream.remote(request)`, each request kept in `sent`, its
    items from `_stream`."""

    def __init__(self):
        self.sent = []

    def options(self, stream):
        return self

    @property
    def stream(self):
        return self

    def remote(self, request):
        self.sent.append(request)
        return self._stream(request)


class RestartingBatcher(StreamHandle):
    """A Serve handle to a batcher deployment whose replica dies: each call goes to the replica up now,
    and the first `deaths` replicas die after passing on `die_after` items; Serve then starts a fresh
    one, empty (`replicas` counts them)."""

    def __init__(self, deaths: int, die_after: int):
        super().__init__()
        self.deaths, self.die_after, self.replicas = deaths, die_after, []
        self._start()

    def _start(self):
        self.replicas.append(BatcherActor({"bins": {"edges": [4, 8, 16]}}, send_batch=FakeDecoder()))

    async def _stream(self, request):
        replica, passed = self.replicas[-1], 0
        async for item in replica.stream(request):
            if len(self.replicas) <= self.deaths and passed == self.die_after:
                self._start()
                raise Died("the batcher's replica died")
            passed += 1
            yield item


@pytest.mark.parametrize("deaths, die_after", [(1, 2), (2, 1), (1, 0)])
def test_a_stream_whose_batcher_dies_resumes_on_its_successor_after_the_tokens_it_had(deaths, die_after):
    from actors.decode_client import HandleBatcher

    async def main():
        handle = RestartingBatcher(deaths, die_after)
        client = HandleBatcher(handle, backoff_s=0.0, retry_on=(Died,))
        tokens, result = [], None
        async for item in client.stream(request("r3")):  # 17 tokens, cut at 4, 8 and 16 on the way
            if "event" in item:
                tokens.extend(item["event"]["token_ids"])
            else:
                result = item["result"]
        return tokens, result, handle

    tokens, result, handle = run(main())
    assert tokens == list(range(17)) and result["token_ids"] == list(range(17))  # each token once, in order
    assert len(handle.replicas) == deaths + 1 and len(handle.sent) == deaths + 1
    assert [len(sent["resume_ids"]) for sent in handle.sent][0] == 0
    assert all(len(later["resume_ids"]) > 0 for later in handle.sent[1:]) or die_after == 0


def test_a_batcher_that_keeps_dying_fails_the_stream_after_its_retries():
    from actors.decode_client import HandleBatcher

    async def main():
        client = HandleBatcher(RestartingBatcher(deaths=10, die_after=1), retries=2, backoff_s=0.0, retry_on=(Died,))
        async for _ in client.stream(request("r3")):
            pass

    with pytest.raises(Died):
        run(main())


def test_a_stream_that_broke_after_its_last_event_is_finished_without_asking_again():
    """The engine's last event of an answer carries its finish_reason; the result follows it. A stream
    cut between the two is answered from the events, not sent again."""
    from actors.decode_client import HandleBatcher

    class LostResult(StreamHandle):
        async def _stream(self, request):
            yield {"event": {"request_id": request["id"], "token_ids": [0, 1], "text": "<0><1>", "prompt_logprobs": None}}
            yield {"event": {"request_id": request["id"], "token_ids": [2], "text": "<2>", "finish_reason": "stop"}}
            raise Died("died just before the result")

    async def main():
        handle = LostResult()
        items = [item async for item in HandleBatcher(handle, backoff_s=0.0, retry_on=(Died,)).stream(request("r1"))]
        return items, handle

    items, handle = run(main())
    assert len(handle.sent) == 1 and len(items) == 3
    result = items[-1]["result"]
    assert result["token_ids"] == [0, 1, 2] and result["finish_reason"] == "stop" and result["text"] == "<0><1><2>"


def test_a_whole_call_is_made_again_while_its_replica_dies_and_not_past_its_retries():
    from actors.decode_client import call_again_if_replica_died

    calls = []

    async def call():
        calls.append(1)
        if len(calls) <= 2:
            raise Died("the planner's replica died")
        return {"answer": len(calls)}

    assert run(call_again_if_replica_died(call, "planner", backoff_s=0.0, retry_on=(Died,))) == {"answer": 3}
    calls.clear()
    with pytest.raises(Died):
        run(call_again_if_replica_died(call, "planner", retries=1, backoff_s=0.0, retry_on=(Died,)))
    assert len(calls) == 2
    with pytest.raises(ValueError):  # a failure of the request itself is not sent again
        run(call_again_if_replica_died(lambda: (_ for _ in ()).throw(ValueError("bad")), "planner", retry_on=(Died,)))
