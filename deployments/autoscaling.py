"""Decoder autoscaling on the sequences the replicas decode, not on the Serve requests they hold.

A Decoder's Serve requests are micro-batches of 1 to `batcher.max_batch_size` sequences, so Serve's
own rule (ongoing requests per replica against `target_ongoing_requests`) reads one micro-batch of
32 answers as the load of one: a burst packed into a few micro-batches never adds a replica, while
the same burst arriving one by one adds several. Each Decoder replica reports its sequences (running
and waiting in its engine) through Serve's custom autoscaling metrics (`record_autoscaling_stats`),
and `SequenceLoadPolicy` scales on their sum:

    autoscaling_config:
      policy:
        policy_function: deployments.autoscaling:SequenceLoadPolicy
        policy_kwargs: {target_sequences: 24}

Serve applies the config's bounds, scaling factors and up/down delays to what the policy asks for;
`target_ongoing_requests` is not read. For the policy to see a backlog, the batcher must hand the
decoders more than `target_sequences` a replica (`dispatch.requests_per_replica`): the requests it
holds back in its bins are not counted here.

Serve pickles this module by value into its controller, so it imports nothing of this project.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SEQUENCES_METRIC = "sequences"


def desired_replicas(sequences_per_replica: Iterable[float], target_sequences: float) -> float:
    """How many replicas the sequences on the running ones call for (a fraction: Serve rounds up)."""
    return sum(sequences_per_replica) / target_sequences


class SequenceLoadPolicy:
    """A Serve custom autoscaling policy (`policy_function`, a class: Serve builds it once with
    `policy_kwargs` and calls it every control-loop tick with the deployment's AutoscalingContext)."""

    def __init__(self, target_sequences: float = 16.0):
        if not isinstance(target_sequences, (int, float)) or isinstance(target_sequences, bool) \
                or target_sequences <= 0:
            raise ValueError(f"target_sequences must be a number above 0, got {target_sequences!r}")
        self.target_sequences = float(target_sequences)

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        reported = (ctx.aggregated_metrics or {}).get(SEQUENCES_METRIC) or {}
        running = set(ctx.running_replicas)
        loads = [value for replica, value in reported.items() if replica in running]
        if not loads:  # no running replica has reported yet (just started): stay where Serve is
            return ctx.target_num_replicas, {SEQUENCES_METRIC: None}
        return desired_replicas(loads, self.target_sequences), {SEQUENCES_METRIC: sum(loads)}
