"""The length predictor's network, training pieces, serving wrapper and metrics, on a tiny model."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from predictor.metrics import length_metrics
from predictor.model import LengthRegressor, PredictorSettings, pad_batch, with_new_adapter
from predictor.predict import LengthPredictor, PredictorConfig
from predictor.train import _padded, length_batches


@pytest.fixture
def regressor(tiny_model):
    torch.manual_seed(0)
    model = LengthRegressor(copy.deepcopy(tiny_model).model, max_tokens=200)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


def sequences(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(6, 256) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def test_cached_lower_layers_then_upper_layers_equal_one_full_pass(regressor):
    ids, mask = pad_batch(sequences(5), pad_id=0)
    full = regressor(ids, mask)
    features = regressor.bottom_features(ids, mask, upto=1)
    assert torch.allclose(regressor.predict_from(features, mask, start=1), full, atol=1e-5)
    assert ((full > 0) & (full < 200)).all()


def test_right_padding_does_not_change_a_prediction(regressor):
    seqs = sequences(4, seed=1)
    ids, mask = pad_batch(seqs, pad_id=0)
    together = regressor(ids, mask)
    for row, seq in enumerate(seqs):
        alone = regressor(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        assert torch.allclose(alone[0], together[row], atol=1e-4)


def test_adapter_is_only_on_the_top_layers_and_off_means_the_plain_model(tiny_model, regressor):
    model = with_new_adapter(regressor, PredictorSettings(max_tokens=200, lora_layers=1, rank=4))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".layers.1." in n or "head" in n for n in names)
    ids, mask = pad_batch(sequences(3, seed=2), pad_id=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)  # make the adapter do something
        with model.disable_adapter():
            plain = model.base_model.model.decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        adapted = model.base_model.model.decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    reference = tiny_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(plain, reference, atol=1e-5)
    assert not torch.allclose(adapted, reference, atol=1e-3)


def test_training_steps_fit_a_length_rule_and_the_saved_adapter_predicts_the_same(tiny_model, tiny_tokenizer,
                                                                                   regressor, tmp_path):
    settings = PredictorSettings(max_tokens=200, lora_layers=1, rank=4)
    model = with_new_adapter(regressor, settings)
    seqs = sequences(32, seed=3)
    targets = torch.tensor([10.0 * len(s) for s in seqs])  # a rule the model can learn: longer prompt, longer answer
    features = [regressor.bottom_features(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), 1)[0] for s in seqs]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def mae():
        with torch.no_grad():
            hidden, mask = _padded(features, list(range(32)))
            return (model.base_model.model.predict_from(hidden, mask, 1) - targets).abs().mean().item()

    before = mae()
    for _ in range(25):
        for group in length_batches([len(s) for s in seqs], 8, random.Random(0)):
            hidden, mask = _padded(features, group)
            loss = (model.base_model.model.predict_from(hidden, mask, 1) - targets[group]).abs().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert mae() < before / 2
    model.eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "settings.json").write_text(settings.model_dump_json())

    predictor = LengthPredictor(copy.deepcopy(tiny_model), tiny_tokenizer,
                                PredictorConfig(adapter=str(tmp_path), batch_size=5))
    got = predictor.predict_ids(seqs)
    with torch.no_grad():
        ids, mask = pad_batch(seqs, pad_id=0)
        expected = model(ids, mask)
    assert got == [max(1, min(200, int(torch.ceil(v)))) for v in expected]
    assert predictor.seconds > 0
    # from decoder prompt ids: the fixed length question is appended, nothing else changes
    suffix = predictor.input.suffix
    assert suffix and predictor.predict_prompt_ids([seqs[0]]) == predictor.predict_ids([seqs[0] + suffix])


def test_predictor_without_an_adapter_names_it(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter"):
        LengthPredictor(tiny_model, object(), PredictorConfig(adapter=str(tmp_path)))


def test_length_batches_group_similar_lengths_and_cover_every_index():
    lengths = [5, 50, 6, 51, 7, 52]
    groups = length_batches(lengths, 3, None)
    assert groups == [[0, 2, 4], [1, 3, 5]]
    shuffled = length_batches(lengths, 2, random.Random(1))
    assert sorted(i for g in shuffled for i in g) == list(range(6))


def test_length_metrics():
    m = length_metrics([100, 40, 300, 10], [90, 100, 120, 10], edges=[32, 64, 128, 256])
    assert m == {"n": 4, "mae": (10 + 60 + 180 + 0) / 4, "within_50": 0.5, "within_100": 0.75,
                 "bin_accuracy": 0.5, "under_rate": 0.25}
    with pytest.raises(ValueError):
        length_metrics([], [], [1])
