"""How the batcher asks the Decoder's prefix router (deployments.prefix_router), in the same process,
which decoder replica holds a prompt. Serve builds that router inside the handle, out of the
batcher's reach, and ships its class by value, so the router's own module globals are a copy in the
process that runs it: the router registers itself here, in a module imported by name."""
from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import Protocol

from predictor.batcher import HolderOf


class KnowsHolders(Protocol):
    def holder_of(self, prompt_ids: Sequence[int]) -> Hashable | None: ...


# (app, deployment) -> the newest router. A weak reference to the router, not to its bound method:
# unpickling the class again (as Serve does) replaces its functions, and a reference to the old one dies.
_routers: dict[tuple[str, str], weakref.ref] = {}
_lock = threading.Lock()  # the router registers on Serve's router loop, the batcher asks on its own


def register(app_name: str, deployment_name: str, router: KnowsHolders) -> None:
    """`router` answers for the deployment until a newer one registers or it is gone."""
    with _lock:
        _routers[(app_name, deployment_name)] = weakref.ref(router)


def holder_lookup(app_name: str, deployment_name: str) -> HolderOf:
    """A function of a prompt: the replica this process's prefix router for the deployment would send
    it to for what it holds; None before that router exists (no call made yet), for a deployment
    routed otherwise, or for a prompt no replica holds enough of."""
    def holder_of(prompt_ids: Sequence[int]) -> Hashable | None:
        with _lock:
            ref = _routers.get((app_name, deployment_name))
        router = ref() if ref is not None else None
        return router.holder_of(prompt_ids) if router is not None else None
    return holder_of
