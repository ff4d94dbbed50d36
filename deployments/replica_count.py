"""How many replicas of a deployment run now, for the batcher's dispatch limit
(`dispatch.requests_per_replica`): read from `serve.status()` in a worker thread, at most every
`refresh_s`, and answered from the last reading so that asking costs nothing on the batcher's loop."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def deployment_status(app_name: str, deployment_name: str):
    """The deployment's `DeploymentStatusOverview` as the Serve controller reports it, or None."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    return app.deployments.get(deployment_name) if app else None


def replica_states(deployment) -> dict[str, int]:
    """A `DeploymentStatusOverview`'s replicas per state, by the state's name ("RUNNING", "STARTING", ...)."""
    return {getattr(state, "value", str(state)): n for state, n in (deployment.replica_states or {}).items()}


def running_replicas(app_name: str, deployment_name: str) -> int | None:
    """RUNNING replicas of the deployment, as the Serve controller reports them (None: no such deployment)."""
    deployment = deployment_status(app_name, deployment_name)
    return None if deployment is None else replica_states(deployment).get("RUNNING", 0)


class RunningReplicaCount:
    """Call it for the last count read (None before the first); a call on an event loop more than
    `refresh_s` after the last reading started starts another, in a thread. A reading that fails
    keeps the count it had."""

    def __init__(self, app_name: str, deployment_name: str, refresh_s: float = 2.0,
                 read: Callable[[], int | None] | None = None):
        self.refresh_s = refresh_s
        self._read = read or (lambda: running_replicas(app_name, deployment_name))
        self.count: int | None = None
        self._started_at = -math.inf
        self._reading: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks

    def __call__(self) -> int | None:
        now = time.monotonic()
        if self._reading is None and now - self._started_at >= self.refresh_s:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # asked off any loop: the last count, no reading
                return self.count
            self._started_at = now
            self._reading = loop.create_task(self._refresh())
        return self.count

    async def _refresh(self) -> None:
        try:
            self.count = await asyncio.to_thread(self._read)
        except Exception as exc:  # the controller busy or restarting: keep the last count
            log.warning("reading the running replicas failed (%s: %s); keeping %s", type(exc).__name__, exc, self.count)
        finally:
            self._reading = None
