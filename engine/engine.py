"""The transformers-backed engine: continuous batching over `LlamaRunner`, with prefix reuse."""
from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.base import Engine
from engine.config import DEFAULT_SPECULATIVE_TOKENS, EngineConfig
from engine.constraints import TokenConstraint, make_constraint
from engine.copies import CopyGuard
from engine.detokenize import IncrementalDetokenizer
from engine.drafts import PredictionDrafts, lookup_draft
from engine.loops import LoopDetector
from engine.llama import LlamaRunner, LogitRows, PrefillItem
from engine.openings import OpeningGuard
from engine.prefix_cache import PrefixCache, PrefixEntry, PrefixHandle, common_length
from engine.sampling import make_generator, sample, token_logprobs
from engine.sentences import sentence_end
from engine.types import FinishReason, GenerationRequest, Result, TokenEvent, TokenLogprob


log = logging.getLogger(__name__)
SCORED_ROWS_AT_ONCE = 256  # a scored prompt's rows turned into logits together (engine.llama.LogitRows)
# a scored prompt sharing this many more tokens with one admitted in the same step than with any cached
# waits a step for that one's KV and scores (a step costs about what prefilling a few dozen tokens does)
SCORED_WAIT_TOKENS = 32


@dataclass
class _Sequence:
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    added_at: float
    generated: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens of prompt + generated whose KV is in the slot
    first_token_at: float | None = None
    prefix_hit: int = 0
    kept_kv: int = 0
    finish: FinishReason | None = None
    new_tokens: list[int] = field(default_factory=list)  # produced in the current step
    sent_chars: int = 0  # text already handed out in events
    constraint: TokenConstraint | None = None
    loops: LoopDetector | None = None
    copies: CopyGuard | None = None
    openings: OpeningGuard | None = None
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per generated token
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # those of new_tokens
    prompt_logprobs: list[TokenLogprob] | None = None  # with params.prompt_logprobs, once the prompt is computed
    cached_scores: list[TokenLogprob] = field(default_factory=list)  # those of its first tokens a cached entry gave
    prompt_scores_sent: bool = False  # in an event already: only the first event carries them
    order: int = 0  # arrival order: first come first served within a priority, kept when preempted
    preemptions: int = 0  # times a higher priority took its slot (it waited, then went on where it was)
    stop_logprob: TokenLogprob | None = None  # with logprobs: the stop token's that ended the answer
    error: str | None = None  # with FinishReason.ERROR: the fault that ended it
    predicted: PredictionDrafts | None = None  # with params.prediction: drafts from it
    prediction_span: int = 0  # how many prediction tokens to draft next (0: not drafted yet), see _verify_drafts
    prediction_drafted: int = 0  # this step's draft is that many tokens of the prediction (0: none, or a lookup's)
    prediction_checked: int = 0  # prediction tokens drafted and checked, and those of them kept
    prediction_kept: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)

    def token_at(self, position: int) -> int:
        prompt = self.request.prompt_ids
        return prompt[position] if position < len(prompt) else self.generated[position - len(prompt)]


@dataclass
class _Admission:
    """The requests admitted in one step: their sequences in slot order, the uncached part of each
    prompt that still needs a forward pass (`items`, in the same order, for those with any), and the
    stored logits of those whose whole prompt was a cached prefix."""

    sequences: list[_Sequence] = field(default_factory=list)
    items: list[PrefillItem] = field(default_factory=list)
    cached_logits: dict[int, torch.Tensor] = field(default_factory=dict)


