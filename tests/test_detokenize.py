"""Incremental detokenization (engine.detokenize): the text of the deltas is the whole decode, and the
direct backend decode it uses is the tokenizer's own `decode`."""
from __future__ import annotations

import random

from engine.detokenize import IncrementalDetokenizer, _decoder


def test_the_backend_decode_is_the_tokenizers_own(tiny_tokenizer):
    rng = random.Random(0)
    decode = _decoder(tiny_tokenizer)
    for _ in range(50):  # specials (ids 0-2) included: skipped by both
        ids = [rng.randrange(0, len(tiny_tokenizer)) for _ in range(rng.randrange(0, 12))]
        assert decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_through_its_own_decode(tiny_tokenizer):
    calls = []

    class Cleaning:
        clean_up_tokenization_spaces = True
        backend_tokenizer = tiny_tokenizer.backend_tokenizer

        def decode(self, ids, skip_special_tokens=False):
            calls.append(list(ids))
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert _decoder(Cleaning())([7, 8]) == tiny_tokenizer.decode([7, 8], skip_special_tokens=True)
    assert calls == [[7, 8]]


def test_the_deltas_add_up_to_the_whole_decode(tiny_tokenizer):
    rng = random.Random(1)
    ids, detokenizer, deltas = [], IncrementalDetokenizer(tiny_tokenizer), []
    for _ in range(40):
        ids.append(rng.randrange(3, len(tiny_tokenizer)))
        deltas.append(detokenizer.add(ids))
    assert "".join(deltas) == detokenizer.text == tiny_tokenizer.decode(ids, skip_special_tokens=True)
