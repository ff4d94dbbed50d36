"""Decoder autoscaling on sequences: the policy Serve calls (with Serve's own context object), the
decoder replica's report of its sequences (tiny model, no Ray), and the batcher's count of running
replicas."""
from __future__ import annotations

import asyncio
import time

import pytest

from actors.decoder import DecoderReplica
from deployments.autoscaling import SEQUENCES_METRIC, SequenceLoadPolicy
from deployments.replica_count import RunningReplicaCount
from engine.types import GenerationRequest, SamplingParams


def _context(sequences: dict[str, float], running: list[str], ongoing_batches: float, target_ongoing: float = 16,
             current: int | None = None):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    deployment = DeploymentID(name="Decoder", app_name="plato")
    replica = {name: ReplicaID(unique_id=name, deployment_id=deployment) for name in {*sequences, *running}}
    current = len(running) if current is None else current
    return AutoscalingContext(
        deployment_id=deployment, deployment_name="Decoder", app_name="plato", current_num_replicas=current,
        target_num_replicas=current, running_replicas=[replica[r] for r in running],
        total_num_requests=ongoing_batches, total_queued_requests=0.0,
        aggregated_metrics={SEQUENCES_METRIC: {replica[r]: v for r, v in sequences.items()}} if sequences else {},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(),
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target_ongoing))


def test_one_micro_batch_of_many_sequences_asks_for_replicas_where_serves_rule_sees_one_request():
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    ctx = _context({"a": 32.0}, ["a"], ongoing_batches=1)
    wanted, state = SequenceLoadPolicy(target_sequences=16)(ctx)
    assert wanted == 2.0 and state == {SEQUENCES_METRIC: 32.0}
    serves, _ = replica_queue_length_autoscaling_policy(ctx)
    assert serves < 1  # one ongoing micro-batch against a target of 16: no replica added


def test_the_sum_over_running_replicas_is_what_counts():
    policy = SequenceLoadPolicy(target_sequences=8)
    # a replica that has stopped still has its last report in the window: not counted
    assert policy(_context({"a": 6.0, "b": 4.0, "gone": 30.0}, ["a", "b"], ongoing_batches=3))[0] == 10 / 8
    assert policy(_context({"a": 0.0, "b": 0.0}, ["a", "b"], ongoing_batches=0))[0] == 0.0  # idle: scale in


def test_before_any_replica_reports_the_policy_keeps_the_current_target():
    wanted, state = SequenceLoadPolicy()(_context({}, ["a", "b"], ongoing_batches=5))
    assert wanted == 2 and state == {SEQUENCES_METRIC: None}


@pytest.mark.parametrize("target", [0, -1, "16", True, None])
def test_a_target_that_is_not_a_positive_number_is_refused(target):
    with pytest.raises(ValueError, match="target_sequences"):
        SequenceLoadPolicy(target_sequences=target)


def test_the_decoder_replica_reports_the_sequences_it_runs(make_engine):
    def batch(batch_id: str, *ids: str) -> dict:
        requests = [GenerationRequest(id=i, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=24, ignore_eos=True))
                    for i in ids]
        return {"id": batch_id, "requests": [r.model_dump(mode="json") for r in requests]}

    async def drain(decoder, batch_id, *ids):
        async for _ in decoder.run_batch(batch(batch_id, *ids)):
            pass

    async def main():
        decoder = DecoderReplica({}, engine=make_engine(max_batch_size=2))  # 2 slots: one of 3 waits
        before = await decoder.record_autoscaling_stats()
        runs = [asyncio.create_task(drain(decoder, "b1", "a", "b")), asyncio.create_task(drain(decoder, "b2", "c"))]
        while len(decoder._pumps) < 3:
            await asyncio.sleep(0.01)
        during = await decoder.record_autoscaling_stats()
        await asyncio.gather(*runs)
        return before, during, await decoder.record_autoscaling_stats()

    before, during, after = asyncio.run(asyncio.wait_for(main(), 120))
    assert before == after == {SEQUENCES_METRIC: 0.0}
    assert during == {SEQUENCES_METRIC: 3.0}  # two micro-batches, three sequences (running and waiting)


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_replica_count_is_read_in_the_background_at_most_every_refresh():
    reads = []

    def read():
        reads.append(time.monotonic())
        return len(reads)

    async def main():
        count = RunningReplicaCount("plato", "Decoder", refresh_s=1.0, read=read)
        first = count()  # nothing read yet: a reading starts
        await _until(lambda: count.count == 1)
        soon = [count() for _ in range(5)]  # within refresh_s of the reading: none more
        reads_soon = len(reads)
        await asyncio.sleep(1.0)
        count()
        await _until(lambda: count.count == 2)
        return first, soon, reads_soon

    first, soon, reads_soon = asyncio.run(main())
    assert first is None and soon == [1] * 5 and reads_soon == 1 and len(reads) == 2


def test_a_failed_reading_keeps_the_count_and_a_call_off_any_loop_only_answers():
    answers = iter([3, RuntimeError("controller restarting")])

    def read():
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return got

    async def main():
        count = RunningReplicaCount("plato", "Decoder", refresh_s=0.0, read=read)
        count()
        await _until(lambda: count.count == 3)
        count()
        await _until(lambda: count._reading is None)
        return count

    count = asyncio.run(main())
    assert count.count == 3
    assert count() == 3  # no loop running here: the last count, no reading started