class LLMEngine(Engine):
    """Continuous batching: sequence i of the running batch lives in KV slot i; a finished sequence
    frees its slot at once (the last running sequence moves into it), and waiting requests are
    admitted between decode steps, highest priority first."""

    def __init__(self, hf_model, tokenizer, config: EngineConfig, model_name: str | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name or config.served_model_name or config.model
        context = getattr(hf_model.config, "max_position_embeddings", None) or config.max_model_len
        self.max_model_len = min(config.max_model_len, context)
        self.runner = LlamaRunner(hf_model, config.max_batch_size, self.max_model_len, config.cuda_graphs)
        # passes that are not plain (drafted or forced tokens in them) run eagerly: where plain ones replay
        # graphs, both are off unless asked for
        graphed = self.runner.graphs is not None
        self.speculative_tokens = config.speculative_tokens
        if self.speculative_tokens is None:
            self.speculative_tokens = 0 if graphed else DEFAULT_SPECULATIVE_TOKENS
        self.jump_forward = not graphed if config.jump_forward is None else config.jump_forward
        self.stop_token_ids = _stop_token_ids(hf_model, tokenizer)
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes)
        self.reuse_scored_prompts = config.reuse_scored_prompts
        self.cache_answers = config.cache_answers
        self._waiting: list[tuple[int, int, _Sequence]] = []
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._results: dict[str, Result] = {}
        self._order = itertools.count()
        self._token_texts: dict[int, str] = {}  # each token decoded alone, for logprobs
        self._opening_guards: dict[tuple[str, ...], OpeningGuard] = {}  # per `no_openings` word list
        self._stats = {"steps": 0, "generated_tokens": 0, "prefill_tokens": 0, "finished": 0, "step_s": 0.0,
                       "forced_tokens": 0, "draft_tokens": 0, "accepted_draft_tokens": 0, "mixed_steps": 0,
                       "preempted": 0}

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        from engine.loader import load_hf_model, resolve_model_dir, select_device_and_dtype

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device, dtype = select_device_and_dtype(config)
        model, tokenizer = load_hf_model(resolve_model_dir(config.model, config.cache_dir), dtype, device)
        return cls(model, tokenizer, config)

    # ---- requests in ----------------------------------------------------------------------------
    def add(self, request: GenerationRequest) -> None:
        if request.id in self._by_id or request.id in self._results:
            raise ValueError(f"id: request '{request.id}' is already known to this engine")
        prompt_len = len(request.prompt_ids) + len(request.resume_ids)
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt_ids: the prompt has {prompt_len} tokens; this model's context allows "
                f"at most {self.max_model_len - 1} before the answer"
            )
        if len(request.resume_ids) >= request.params.max_tokens:
            raise ValueError("resume_ids: already as long as max_tokens; nothing left to generate")
        prediction, vocabulary = request.params.prediction, self.runner.embed.shape[0]
        if prediction and not 0 <= min(prediction) <= max(prediction) < vocabulary:
            raise ValueError(f"params.prediction: token ids are from 0 to {vocabulary - 1} in this model")
        name = request.params.constraint
        constraint = (make_constraint(name, self.tokenizer, request.resume_ids, request.params.constraint_arg)
                      if name is not None else None)
        sequence = _Sequence(
            request=request.model_copy(update={"prompt_ids": list(request.prompt_ids)}),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            generator=make_generator(request.params),
            added_at=time.perf_counter(),
            generated=list(request.resume_ids),
            constraint=constraint,
            loops=LoopDetector() if request.params.stop_on_loop else None,
            copies=CopyGuard.for_texts(request.params.no_copy, self.tokenizer, request.params.no_copy_tokens)
            if request.params.no_copy else None,
            openings=self._opening_guard(tuple(request.params.no_openings)) if request.params.no_openings else None,
            logprobs=list(request.resume_logprobs) if request.params.logprobs is not None else None,
            predicted=PredictionDrafts(request.params.prediction) if request.params.prediction else None,
        )
        if sequence.loops is not None:  # a resumed answer stops exactly where an uninterrupted one would
            looped = False
            for token in request.resume_ids:
                looped = sequence.loops.add(token) or looped
            if looped and constraint is not None and constraint.wrap_up():  # it was wrapping up when it was cut
                sequence.loops = None
        if request.resume_ids:
            sequence.detokenizer.add(sequence.generated)
            sequence.sent_chars = len(sequence.detokenizer.text)
        self._by_id[request.id] = sequence
        sequence.order = next(self._order)
        heapq.heappush(self._waiting, (-request.priority, sequence.order, sequence))

    def abort(self, request_id: str) -> bool:
        sequence = self._by_id.get(request_id)
        if sequence is None:
            return False
        if sequence.slot >= 0:
            self._finish(sequence, FinishReason.ABORT)
        else:
            self._waiting = [w for w in self._waiting if w[2] is not sequence]
            heapq.heapify(self._waiting)
            self._store_result(sequence, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def pop_result(self, request_id: str) -> Result | None:
        return self._results.pop(request_id, None)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        self._stats["steps"] += 1
        running = list(self._running)
        admission = self._select_admissions()
        running = [s for s in running if s.slot >= 0]  # less any preempted for a higher priority
        if running and admission.items and self.config.mixed_batches:
            # one forward pass: the running batch decodes while the admitted prompts prefill beside it
            self._stats["mixed_steps"] += 1
            self._decode(running, admission)
            self._release_finished(admission.sequences + running)
            batch = running
        else:
            if admission.sequences:
                self._settle_admission(admission, self.runner.prefill(admission.items) if admission.items else None)
                self._release_finished(admission.sequences)
            batch = list(self._running)
            if batch:
                self._decode(batch)
                self._release_finished(batch)
        admitted = admission.sequences
        seen = {id(s) for s in admitted}
        touched = admitted + [s for s in batch if id(s) not in seen]
        events = [self._event(s) for s in touched if s.new_tokens or s.finish]
        self._stats["step_s"] += time.perf_counter() - started  # time in steps: where a host slows the engine
        return events

    def _decode(self, batch: list[_Sequence], admission: _Admission | None = None) -> None:
        """One forward pass for the running batch. Tokens a constraint forced (appended by `_take`
        without steps of their own) run in it after their sequence's decode token, and so do drafted
        tokens (`engine.drafts`), which are kept as far as the model agrees with them. With
        `admission`, the admitted prompts' uncached tokens run in it too (their first tokens come
        from it), rather than in a prefill pass of their own before it."""
        device = self.runner.device
        tokens = torch.tensor([s.token_at(s.cached) for s in batch], device=device)
        positions = torch.tensor([s.cached for s in batch], device=device)
        drafts = self._drafts(batch)
        extend, known_rows, draft_rows, offset = [], list(range(len(batch))), {}, len(batch)
        for row, s in enumerate(batch):
            forced = s.tokens[s.cached + 1 :] if s.cached + 1 < s.num_tokens else []
            draft = drafts.get(id(s), [])
            if not forced and not draft:
                continue
            extend.append(PrefillItem(s.slot, forced + draft, s.cached + 1, logit_rows=len(draft) + bool(forced)))
            rows = list(range(offset, offset + extend[-1].logit_rows))
            offset += len(rows)
            if forced:
                known_rows[row] = rows.pop(0)
            draft_rows[id(s)] = rows
            self._stats["forced_tokens"] += len(forced)
        prompts = admission.items if admission is not None else []
        logits = self.runner.decode(tokens, positions, extend + prompts)
        for s in batch:
            s.cached = s.num_tokens
        self._accept(batch, logits[known_rows] if extend or prompts else logits)
        self._verify_drafts(batch, drafts, draft_rows, logits)
        if admission is not None:
            # the runner gives the prompts' last-token rows after the other items' rows, then the rows
            # after their shared prefixes: the layout `runner.prefill` returns for them alone
            self._settle_admission(admission, logits[offset:])

    def _drafts(self, batch: list[_Sequence]) -> dict[int, list[int]]:
        """Drafts to check in this step: from a request's prediction, which its caller asked for, at any batch
        size (its span adapting, see _verify_drafts); where it has none, prompt-lookup ones, while the batch is
        small enough to spare the rows."""
        lookup = self.speculative_tokens if len(batch) <= self.config.speculative_max_batch else 0
        drafts = {}
        for s in batch:
            if not lookup and s.predicted is None:
                continue
            params = s.request.params
            allowed = min(params.max_tokens, params.length_cap or params.max_tokens) - len(s.generated)
            # each kept draft token's row gives one more token; none past the budget or the cache
            room = min(allowed - 1, self.max_model_len - s.num_tokens)
            draft = None
            with self._isolated(s):
                if s.predicted is not None:
                    s.prediction_span = s.prediction_span or max(2, self.config.prediction_tokens // 2)
                    draft = s.predicted.draft(s.generated, min(s.prediction_span, room))
                    s.prediction_drafted = len(draft)
                    s.prediction_checked += len(draft)
                if not draft and lookup:  # nothing of the prediction fits where the answer is: its own text may
                    draft = lookup_draft(s.tokens, min(lookup, room), self.config.speculative_ngram,
                                         self.config.speculative_min_ngram)
            if draft:
                drafts[id(s)] = draft
                self._stats["draft_tokens"] += len(draft)
        return drafts

    def _verify_drafts(self, batch: list[_Sequence], drafts: dict[int, list[int]], draft_rows: dict[int, list[int]],
                       logits: torch.Tensor) -> None:
        """Walk each draft along the tokens now chosen: while they agree, the draft token's KV is
        the sequence's own and its row's logits choose the token after it (sampled as a plain step
        would, so greedy and seeded answers are the same with and without drafts)."""
        drafted = [s for s in batch if id(s) in drafts]
        kept = {id(s): 0 for s in drafted}
        for i in range(max((len(d) for d in drafts.values()), default=0)):
            group, rows = [], []
            for s in drafted:  # `cached` stays where the draft starts (this step's first chosen token) until the end
                draft, at = drafts[id(s)], s.cached + i
                if kept[id(s)] != i or i >= len(draft) or s.num_tokens <= at or s.token_at(at) != draft[i]:
                    continue
                kept[id(s)] = i + 1
                if s.finish is None and s.num_tokens == at + 1:  # forced tokens may already follow it
                    group.append(s)
                    rows.append(draft_rows[id(s)][i])
            if group:
                self._accept(group, logits[rows])
        for s in drafted:
            s.cached += kept[id(s)]
            self._stats["accepted_draft_tokens"] += kept[id(s)]
            if s.prediction_drafted:
                # a prediction's span doubles while the answer follows it, and shrinks to what was kept when
                # it leaves it (an edit, a paraphrase), so an answer that strays costs few rows a step
                s.prediction_kept += kept[id(s)]
                followed = kept[id(s)] == s.prediction_drafted
                s.prediction_span = (min(2 * s.prediction_span, self.config.prediction_tokens) if followed
                                     else max(2, kept[id(s)] + 1))
                s.prediction_drafted = 0

    def _release_finished(self, sequences: list[_Sequence]) -> None:
        for sequence in sequences:
            if sequence.finish is not None and sequence.slot >= 0:
                self._release(sequence)

    def _select_admissions(self) -> _Admission:
        """Move waiting requests into free slots (a cached prefix's KV written in) and say what of
        their prompts is still to compute; the forward pass that computes it is the caller's."""
        admission, budget = _Admission(), self.config.max_prefill_tokens
        caching, scoring, preempted = set(), [], []
        while self._waiting:
            sequence = self._waiting[0][2]
            if len(self._running) >= self.runner.max_slots:
                victim = self._victim(sequence, admission)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
            todo = sequence.tokens
            scores_prompt = sequence.request.params.prompt_logprobs is not None  # needs every prompt row's logits
            hit, taken = (None, 0) if scores_prompt else self._prefix_hit(todo)
            scored_hit, reused = self._scored_hit(sequence) if scores_prompt else (None, 0)
            if scores_prompt and self._reuses_scores(sequence):
                earlier = max((common_length(tuple(todo), other) for other in scoring), default=0)
                if earlier - 1 > reused + SCORED_WAIT_TOKENS:  # an earlier admission's KV and scores serve it next step
                    break
            need = len(todo) - (taken if hit else reused)
            if admission.sequences and need > budget:
                break
            # a shared prefix not cached yet is cached as this prefill passes it: no step of its own
            shared = sequence.request.shared_prefix_len
            to_cache = shared if shared > len(todo) - need else 0
            if to_cache:
                if tuple(todo[:to_cache]) in caching:  # an earlier one caches it in this prefill: wait, reuse it
                    break
                caching.add(tuple(todo[:to_cache]))
            heapq.heappop(self._waiting)
            if scored_hit is None:
                self.prefix_cache.count(hit, taken)
            if scores_prompt and self._reuses_scores(sequence):
                scoring.append(tuple(todo))
            budget -= need
            sequence.slot = len(self._running)
            self._running.append(sequence)
            admission.sequences.append(sequence)
            start = 0  # tokens whose KV is written in from the cache
            if hit is not None:
                self.runner.write_slot(sequence.slot, hit.kv if taken == len(hit.token_ids)
                                       else tuple(t[:, :, :taken] for t in hit.kv))
                start = taken
                if taken == len(todo):
                    admission.cached_logits[id(sequence)] = hit.last_logits
            elif scored_hit is not None:
                self.prefix_cache.count(scored_hit, reused)
                self.runner.write_slot(sequence.slot, tuple(t[:, :, :reused] for t in scored_hit.kv))
                start = reused
                top = sequence.request.params.prompt_logprobs
                sequence.cached_scores = [s if len(s.top) <= top else s.model_copy(update={"top": s.top[:top]})
                                          for s in scored_hit.scores[:reused]]
            if not sequence.preemptions:  # a preempted one reports the hit of its first admission
                sequence.prefix_hit = start
            sequence.cached = start
            if need:
                admission.items.append(PrefillItem(sequence.slot, todo[start:], start,
                                                   prefix_end=to_cache, logit_rows=need if scores_prompt else 1))
        for sequence in preempted:  # back in line where they were, from the next step on
            heapq.heappush(self._waiting, (-sequence.request.priority, sequence.order, sequence))
        return admission

    def _victim(self, waiting: _Sequence, admission: _Admission) -> _Sequence | None:
        """The running sequence to preempt so `waiting` can start now: the lowest priority below its
        own, the latest to arrive among those; None when none is lower (or preemption is off). A scored
        prompt is never preempted (its scores need its whole prompt's rows in one pass)."""
        if not self.config.preempt_for_priority:
            return None
        admitted = {id(s) for s in admission.sequences}
        lower = [s for s in self._running if s.request.priority < waiting.request.priority and s.finish is None
                 and s.request.params.prompt_logprobs is None and id(s) not in admitted]
        return min(lower, key=lambda s: (s.request.priority, -s.order), default=None)

    def _preempt(self, sequence: _Sequence) -> None:
        """Take the sequence out of its slot, its answer so far kept: its KV goes to the prefix cache
        (a spare entry, with `cache_answers`), so it goes on from there when a slot frees, as if it had
        waited a while between two tokens."""
        if self.cache_answers:
            self._keep_sequence_kv(sequence, spare=True)
        self._free_slot(sequence)
        sequence.cached, sequence.preemptions = 0, sequence.preemptions + 1
        self._stats["preempted"] += 1

    def _prefix_hit(self, prompt: list[int]) -> tuple[PrefixEntry | None, int]:
        """The cached entry a prompt starts from and how many of its tokens it takes: with
        `cache_answers`, any start an entry shares; else only a whole entry the prompt goes on from."""
        if self.cache_answers:
            return self.prefix_cache.best_start(prompt) or (None, 0)
        entry = self.prefix_cache.longest_match(prompt, count=False)
        return entry, len(entry.token_ids) if entry is not None else 0

    def _reuses_scores(self, sequence: _Sequence) -> bool:
        """Whether this scored prompt takes cached scores and leaves its own (not an answer resumed after it)."""
        return self.reuse_scored_prompts and not sequence.generated and len(sequence.request.prompt_ids) > 1

    def _scored_hit(self, sequence: _Sequence) -> tuple[PrefixEntry | None, int]:
        """The cached scored prompt this one may start from, and how many of its tokens' KV and scores
        to take: all they share but the last, whose row is computed again (an entry keeps no logits
        but its last's, and the first token that differs is scored from that row)."""
        if not self._reuses_scores(sequence):
            return None, 0
        match = self.prefix_cache.longest_scored(sequence.request.prompt_ids, sequence.request.params.prompt_logprobs)
        return (match[0], match[1] - 1) if match is not None else (None, 0)

    def _settle_admission(self, admission: _Admission, logits: torch.Tensor | LogitRows | None) -> None:
        """After the pass that computed the admitted prompts (`logits`: each item's last `logit_rows`
        rows, item after item, then the rows after their shared prefixes, for the items that ask): cache
        those prefixes and preambles, score the prompts that ask, and sample each admitted sequence's
        first token."""
        items = admission.items
        prefix_rows = iter(range(sum(it.logit_rows for it in items), len(logits))) if items else iter(())
        rows, index, first_row = [], 0, 0
        for sequence in admission.sequences:
            if sequence.cached < sequence.num_tokens:
                self._stats["prefill_tokens"] += sequence.num_tokens - sequence.cached
                item = items[index]
                last_row = first_row + item.logit_rows - 1
                if item.prefix_end:
                    after = logits[next(prefix_rows)] if item.prefix_row() is not None else logits[last_row]
                    self._cache_prefix(sequence, item.prefix_end, after)
                if sequence.prefix_hit < sequence.request.preamble_len < sequence.num_tokens:
                    # no logits: a preamble is never a whole prompt, so it only serves prompts that go on past it
                    self._cache_prefix(sequence, sequence.request.preamble_len, None)
                if sequence.request.params.prompt_logprobs is not None:  # its item starts where cached scores end
                    with self._isolated(sequence):
                        self._score_prompt(sequence, logits[first_row:last_row + 1])
                        self._cache_scored_prompt(sequence, logits[last_row])
                rows.append(logits[last_row])
                index += 1
                first_row += item.logit_rows
                sequence.cached = sequence.num_tokens
            else:  # the whole prompt was a cached prefix: its stored logits give the first token
                rows.append(admission.cached_logits[id(sequence)])
        self._accept(admission.sequences, torch.stack(rows))

    def _cache_prefix(self, sequence: _Sequence, length: int, logits_after: torch.Tensor | None) -> None:
        key = tuple(sequence.tokens[:length])
        if self.prefix_cache.get(key) is None:
            logits = logits_after.clone() if logits_after is not None else None
            self.prefix_cache.put(PrefixEntry(key, self.runner.read_slot(sequence.slot, length), logits))

    def _accept(self, batch: list[_Sequence], logits: torch.Tensor) -> None:
        """Append one sampled token to each sequence and decide whether it is done."""
        masks = [self._mask(s, logits.shape[-1]) for s in batch]
        chosen = self._sample(batch, logits, masks)
        scored = self._logprobs(batch, logits, chosen)
        now = time.perf_counter()
        for row, (sequence, token) in enumerate(zip(batch, chosen)):
            if sequence.finish is not None:
                continue
            sequence.first_token_at = sequence.first_token_at or now
            with self._isolated(sequence):
                self._take(sequence, token, scored.get(row))
                while sequence.finish is None and sequence.constraint is not None and self.jump_forward:
                    forced = sequence.constraint.forced()
                    if forced is None:
                        break
                    self._take(sequence, forced)  # computed in the next step's pass, after the decode token

    @contextlib.contextmanager
    def _isolated(self, sequence: _Sequence):
        """Run one request's own part of a step (its constraint, sampling, stop strings, scores): a fault
        in it ends that request with FinishReason.ERROR, and its batch mates and the engine go on. Only
        the batched forward pass, which no single request owns, may still stop the engine."""
        try:
            yield
        except Exception as exc:
            log.exception("request %s failed after %d tokens; it ends here, the rest of its batch goes on",
                          sequence.request.id, len(sequence.generated))
            sequence.finish, sequence.error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"

    def _mask(self, sequence: _Sequence, width: int) -> torch.Tensor | None:
        mask = None
        with self._isolated(sequence):
            mask = self._allowed(sequence, width)
            if mask is not None and not mask.any():  # a constraint broke its promise: end that answer, not the engine
                log.warning("request %s: its constraint allows no token after %d; the answer ends here",
                            sequence.request.id, len(sequence.generated))
                sequence.finish, mask = FinishReason.STOP, None
        return mask if sequence.finish is None else None

    def _sample(self, batch: list[_Sequence], logits: torch.Tensor, masks: list[torch.Tensor | None]) -> list[int]:
        """The batch's next tokens (a seeded row draws the same together or alone: see `sample`)."""
        columns = [[s.request.params for s in batch], [s.generator for s in batch], masks, [s.generated for s in batch]]
        chosen = self._together_or_by_row(
            batch, range(len(batch)), lambda: dict(enumerate(sample(logits, *columns))),
            lambda row: sample(logits[row:row + 1], *[[column[row]] for column in columns])[0])
        return [chosen.get(row, 0) for row in range(len(batch))]  # a failed or finished row's token is never taken

    def _logprobs(self, batch: list[_Sequence], logits: torch.Tensor, chosen: list[int]) -> dict[int, TokenLogprob]:
        """Row -> the chosen token's log probability, for the rows whose request asks for them."""
        rows = [row for row, s in enumerate(batch) if s.logprobs is not None and s.finish is None]
        if not rows:
            return {}
        tops = {row: batch[row].request.params.logprobs for row in rows}
        return self._together_or_by_row(
            batch, rows,
            lambda: dict(zip(rows, token_logprobs(logits[rows], [chosen[r] for r in rows], list(tops.values()),
                                                  self._token_text))),
            lambda row: token_logprobs(logits[[row]], [chosen[row]], [tops[row]], self._token_text)[0])

    def _together_or_by_row(self, batch: list[_Sequence], rows, together: Callable[[], dict],
                            alone: Callable[[int], object]) -> dict:
        """`together()` (row -> value for `rows`), or where that raises, `alone(row)` for each row whose
        sequence is unfinished, isolated, so that only the rows that raise alone fail."""
        try:
            return together()
        except Exception:
            pass
        values = {}
        for row in rows:
            if batch[row].finish is None:
                with self._isolated(batch[row]):
                    values[row] = alone(row)
        return values

    def _score_prompt(self, sequence: _Sequence, logits: torch.Tensor | LogitRows) -> None:
        """Each prompt token's log probability after the first: those of its first `prefix_hit` tokens from
        a cached scored prompt, the rest from the rows of the tokens before them (`logits` starts at
        position `prefix_hit`)."""
        prompt = sequence.request.prompt_ids
        if len(prompt) < 2:
            sequence.prompt_logprobs = []
            return
        k, start, scored = sequence.request.params.prompt_logprobs, sequence.prefix_hit, list(sequence.cached_scores)
        for lo in range(start, len(prompt) - 1, SCORED_ROWS_AT_ONCE):  # a long prompt's logits a chunk at a time
            hi = min(lo + SCORED_ROWS_AT_ONCE, len(prompt) - 1)
            scored += token_logprobs(logits[list(range(lo - start, hi - start))], prompt[lo + 1 : hi + 1],
                                     [k] * (hi - lo), self._token_text)
        sequence.prompt_logprobs = scored

    def _cache_scored_prompt(self, sequence: _Sequence, last_logits: torch.Tensor) -> None:
        if not self._reuses_scores(sequence):
            return
        key, top = tuple(sequence.request.prompt_ids), sequence.request.params.prompt_logprobs
        cached = self.prefix_cache.get(key)
        if cached is None or cached.scores is None or cached.scores_top < top:
            self.prefix_cache.put(PrefixEntry(key, self.runner.read_slot(sequence.slot, len(key)), last_logits.clone(),
                                              list(sequence.prompt_logprobs), top, spare=True))

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _opening_guard(self, words: tuple[str, ...]) -> OpeningGuard:
        """One guard per word list, kept: every node of every planned answer asks for the same words."""
        guard = self._opening_guards.get(words)
        if guard is None:
            if len(self._opening_guards) >= 64:  # word lists that vary per request would otherwise pile up
                self._opening_guards.clear()
            guard = self._opening_guards[words] = OpeningGuard.for_words(words, self.tokenizer)
        return guard

    def _allowed(self, sequence: _Sequence, width: int) -> torch.Tensor | None:
        """The tokens the sequence may take next: its constraint's, less those its copy and opening guards
        ban and the stop tokens while it is short of `min_tokens` (unless that would leave none, as when the
        grammar forces the banned token)."""
        mask = sequence.constraint.allowed() if sequence.constraint is not None else None
        banned = list(sequence.copies.banned(sequence.generated)) if sequence.copies is not None else []
        if sequence.openings is not None:
            banned += sequence.openings.banned(sequence.detokenizer.text)
        if len(sequence.generated) < sequence.request.params.min_tokens:
            banned += self.stop_token_ids
        if not banned:
            return mask
        guarded = torch.ones(width, dtype=torch.bool) if mask is None else mask.clone()
        guarded[[b for b in banned if b < guarded.numel()]] = False
        return guarded if guarded.any() else mask

    def _take(self, sequence: _Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        """Append one token to the sequence (or end it on a stop token) and decide whether it is done.
        `logprob`: the token's, for a sequence that keeps them (None for a token a constraint forced)."""
        if token in self.stop_token_ids and not sequence.request.params.ignore_eos:
            sequence.finish = FinishReason.STOP
            if sequence.logprobs is not None:
                sequence.stop_logprob = logprob or TokenLogprob(token_id=token, token=self._token_text(token),
                                                                logprob=0.0)
            return
        sequence.generated.append(token)
        sequence.new_tokens.append(token)
        if sequence.logprobs is not None:
            logprob = logprob or TokenLogprob(token_id=token, token=self._token_text(token), logprob=0.0)
            sequence.logprobs.append(logprob)
            sequence.new_logprobs.append(logprob)
        self._stats["generated_tokens"] += 1
        added = sequence.detokenizer.add(sequence.generated)
        if sequence.constraint is not None:
            sequence.constraint.advance(token)
        sequence.finish = self._check_finish(sequence, len(sequence.detokenizer.text) - len(added))
        if sequence.finish is None and sequence.loops is not None and sequence.loops.add(token):
            # a constrained answer (JSON) cut here would be unfinished: its constraint closes it instead
            sequence.loops = None
            if sequence.constraint is None or not sequence.constraint.wrap_up():
                sequence.finish = FinishReason.STOP

    def _check_finish(self, sequence: _Sequence, added_at: int) -> FinishReason | None:
        """Whether the sequence is done, its newest token's text starting at `added_at` of its text."""
        params = sequence.request.params
        if params.stop:
            # Unsent text holds any partial stop string (see _event), so a match starts after it.
            text = sequence.detokenizer.text
            hits = [i for i in (text.find(s, sequence.sent_chars) for s in params.stop) if i >= 0]
            if hits:
                sequence.detokenizer.text = text[: min(hits)]
                return FinishReason.STOP
        if params.wrap_up_tokens and len(sequence.generated) > params.max_tokens - params.wrap_up_tokens:
            end = sentence_end(sequence.detokenizer.text, added_at)
            if end is not None:
                sequence.detokenizer.text = sequence.detokenizer.text[:end]
                return FinishReason.STOP
        if sequence.constraint is not None and sequence.constraint.is_complete:
            return FinishReason.STOP
        produced = len(sequence.generated)
        if produced >= params.max_tokens or sequence.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if params.length_cap is not None and produced >= params.length_cap:
            return FinishReason.CUT
        return None

    def _event(self, sequence: _Sequence) -> TokenEvent:
        text = sequence.detokenizer.text
        end = len(text)
        if sequence.finish is None:  # hold back a tail that may still become a stop string
            end -= _partial_stop_length(text, sequence.request.params.stop)
        event = TokenEvent(
            request_id=sequence.request.id,
            token_ids=sequence.new_tokens,
            text=text[sequence.sent_chars : end],
            finish_reason=sequence.finish,
            logprobs=sequence.new_logprobs if sequence.logprobs is not None else None,
            prompt_logprobs=None if sequence.prompt_scores_sent else sequence.prompt_logprobs,
            stop_logprob=sequence.stop_logprob,
        )
        sequence.new_tokens, sequence.new_logprobs, sequence.sent_chars = [], [], max(end, sequence.sent_chars)
        sequence.prompt_scores_sent = sequence.prompt_logprobs is not None
        return event

    def _finish(self, sequence: _Sequence, reason: FinishReason) -> None:
        sequence.finish = reason
        self._release(sequence)

    def _release(self, sequence: _Sequence) -> None:
        """Free the slot at once: the last running sequence moves into it, keeping slots dense."""
        self._keep_answer_kv(sequence)  # before another sequence moves into its slot
        self._free_slot(sequence)
        self._store_result(sequence, sequence.finish)

    def _free_slot(self, sequence: _Sequence) -> None:
        slot, last = sequence.slot, self._running.pop()
        if last is not sequence:
            self.runner.move_slot(last.slot, slot, last.cached)
            last.slot = slot
            self._running[slot] = last
        sequence.slot = -1

    def _keep_answer_kv(self, sequence: _Sequence) -> None:
        """Keep the prompt-and-answer KV of an answer that asks (`keep_kv`), or, with `cache_answers`, of
        any answer as a spare entry (the next turn of a conversation, or an answer cut to be continued,
        starts with it)."""
        asked = sequence.request.keep_kv and sequence.finish in (FinishReason.STOP, FinishReason.LENGTH)
        spare = (self.cache_answers and sequence.request.params.prompt_logprobs is None
                 and sequence.finish in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CUT))
        if not (asked or spare):
            return
        if self._keep_sequence_kv(sequence, spare=not asked) and asked:
            sequence.kept_kv = sequence.cached

    def _keep_sequence_kv(self, sequence: _Sequence, spare: bool) -> bool:
        """Put the KV of the sequence's computed tokens in the prefix cache (an entry already there
        stops being spare when this one is not); False when it does not fit."""
        key = tuple(sequence.tokens[: sequence.cached])
        cached = self.prefix_cache.get(key)
        if cached is not None:
            cached.spare = cached.spare and spare
            return True
        return self.prefix_cache.put(PrefixEntry(key, self.runner.read_slot(sequence.slot, len(key)), None,
                                                 spare=spare))

    def _store_result(self, sequence: _Sequence, reason: FinishReason) -> None:
        now = time.perf_counter()
        self._by_id.pop(sequence.request.id, None)
        self._stats["finished"] += 1
        self._results[sequence.request.id] = Result(
            request_id=sequence.request.id,
            prompt_tokens=len(sequence.request.prompt_ids),
            token_ids=sequence.generated,
            text=sequence.detokenizer.text,
            finish_reason=reason,
            ttft_s=(sequence.first_token_at or now) - sequence.added_at,
            latency_s=now - sequence.added_at,
            prefix_hit_tokens=sequence.prefix_hit,
            kept_kv_tokens=sequence.kept_kv,
            logprobs=sequence.logprobs,
            prompt_logprobs=sequence.prompt_logprobs,
            stop_logprob=sequence.stop_logprob,
            error=sequence.error,
            accepted_prediction_tokens=sequence.prediction_kept,
            rejected_prediction_tokens=sequence.prediction_checked - sequence.prediction_kept,
        )

    # ---- prefixes and stats ---------------------------------------------------------------------
    def prefill_prefix(self, token_ids: list[int]) -> PrefixHandle:
        key = tuple(token_ids)
        if not key or len(key) >= self.max_model_len:
            raise ValueError(f"token_ids: a prefix needs 1 to {self.max_model_len - 1} tokens, got {len(key)}")
        if self.prefix_cache.get(key) is None:
            scratch = self.runner.scratch_slot
            base = self.prefix_cache.longest_match(token_ids, count=False)  # a shorter one: extend it
            start = 0
            if base is not None:
                self.runner.write_slot(scratch, base.kv)
                start = len(base.token_ids)
            logits = self.runner.prefill([PrefillItem(scratch, token_ids[start:], start)])[0]
            self._stats["prefill_tokens"] += len(key) - start
            self.prefix_cache.put(PrefixEntry(key, self.runner.read_slot(scratch, len(key)), logits))
        return PrefixHandle(length=len(key), key=hash(key))

    def export_prefix(self, token_ids: list[int]) -> PrefixEntry | None:
        """The cached KV of exactly this prefix (to hand to another replica), or None."""
        return self.prefix_cache.get(tuple(token_ids))

    def import_prefix(self, entry: PrefixEntry) -> None:
        """Adopt a prefix KV computed elsewhere (same model and dtype): no prefill needed for it."""
        layers, _, kv_heads, _, head_dim = self.runner.k_cache.shape
        expected = (layers, kv_heads, len(entry.token_ids), head_dim)
        if tuple(entry.kv[0].shape) != expected:
            raise ValueError(f"entry: KV shape {tuple(entry.kv[0].shape)} does not fit this model {expected}")
        self.prefix_cache.put(entry.to(self.runner.device))

    def stats(self) -> dict:
        cache = self.prefix_cache
        return {
            **self._stats,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "prefix_entries": len(cache),
            "prefix_bytes": cache.bytes,
            "prefix_hits": cache.hits,
            "prefix_misses": cache.misses,
            "prefix_hit_tokens": cache.hit_tokens,
            "graph_replays": self.runner.graphs.replays if self.runner.graphs is not None else 0,
        }


def _partial_stop_length(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the beginning of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _stop_token_ids(hf_model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids
