"""`python -m bench prediction`'s pieces that need no model: its requests and its summary."""
from __future__ import annotations

from bench.common import load_jsonl
from bench.prediction_bench import edit_request, summary


def test_every_edit_row_has_an_instruction_and_a_text_to_write_again():
    rows = load_jsonl("edits.jsonl")
    assert len(rows) == 8
    for row in rows:
        assert row["instruction"].strip() and row["text"].strip()


def test_only_the_prediction_variant_sends_the_text_as_its_prediction():
    row = {"instruction": "Rename x to y.", "text": "x = 1\n"}
    predicted, plain = edit_request(row, 32, True), edit_request(row, 32, False)
    assert predicted.prediction.text == "x = 1\n" and plain.prediction is None
    assert predicted.messages == plain.messages and "x = 1" in plain.messages[0].content
    assert predicted.temperature == 0 and predicted.max_tokens == 32


def test_the_summary_adds_tokens_and_prediction_counts_and_rates_tokens_over_all_seconds():
    runs = [{"seconds": 1.0, "tokens": 30, "accepted": 10, "rejected": 2},
            {"seconds": 3.0, "tokens": 50, "accepted": 0, "rejected": 4}]
    assert summary(runs) == {"seconds_mean": 2.0, "tokens": 80, "tok_s": 20.0, "accepted": 10, "rejected": 6}
