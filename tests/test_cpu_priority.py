"""The routing replicas' CPU class: every thread of the process moves to SCHED_IDLE, and threads it
starts later inherit it; `normal` changes nothing. Run in a child process, since a thread cannot
leave SCHED_IDLE again without privileges."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, sys, threading
from deployments.cpu_priority import lower_routing_priority
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
moved = lower_routing_priority(sys.argv[1])
after = threading.Thread(target=stop.wait); after.start()
classes = {tid: os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")}
stop.set(); before.join(); after.join()
print(json.dumps({"moved": moved, "classes": sorted(classes.values()), "threads": len(classes)}))
"""


def _child(priority: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, priority], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    return json.loads(out.stdout)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes only")
def test_idle_moves_every_thread_and_later_threads_inherit_it():
    got = _child("idle")
    assert got["moved"] >= 2 and got["threads"] >= 3
    assert got["classes"] == [os.SCHED_IDLE] * got["threads"]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes only")
def test_normal_leaves_the_process_as_it_was():
    got = _child("normal")
    assert got["moved"] == 0 and got["classes"] == [os.SCHED_OTHER] * got["threads"]
