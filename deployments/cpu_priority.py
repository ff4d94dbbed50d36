"""CPU scheduling of the replicas that only route requests (ingress, planner, batcher, context cache).

On a CPU host their short wake-ups (a streamed token passed on, a micro-batch sent) pre-empt one of
the decoder's torch threads mid-matmul, and its other thread then waits at the operation's end: a
small share of CPU taken costs the decoder more than that share. A process may move its own threads
to a lower class without privileges:

- `batch` (Linux's SCHED_BATCH): same CPU share as before (their niceness still weighs them), but a
  waking thread never pre-empts a running one; it runs when a core frees up or at the next scheduler
  tick (a few ms later at most). So the decoders are not cut mid-matmul, and the routing replicas
  still get their share when decoders fill every core (autoscaled, one per core, as
  cluster/local.yaml allows).
- `idle` (SCHED_IDLE): runs only on a core no normal thread wants. Only for one CPU decoder that
  leaves a core partly free (its Python between matmuls is single-threaded): where decoders keep
  every core busy, an idle-class thread gets almost no CPU and the batcher that feeds them stalls.

`bench serve --routing-priority` measures them (README). On a GPU host the decode runs off the CPU
and this changes nothing that matters.
"""
from __future__ import annotations

import os
from typing import Literal

RoutingPriority = Literal["normal", "batch", "idle"]
_POLICY_NAMES = {"batch": "SCHED_BATCH", "idle": "SCHED_IDLE"}


def lower_routing_priority(priority: RoutingPriority) -> int:
    """Put every thread of this process (and so the threads it starts later) in SCHED_BATCH or
    SCHED_IDLE as `priority` says; returns how many threads it moved (0 for `normal`, or where the
    platform lacks the class)."""
    policy = getattr(os, _POLICY_NAMES.get(priority, ""), None) if priority != "normal" else None
    if policy is None:
        return 0
    moved = 0
    for tid in _thread_ids():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            moved += 1
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except PermissionError:  # a sandbox that forbids it: leave the process as it is
            break
    return moved


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        return [0]  # no /proc: the calling thread only
