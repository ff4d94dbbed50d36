"""The plan-line decoding constraint: the character grammar, its exact lift to tokens, and the
engine applying it (greedy and sampled) without touching unconstrained requests.

The shared tiny tokenizer has only 4-letter words, so these tests build their own: single
characters plus pieces that span the grammar's boundaries (" [", "]\\n\\n", "?\\n", "1, 2", ...)
and pieces that are never valid ("  ", "x[y"), with a random tiny Llama of the same vocab size."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.constraints import CONSTRAINTS
from engine.engine import LLMEngine
from engine.sampling import sample
from engine.types import FinishReason, GenerationRequest, SamplingParams
from graph.plan import Plan, PlanNode, ProblemKind, find_problems
from graph.plan_constraint import DONE, PlanGrammar, PlanLineConstraint
from graph.plan_format import format_plan, parse_plan
from graph.prompts import PLAN_EXAMPLES

EOS = 2
PIECES = (
    list("0123456789.[]:,\n?-()' ") + list("abcdefghijklmnopqrstuvwxyzWHT")
    + [" [", "]\n", "]\n\n", "\n\n", "?\n", "? [", "needs", "needs:", " none", "none", "none]", ". ", "1, 2",
       ", ", "10", "12", "1.", "2.", "1. ", "2. How", "\n2", "\n3.", ". What", " [needs: ", "[needs: none]\n",
       " [needs: 1]", ", 3]\n", "2]", "What", "How", "Why", " what", " how", " is", " the", " of", " a", " wall",
       " paint", " area", " cost", " much", " many", " does", " it", " take", " sleep", "time", " and", "ing",
       " to", " do", "é", "  ", "\t", "[[", "]]", "a]", "x[y", " ?", "\ufffd"]
)


@pytest.fixture(scope="module")
def plan_tokenizer():
    """A `PreTrainedTokenizerFast` whose ids decode to exactly their pieces, concatenated."""
    from bench.random_model import piece_tokenizer

    tokenizer = piece_tokenizer(PIECES)
    assert tokenizer.eos_token_id == EOS
    return tokenizer


@pytest.fixture(scope="module")
def plan_model(plan_tokenizer):
    """A random 2-layer Llama over the plan tokenizer's vocabulary (like conftest's `tiny_model`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4321)
    config = LlamaConfig(
        vocab_size=len(plan_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(torch.float32).eval()


@pytest.fixture
def plan_engine(plan_model, plan_tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lambda **config: LLMEngine(plan_model, plan_tokenizer, EngineConfig(**config))
    torch.set_num_threads(threads)


def _request(rid: str, resume_ids: tuple[int, ...] | list[int] = (), **sampling) -> GenerationRequest:
    params = SamplingParams(**sampling)
    return GenerationRequest(id=rid, prompt_ids=[1, 60, 61, 62, 3], params=params, resume_ids=list(resume_ids))


def _plan(*nodes: tuple[str, list[int]]) -> Plan:
    return Plan(question="q", nodes=[PlanNode(id=i, text=t, depends_on=d) for i, (t, d) in enumerate(nodes, 1)])


def _assert_valid_plan(text: str) -> None:
    """A whole plan, ended by a blank line or (text ending after a line) by EOS, that is valid."""
    grammar = PlanGrammar()
    assert grammar.can_end(grammar.run(grammar.start, text)), text
    plan = parse_plan("q", text)
    assert [n.id for n in plan.nodes] == list(range(1, len(plan.nodes) + 1))
    assert all(d < n.id for n in plan.nodes for d in n.depends_on)
    # the grammar does not read the text, so a random model may repeat a line: repair drops those
    assert {p.kind for p in find_problems(plan, max_nodes=6)} <= {ProblemKind.DUPLICATE_TEXT}, text


# ---- the character grammar -------------------------------------------------------------------
VALID_PLANS = [
    _plan(("How large is the wall area to paint?", []), ("How much does a litre cover?", []),
          ("How many litres do two coats take?", [1, 2])),
    _plan(("Why sleep matters", []), ("What breaks it at night", [1])),
    _plan(*[(f"step number {k} here", list(range(1, k))) for k in range(1, 7)]),  # max_nodes lines
    _plan(("a " * 15 + "b", []), ("x y", [1])),  # exactly max_words words
]


@pytest.mark.parametrize("plan", VALID_PLANS + [parse_plan(q, text) for q, text in PLAN_EXAMPLES])
def test_grammar_accepts_formatted_plans(plan):
    grammar, text = PlanGrammar(), format_plan(plan)
    assert grammar.accepts(text + "\n\n")
    assert grammar.run(grammar.start, text + "\n") == ("num", len(plan.nodes) + 1, 0)  # may go on or end
    assert grammar.can_end(grammar.run(grammar.start, text)) and not grammar.accepts(text + "\n")


@pytest.mark.parametrize(
    "text",
    [
        "1. How big is it? [needs: none]\n2. What then? [needs: 3]\n",  # forward reference
        "1. How big is it? [needs: none]\n2. What then? [needs: 2]\n",  # self reference
        "How big is it? [needs: none]\n",  # missing number
        "2. How big is it? [needs: none]\n",  # wrong first number
        "1. How big is it? [needs: none]\n3. What then? [needs: 1]\n",  # skipped number
        "0. How big is it? [needs: none]\n",
        "1. How big is it? [needs: 1]\n",  # the first line can need nothing
        "1. A b [needs: none]\n2. C d [needs: none]\n3. E f [needs: 1, 1]\n",  # duplicate id
        "1. A b [needs: none]\n2. C d [needs: none]\n3. E f [needs: 2, 1]\n",  # not increasing
        "1. A b [needs: none]\n2. C d [needs: 01]\n",  # leading zero
        "1. Size? [needs: none]\n",  # one word
        "1. A  b [needs: none]\n",  # double space
        "1.A b [needs: none]\n",  # no space after the period
        "1. ? b [needs: none]\n",  # text starts with punctuation
        "1. A [b] c [needs: none]\n",  # bracket inside the text
        "1. A b [needs:none]\n",
        "1. A b [needs: none]\n\n",  # a plan needs two lines
        "1. A b [needs: none]\n2. C d [needs: 1]\n\nmore",  # text after the end
        "1. A b [needs: none] and more\n",
        "1. " + "w " * 16 + "x [needs: none]\n",  # 17 words
        "1. " + "w" * 25 + " x [needs: none]\n",  # a 25-character word
        "".join(f"{k}. A b [needs: none]\n" for k in range(1, 8)),  # 7 lines
    ],
)
def test_grammar_rejects_malformed_text(text):
    assert PlanGrammar().run(PlanGrammar.start, text) is None


# ---- the lift to tokens ----------------------------------------------------------------------
def _brute_force_mask(constraint: PlanLineConstraint) -> torch.Tensor:
    vocab, grammar = constraint._vocab, constraint.grammar
    if constraint.state == DONE:
        return vocab.eos
    mask = torch.tensor([bool(s) and grammar.run(constraint.state, s) is not None for s in vocab.strings])
    return mask | vocab.eos if grammar.can_end(constraint.state) else mask


def test_token_masks_equal_running_every_token_through_the_grammar(plan_tokenizer):
    kinds = set()
    for seed in range(12):
        rng, constraint = random.Random(seed), PlanLineConstraint(plan_tokenizer)
        while not constraint.is_complete:
            mask = constraint.allowed()
            assert torch.equal(mask, _brute_force_mask(constraint)), (constraint.state, constraint.text)
            kinds.add(constraint.state[0])
            choices = mask.nonzero().flatten().tolist()
            if seed % 2:  # half the walks never end early by EOS: longer plans
                choices = [c for c in choices if c != EOS] or choices
            constraint.advance(rng.choice(choices))
        _assert_valid_plan(constraint.text)
    assert kinds == {"num", "text", "lit", "deps", "id", "idstart", "eol"}


def test_formatted_plans_tokenize_through_the_masks(plan_tokenizer):
    vocab = {s: i for i, s in enumerate(PlanLineConstraint(plan_tokenizer)._vocab.strings) if s}
    for plan in VALID_PLANS:
        text, constraint = format_plan(plan) + "\n\n", PlanLineConstraint(plan_tokenizer)
        while text:  # longest pieces first: they cross the most boundaries
            piece = max((s for s in vocab if text.startswith(s)), key=len)
            assert constraint.allowed()[vocab[piece]], (piece, constraint.text)
            constraint.advance(vocab[piece])
            text = text[len(piece):]
        assert constraint.is_complete and constraint.allowed().nonzero().flatten().tolist() == [EOS]


def test_eos_is_allowed_only_where_the_plan_may_end(plan_tokenizer):
    pieces = ["1. ", "What", " is", " [needs: ", "none", "]\n", "2. How", " much", " [needs: 1]", "\n"]
    ids = [plan_tokenizer.convert_tokens_to_ids(piece) for piece in pieces]
    assert 0 not in ids  # every piece is one token
    constraint, ends = PlanLineConstraint(plan_tokenizer), []
    for token in ids:
        ends.append(bool(constraint.allowed()[EOS]))
        constraint.advance(token)
    # only once the second line is closed: after its ']' (before the newline) and after the newline
    assert ends == [False] * (len(ids) - 1) + [True] and constraint.allowed()[EOS]
    constraint.advance(EOS)
    assert constraint.is_complete


def test_advance_rejects_a_token_the_grammar_does_not_admit(plan_tokenizer):
    constraint = PlanLineConstraint(plan_tokenizer)
    with pytest.raises(ValueError, match="cannot come next"):
        constraint.advance(plan_tokenizer.convert_tokens_to_ids("2"))


def test_sample_respects_masks_greedy_and_sampled():
    logits = torch.tensor([[5.0, 1.0, 0.0, 9.0], [5.0, 1.0, 0.0, 9.0]])
    mask = torch.tensor([False, True, True])  # shorter than the logits: id 3 is disallowed too
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=0)]
    for seed in range(20):
        generators = [None, torch.Generator().manual_seed(seed)]
        greedy, sampled = sample(logits, params, generators, [mask, mask])
        assert greedy == 1 and sampled in (1, 2)
    assert sample(logits[:1], params[:1], [None], [None]) == [3]


# ---- the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{}] + [{"temperature": 1.0, "seed": s} for s in range(4)]
                         + [{"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_engine_decodes_only_valid_plans(plan_engine, sampling):
    [result] = plan_engine().generate([_request("p", max_tokens=900, constraint="plan_lines", **sampling)])
    assert result.finish_reason is FinishReason.STOP
    _assert_valid_plan(result.text)


def test_unconstrained_requests_in_the_batch_are_unaffected(plan_engine):
    free = [_request("g", max_tokens=40), _request("s", max_tokens=40, temperature=1.0, seed=3)]
    alone = [plan_engine(max_batch_size=1).generate([r])[0] for r in free]
    constrained = [_request("c1", max_tokens=900, constraint="plan_lines"),
                   _request("c2", max_tokens=900, constraint="plan_lines", temperature=1.0, seed=5)]
    results = plan_engine(max_batch_size=4).generate([constrained[0], free[0], constrained[1], free[1]])
    assert [r.token_ids for r in (results[1], results[3])] == [r.token_ids for r in alone]
    for result in (results[0], results[2]):
        _assert_valid_plan(result.text)


def test_forced_tokens_jump_forward_to_the_same_plan_in_fewer_steps(plan_engine):
    """A token the constraint forces (e.g. ']' then the newline then the next id) is appended at once
    and computed with the next step: the same greedy plan, fewer engine steps, a batch mate's
    tokens unchanged."""
    free = _request("g", max_tokens=40)
    runs = {}
    for jump in (False, True):
        engine = plan_engine(max_batch_size=4, jump_forward=jump)
        runs[jump] = (engine.generate([_request("c", max_tokens=900, constraint="plan_lines"), free]), engine.stats())
    (stepped, free_stepped), stats_stepped = runs[False]
    (jumped, free_jumped), stats_jumped = runs[True]
    _assert_valid_plan(jumped.text)
    assert jumped.token_ids == stepped.token_ids and jumped.text == stepped.text
    assert free_jumped.token_ids == free_stepped.token_ids
    assert stats_stepped["forced_tokens"] == 0 and stats_jumped["forced_tokens"] > 0
    # the plan outlasts its 40-token batch mate, so it sets the step count: one step fewer per forced token
    assert stats_jumped["steps"] > 41
    assert stats_jumped["steps"] == stats_stepped["steps"] - stats_jumped["forced_tokens"]


def test_drafts_with_forced_tokens_give_the_same_plan_in_fewer_steps(plan_engine):
    """Drafted tokens ride in the pass after the forced ones and are checked against the constrained
    choice: the same plan as plain stepping, and fewer steps than jump-forward alone."""
    runs = {}
    for drafts in (0, 4):
        engine = plan_engine(max_batch_size=2, speculative_tokens=drafts, speculative_min_ngram=1)
        runs[drafts] = (engine.generate([_request("c", max_tokens=900, constraint="plan_lines"),
                                         _request("g", max_tokens=40)]), engine.stats())
    (plain, free_plain), plain_stats = runs[0]
    (drafted, free_drafted), stats = runs[4]
    _assert_valid_plan(drafted.text)
    assert drafted.token_ids == plain.token_ids and free_drafted.token_ids == free_plain.token_ids
    assert stats["forced_tokens"] > 0 and stats["accepted_draft_tokens"] > 0
    assert stats["steps"] < plain_stats["steps"]


def test_resumed_request_continues_the_plan(plan_engine):
    [full] = plan_engine().generate([_request("a", max_tokens=900, constraint="plan_lines")])
    resumed = _request("b", full.token_ids[:9], max_tokens=900, constraint="plan_lines")
    [again] = plan_engine().generate([resumed])
    assert again.token_ids == full.token_ids and again.text == full.text


def test_bad_constraints_fail_at_add_naming_the_field(plan_engine, plan_tokenizer, make_engine, monkeypatch):
    engine = plan_engine()
    with pytest.raises(ValueError, match="constraint: unknown constraint 'nope'"):
        engine.add(_request("x", constraint="nope"))
    monkeypatch.setitem(CONSTRAINTS, "broken", "graph.no_such_module:Nothing")
    with pytest.raises(ValueError, match="^constraint: 'broken'"):
        engine.add(_request("y", constraint="broken"))
    with pytest.raises(ValueError, match="^resume_ids:"):
        engine.add(_request("z", [plan_tokenizer.convert_tokens_to_ids("x")], constraint="plan_lines"))
    assert not engine.has_work()
    # the shared tiny tokenizer has only 4-letter words: it cannot spell "1." at all
    with pytest.raises(ValueError, match="^constraint: 'plan_lines' cannot be used"):
        make_engine().add(GenerationRequest(prompt_ids=[1, 2, 3], params=SamplingParams(constraint="plan_lines")))
