"""What a planned answer writes down while it is made, so that another planner can finish it.

The planner replica that makes an answer may die (its node, its process). The answer's plan, its
node answers and the prompts they were asked with go to the shared context cache as they come
(`AnswerJournal`); a replica that is asked to go on reads them back (`SavedAnswer`) and decodes only
what is missing. A streamed answer's client has a start of the text already: the settled paragraphs
are journaled before they are sent, so the text rebuilt from the journal starts with what was sent.

Ray-free: `contexts` is anything with the context cache's async `open` / `update` / `get` / `close`
(actors.context_cache.ContextCache in-process, or a client of its Serve handle).
"""
from __future__ import annotations

import logging
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from graph.plan import Plan

log = logging.getLogger(__name__)

JournaledMode = Literal["ar", "sot", "plato"]


class Contexts(Protocol):
    async def open(self, request_id: str, question: str, facts: dict | None = None) -> None: ...

    async def update(self, request_id: str, plan: dict | None = None, answers: dict | None = None,
                     failures: dict | None = None, prompts: dict | None = None, facts: dict | None = None) -> bool: ...

    async def get(self, request_id: str) -> dict | None: ...

    async def close(self, request_id: str) -> None: ...


class NodePrompt(BaseModel):
    """The chat messages a node was answered from, and how many tokens they and the answer make: a
    child's prompt continues its longest parent's (graph.prompts.follow_up_messages)."""

    messages: list[dict]
    length: int


class SavedAnswer(BaseModel):
    """A planned answer as its journal holds it."""

    question: str
    mode: JournaledMode | None = Field(None, description="The mode that makes the text, once chosen.")
    routed: str | None = Field(None, description="The router's reason, for `auto`.")
    fallback: str | None = Field(None, description="Why a plan gave way to plain decoding.")
    plan: Plan | None = Field(None, description="The complete, repaired plan (or outline); None until it is.")
    plan_s: float | None = None
    answers: dict[int, str] = Field(default_factory=dict)
    failures: dict[int, str] = Field(default_factory=dict)
    prompts: dict[int, NodePrompt] = Field(default_factory=dict)
    tokens: int = Field(0, description="Tokens generated so far, plan included.")
    clean_heads: list[int] = Field(default_factory=list, description="Nodes whose answers went on from a start a "
                                   "client had: cleaned already (graph.assemble.clean_answer's head_done).")


class Resume(BaseModel):
    """Where a planned answer goes on: what its journal holds, and the text its client already has."""

    saved: SavedAnswer | None = None
    sent: str = ""


class AnswerJournal:
    """One answer's entry in the context cache, under `key`. A cache that fails stops the journaling
    of this answer (logged), never the answer: it only cannot be resumed then."""

    def __init__(self, contexts: Contexts, key: str):
        self.contexts, self.key = contexts, key
        self.working = True

    async def load(self) -> SavedAnswer | None:
        """What an earlier replica journaled under this key, or None."""
        try:
            context = await self.contexts.get(self.key)
        except Exception as exc:  # noqa: BLE001 - a cache that is down holds nothing to resume from
            log.warning("the context cache could not be read (%r): the answer starts anew", exc)
            return None
        return SavedAnswer.model_validate(context) if context else None

    async def begin(self, question: str, **facts) -> None:
        """Open the entry, with its first facts (mode, routed) in the same call."""
        await self._call("open", self.key, question, facts)

    async def note(self, **facts) -> None:
        """Mode, routed, fallback, plan_s, tokens."""
        await self._call("update", self.key, facts=facts)

    async def plan(self, plan: Plan, **facts) -> None:
        await self._call("update", self.key, plan=plan.model_dump(mode="json"), facts=facts)

    async def nodes(self, answers: dict[int, str] | None = None, failures: dict[int, str] | None = None,
                    prompts: dict[int, NodePrompt] | None = None, **facts) -> None:
        await self._call("update", self.key, answers=answers, failures=failures,
                         prompts={k: v.model_dump() for k, v in (prompts or {}).items()}, facts=facts)

    async def end(self) -> None:
        await self._call("close", self.key)

    async def _call(self, method: str, *args, **kwargs) -> None:
        if not self.working:
            return
        try:
            await getattr(self.contexts, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - see the class doc
            self.working = False
            log.warning("the context cache failed (%r): this answer is no longer journaled", exc)
