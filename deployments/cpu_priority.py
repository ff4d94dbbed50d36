"""CPU scheduling of the replicas that only route requests (ingress, planner, batcher, context cache).

On a CPU host their short wake-ups (a streamed token passed on, a micro-batch sent) pre-empt one of
the decoder's torch threads mid-matmul, and its other thread then waits at the operation's end: a
small share of CPU taken costs the decoder more than that share. Linux's SCHED_IDLE class runs a
thread only on a core no normal thread wants and never lets it pre-empt one; the decoder's own loop
leaves a core partly free between matmuls (its Python is single-threaded), which is when they run.
A process may lower its own threads' class without privileges. On a GPU host the decode runs off the
CPU and this changes nothing that matters.

Only for one CPU decoder that leaves a core partly free: where decoders keep every core busy (one per
core, autoscaled, as cluster/local.yaml allows) an idle-class thread gets almost no CPU, and the
batcher that feeds them stalls. So no config here sets it; `bench serve` measured it (README).
"""
from __future__ import annotations

import os
from typing import Literal

RoutingPriority = Literal["normal", "idle"]


def lower_routing_priority(priority: RoutingPriority) -> int:
    """Put every thread of this process (and so the threads it starts later) in SCHED_IDLE when
    `priority` is `idle`; returns how many threads it moved (0 where the platform lacks the class)."""
    if priority == "normal" or not hasattr(os, "SCHED_IDLE"):
        return 0
    moved = 0
    for tid in _thread_ids():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
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
