"""`python -m bench steps` and the random-weight models it times (bench/random_model.py)."""
from __future__ import annotations

import json

import pytest
import torch

from bench import common, random_model, step_bench


def test_the_word_tokenizer_decodes_every_id():
    tokenizer = random_model.word_tokenizer(6000)  # past the 4,900 two-syllable words
    assert len(tokenizer) == 6000 and tokenizer.eos_token_id == random_model.EOS_ID
    words = tokenizer.decode([3, 4899 + 3, 5999]).split()
    assert len(words) == 3 and len(set(words)) == 3
    assert tokenizer.convert_tokens_to_ids(words) == [3, 4902, 5999]


def test_an_unknown_shape_is_refused_by_name():
    with pytest.raises(ValueError, match="shape: 'gpt-5'"):
        random_model.random_model("gpt-5", torch.device("cpu"), torch.float32)


def test_steps_times_the_eager_engine_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    result = step_bench.run(["--shape", "smollm2-135m", "--batch-sizes", "1,2", "--prompt-tokens", "16",
                             "--new-tokens", "3", "--repeats", "1"])
    assert result["device"] == "cpu" and result["graphs_captured"] is None
    for batch in ("1", "2"):  # no graphs without CUDA: the eager engine alone
        entry = result["batches"][batch]
        assert entry["eager_ms_per_step"] > 0 and "graphs_ms_per_step" not in entry
        assert entry["prefill_per_item_ms"] > 0 and entry["prefill_grouped_ms"] > 0
        tok_s = int(batch) * 1000 / entry["eager_ms_per_step"]
        assert entry["eager_tok_s"] == pytest.approx(tok_s, rel=0.02, abs=0.1)  # tok/s is kept to 0.1
    assert json.loads((tmp_path / "steps_smollm2-135m.json").read_text())["batches"] == result["batches"]
