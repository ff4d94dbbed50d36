"""The length predictor's network, training pieces, serving wrapper and metrics, on a tiny model."""
from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch

from predictor.metrics import length_metrics, rank_correlation
from predictor.model import (LengthRegressor, PredictorSettings, PromptKV, pad_batch, predict_lengths, prefill,
                             suffix_features, with_new_adapter)
from predictor.predict import LengthPredictor, PredictorConfig
from predictor.prompt import PredictionInput
from predictor.train import WeightAverage, advanced, batch_lengths, length_batches

SUFFIX = [7, 8, 9, 10, 11]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from threads, and on a shared CPU waiting for them costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def regressor(tiny_model):
    torch.manual_seed(0)
    model = LengthRegressor(copy.deepcopy(tiny_model).model, max_tokens=200)
    torch.nn.init.normal_(model.head.weight, std=0.05)
    return model


def adapted(regressor, lora_layers=1):
    """A new adapter on the top layer(s), nudged so that it changes what the model computes."""
    model = with_new_adapter(regressor, PredictorSettings(max_tokens=200, lora_layers=lora_layers, rank=4)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.3)
    return model


@pytest.fixture
def saved(tiny_model, regressor, tmp_path):
    """A saved adapter and a LengthPredictor on a fresh copy of the tiny model loading it."""
    settings = PredictorSettings(max_tokens=200, lora_layers=1, rank=4)
    adapted(regressor).save_pretrained(tmp_path)
    (tmp_path / "settings.json").write_text(settings.model_dump_json())
    return tmp_path


def predictor_on(tiny_model, tiny_tokenizer, folder, batch_size=16) -> LengthPredictor:
    return LengthPredictor(copy.deepcopy(tiny_model), tiny_tokenizer,
                           PredictorConfig(adapter=str(folder), batch_size=batch_size))


def sequences(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(12, 256) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def two_pass(model, prompts):
    kv, _ = prefill(model, *pad_batch(prompts, pad_id=0))
    return predict_lengths(model, kv, torch.tensor([SUFFIX] * len(prompts)))


def test_the_head_is_made_where_the_decoder_is(tiny_model):
    """A GPU replica's decoder is on cuda: a head left on the CPU fails its first prediction
    (seen on an H200). The meta device stands in for cuda here."""
    decoder = copy.deepcopy(tiny_model).model.to(device="meta", dtype=torch.bfloat16)
    head = LengthRegressor(decoder, max_tokens=200).head
    assert head.weight.device.type == "meta" and head.weight.dtype == torch.float32


def test_batched_predictions_equal_one_at_a_time(regressor):
    model = adapted(regressor)
    prompts = sequences(6, seed=1)
    together = two_pass(model, prompts)
    alone = torch.cat([two_pass(model, [p]) for p in prompts])
    assert torch.allclose(together, alone, atol=1e-4)
    assert ((together > 0) & (together < 200)).all() and together.std() > 1e-3


def test_the_prompt_pass_is_the_plain_model_and_the_suffix_pass_is_adapted(tiny_model, regressor):
    model = adapted(regressor)
    prompts = sequences(4, seed=2)
    kv, _ = prefill(model, *pad_batch(prompts, pad_id=0))
    for (keys, values), prompt in zip(kv.rows(), prompts):
        plain = tiny_model.model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
        assert keys.shape == (2, 2, len(prompt), 16)  # [layers, kv_heads, tokens, head_dim]
        assert torch.allclose(keys, torch.stack([layer.keys[0] for layer in plain.layers]), atol=1e-5)
        assert torch.allclose(values, torch.stack([layer.values[0] for layer in plain.layers]), atol=1e-5)
    # the suffix does run through the adapter: with it off the same forward gives other lengths
    with model.disable_adapter():
        plain_lengths = predict_lengths(model, kv, torch.tensor([SUFFIX] * len(prompts)))
    assert not torch.allclose(predict_lengths(model, kv, torch.tensor([SUFFIX] * len(prompts))), plain_lengths,
                              atol=1e-2)


def test_a_prompt_prefilled_in_two_parts_or_restacked_predicts_the_same(regressor):
    model = adapted(regressor)
    prompts = sequences(5, seed=3)
    suffix = torch.tensor([SUFFIX] * len(prompts))
    whole = two_pass(model, prompts)
    first, _ = prefill(model, *pad_batch([p[: len(p) // 2] for p in prompts], pad_id=0))
    both, _ = prefill(model, *pad_batch([p[len(p) // 2 :] for p in prompts], pad_id=0), first)
    assert torch.allclose(predict_lengths(model, both, suffix), whole, atol=1e-4)
    restacked = PromptKV.stack(regressor.decoder.config, both.rows())
    assert torch.allclose(predict_lengths(model, restacked, suffix), whole, atol=1e-4)
    assert torch.allclose(predict_lengths(model, restacked, suffix), whole, atol=1e-4)  # the suffix left no KV behind


def test_training_features_then_top_layers_equal_the_full_two_pass_forward(regressor):
    model = adapted(regressor, lora_layers=1)
    prompts = sequences(5, seed=4)
    rows, hidden = suffix_features(regressor, *pad_batch(prompts, pad_id=0), torch.tensor([SUFFIX] * 5), start=1)
    assert rows[0][0].shape[0] == 1  # only the top layer's KV is kept
    features = [{"keys": k.half(), "values": v.half(), "suffix": h} for (k, v), h in zip(rows, hidden)]
    with torch.no_grad():
        cached = batch_lengths(model, features, list(range(5)), start=1)
    assert torch.allclose(cached, two_pass(model, prompts), atol=0.05)  # the KV was stored in float16
    # features cached for more LoRA layers serve fewer: the question moves on through the plain layers
    rows, hidden = suffix_features(regressor, *pad_batch(prompts, pad_id=0), torch.tensor([SUFFIX] * 5), start=0)
    lower = [{"keys": k, "values": v, "suffix": h} for (k, v), h in zip(rows, hidden)]
    moved = advanced(regressor, lower, 0, 1, batch_size=2)
    with torch.no_grad():
        assert torch.allclose(batch_lengths(model, moved, list(range(5)), start=1), two_pass(model, prompts), atol=1e-4)


def length_rule_features(regressor, tokenizer):
    """32 prompts, targets by a rule the model can learn (longer prompt, longer answer), the length
    question, and the training features of the top layer."""
    prompts = sequences(32, seed=5)
    targets = torch.tensor([10.0 * len(p) for p in prompts])
    question = PredictionInput(tokenizer).suffix
    rows, hidden = suffix_features(regressor, *pad_batch(prompts, pad_id=0), torch.tensor([question] * 32), start=1)
    return prompts, targets, question, [{"keys": k, "values": v, "suffix": h} for (k, v), h in zip(rows, hidden)]


def test_training_steps_fit_a_length_rule_and_the_saved_adapter_predicts_the_same(tiny_model, tiny_tokenizer,
                                                                                   regressor, tmp_path):
    settings = PredictorSettings(max_tokens=200, lora_layers=1, rank=4)
    model = with_new_adapter(regressor, settings)
    prompts, targets, question, features = length_rule_features(regressor, tiny_tokenizer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def mae():
        with torch.no_grad():
            return (batch_lengths(model, features, list(range(32)), 1) - targets).abs().mean().item()

    before = mae()
    model.train()
    for _ in range(25):
        for group in length_batches([len(p) for p in prompts], 8, random.Random(0)):
            loss = (batch_lengths(model, features, group, 1) - targets[group]).abs().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    assert mae() < before / 2
    model.save_pretrained(tmp_path)
    (tmp_path / "settings.json").write_text(settings.model_dump_json())

    predictor = predictor_on(tiny_model, tiny_tokenizer, tmp_path, batch_size=5)
    got = predictor.predict_ids([p + question for p in prompts])
    with torch.no_grad():
        expected = batch_lengths(model, features, list(range(32)), 1)
    assert got == [max(1, min(200, int(torch.ceil(v)))) for v in expected]
    assert predictor.seconds > 0
    assert predictor.predict_prompt_ids([prompts[0]]) == [got[0]]
    with pytest.raises(ValueError, match="length question"):
        predictor.predict_ids([prompts[0]])


def test_given_kv_gives_the_same_lengths_and_the_returned_kv_is_the_engines_own(tiny_model, tiny_tokenizer, saved,
                                                                                make_engine):
    predictor = predictor_on(tiny_model, tiny_tokenizer, saved, batch_size=3)
    prompts = sequences(7, seed=6)
    lengths, entries = predictor.predict_with_kv(prompts)
    assert lengths == predictor.predict_prompt_ids(prompts)
    engine = make_engine()
    for prompt, entry in zip(prompts, entries):
        assert entry.token_ids == tuple(prompt)
        engine.prefill_prefix(prompt)
        own = engine.export_prefix(prompt)
        # the lean prompt pass is the engine's own forward: the same bits, packed with other prompts or not
        assert torch.equal(entry.kv[0], own.kv[0]) and torch.equal(entry.kv[1], own.kv[1])
        assert torch.equal(entry.last_logits, own.last_logits)
    # whole prompts handed in, leading parts handed in (from the engine), and a mix with none
    assert predictor.predict_prompt_ids(prompts, prefixes=entries) == lengths
    parts = []
    for prompt in prompts[:4]:
        engine.prefill_prefix(prompt[:2])
        parts.append(engine.export_prefix(prompt[:2]))
    assert predictor.predict_prompt_ids(prompts, prefixes=parts + [None, entries[5], None]) == lengths
    again, shared = predictor.predict_with_kv(prompts, prefixes=parts + [None, entries[5], None])
    assert again == lengths and shared[5] is entries[5]
    assert all(torch.allclose(a.kv[0], b.kv[0], atol=1e-5) for a, b in zip(shared, entries))
    with pytest.raises(ValueError, match="prefix"):
        predictor.predict_prompt_ids(prompts[:1], prefixes=[entries[1]])


def test_a_long_prompt_is_cut_and_only_its_own_leading_part_is_returned(tiny_model, tiny_tokenizer, saved):
    predictor = predictor_on(tiny_model, tiny_tokenizer, saved)
    predictor.input.max_tokens = 24  # keeps the first 8 tokens and the last 16
    prompt = sequences(1, seed=7)[0] * 3
    assert len(prompt) > 24
    [length], [entry] = predictor.predict_with_kv([prompt])
    assert entry.token_ids == tuple(prompt[:8]) and entry.kv[0].shape[2] == 8
    [alone], [head] = predictor.predict_with_kv([prompt[:8]])
    assert torch.allclose(entry.kv[0], head.kv[0], atol=1e-5)
    assert torch.allclose(entry.last_logits, head.last_logits, atol=1e-4)
    assert predictor.predict_prompt_ids([prompt], prefixes=[entry]) == [length]


def test_an_adapter_trained_on_the_prompt_too_is_refused(tiny_model, tiny_tokenizer, saved):
    settings = json.loads((saved / "settings.json").read_text())
    del settings["adapter_on"]  # what adapters saved before the suffix-only forward look like
    (saved / "settings.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="Retrain"):
        predictor_on(tiny_model, tiny_tokenizer, saved)


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
                 "bin_accuracy": 0.5, "under_rate": 0.25, "rank_correlation": 0.8}  # 1 - 6 x (1 + 1) / (4 x 15)
    assert rank_correlation([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)  # ties share a rank
    assert rank_correlation([5, 5, 5], [1, 2, 3]) == 0.0
    assert rank_correlation([3, 1, 2], [10, 30, 20]) == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        length_metrics([], [], [1])


def test_the_hf_passes_give_the_same_lengths_and_kv_as_the_lean_ones(tiny_model, tiny_tokenizer, saved):
    lean = predictor_on(tiny_model, tiny_tokenizer, saved, batch_size=3)
    hf = LengthPredictor(copy.deepcopy(tiny_model), tiny_tokenizer,
                         PredictorConfig(adapter=str(saved), batch_size=3, prompt_pass="hf"))
    assert hf.lean is None and lean.lean is not None
    layers = len(tiny_model.model.layers)
    assert lean.lean.first_adapted == layers - 1  # lora_layers=1: only the top layer's suffix copy differs
    assert lean.lean.suffix_layers[: layers - 1] == lean.lean.runner.layers[: layers - 1]
    assert lean.lean.suffix_layers[-1] is not lean.lean.runner.layers[-1]
    prompts = sequences(7, seed=8)
    lengths, expected, entries = lean.estimate_with_kv(prompts)
    hf_lengths, hf_expected, hf_entries = hf.estimate_with_kv(prompts)
    assert sum(abs(a - b) for a, b in zip(lengths, hf_lengths)) <= 1  # float rounding at most, on one
    assert expected == pytest.approx(hf_expected, rel=1e-4)  # the suffix through merged LoRA copies
    for a, b in zip(entries, hf_entries):
        assert a.token_ids == b.token_ids
        assert torch.allclose(a.kv[0], b.kv[0], atol=1e-4) and torch.allclose(a.last_logits, b.last_logits, atol=1e-3)
    # a suffix packed apart from its prompt (a later forward) reads the same KV: the same estimates
    lean.lean.PACK_TOKENS = 4
    assert lean.estimate_with_kv(prompts)[1] == pytest.approx(expected, rel=1e-5)
    # and the adapter is what makes them: its suffix layers swapped for the plain ones, they change
    lean.lean.suffix_layers = lean.lean.runner.layers
    assert max(abs(a - b) for a, b in zip(lean.estimate_with_kv(prompts)[1], expected)) > 1.0


def test_the_lean_pass_with_grouped_attention_gives_the_same_estimates_and_kv(tiny_model, tiny_tokenizer, saved):
    """Off the CPU the prompt pass groups its prompts' and questions' attention by length
    (engine.item_attention): the same lengths, and estimates and KV to float rounding."""
    per_item = predictor_on(tiny_model, tiny_tokenizer, saved, batch_size=4)
    grouped = predictor_on(tiny_model, tiny_tokenizer, saved, batch_size=4)
    grouped.lean.runner.batched_item_attention = True
    prompts = sequences(9, seed=11)
    lengths, expected, entries = per_item.estimate_with_kv(prompts)
    got_lengths, got_expected, got_entries = grouped.estimate_with_kv(prompts)
    assert got_lengths == lengths and got_expected == pytest.approx(expected, rel=1e-5)
    for a, b in zip(got_entries, entries):
        assert torch.allclose(a.kv[0], b.kv[0], atol=1e-5) and torch.allclose(a.last_logits, b.last_logits, atol=1e-4)


def test_the_lean_prompt_pass_packs_prompts_and_refuses_what_it_cannot_hold(tiny_model, tiny_tokenizer, saved):
    from predictor.predict import LeanPromptPass, _packs
    from engine.llama import PrefillItem

    items = [PrefillItem(i, [5] * n, 0) for i, n in enumerate([3, 4, 9, 2, 2])]
    assert [[it.slot for it in pack] for pack in _packs(items, 8)] == [[0, 1], [2], [3, 4]]
    lean = LeanPromptPass(copy.deepcopy(tiny_model), slots=2, max_len=16)
    with pytest.raises(ValueError, match="at most 2"):
        lean.run([[5, 6]] * 3, [2] * 3, [None] * 3, [0] * 3)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        lean.run([[5] * 17], [17], [None], [0])


def test_weight_average_is_the_mean_of_the_snapshots_and_survives_a_checkpoint(regressor):
    model = adapted(regressor)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    snapshots = []
    average = WeightAverage(model)
    for step in range(3):
        with torch.no_grad():
            for param in trainable.values():
                param.add_(torch.randn_like(param))
        snapshots.append({n: p.detach().clone() for n, p in trainable.items()})
        average.add(model)
        if step == 1:  # as a resumed run does: the average goes through the checkpoint and back
            restored = WeightAverage(model)
            restored.load(average.state())
            average = restored
    average.apply(model)
    for name, param in trainable.items():
        torch.testing.assert_close(param, sum(s[name] for s in snapshots) / 3)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert average.count == 3 and set(average.mean) == set(trainable)


def test_bucket_readout_classes_targets_and_reach_count_whole_token_lengths():
    from predictor.model import BucketReadout

    readout = BucketReadout(max_tokens=100, width=8, smoothing=8.0)
    assert readout.outputs == 14  # 13 buckets (the last holds 96..99) and "cut at 100"
    labels = torch.tensor([0.0, 7, 8, 50, 97, 100])
    assert readout.classes(labels).tolist() == [0, 0, 1, 6, 12, 13]
    targets = readout.targets(labels)
    assert torch.allclose(targets.sum(dim=1), torch.ones(6))
    assert targets.argmax(dim=1).tolist() == [0, 0, 1, 6, 12, 13]
    assert (targets[3, 5:8] > 0.1).all() and targets[3, 0] < 1e-6  # spread to neighbours, not far
    # probability within 50 and within 100 of each candidate, counted over the whole lengths of each class
    probabilities = torch.softmax(torch.randn(14, generator=torch.Generator().manual_seed(0)), dim=0)
    per_length = {}
    for k in range(13):
        members = [y for y in range(100) if y // 8 == k]
        for y in members:
            per_length[y] = probabilities[k].item() / len(members)
    per_length[100] = probabilities[13].item()
    for candidate in (1, 30, 64, 100):
        brute = sum(p for y, p in per_length.items() if abs(y - candidate) <= 50)
        brute += sum(p for y, p in per_length.items() if abs(y - candidate) <= 100)
        assert (probabilities @ readout.reach[candidate - 1]).item() == pytest.approx(brute, abs=1e-5)


def test_bucket_readout_reads_the_length_the_distribution_supports_most():
    from predictor.model import BucketReadout

    readout = BucketReadout(max_tokens=256, width=8, smoothing=16.0)
    logits = torch.full((4, readout.outputs), -20.0)
    logits[0, 2] = 5  # all in 16..23
    logits[1, -1] = 5  # all cut at the cap: the cap itself, not merely a length within 50 of it
    logits[2, 2], logits[2, -1] = 5, 5.5  # short or cut, cut a little likelier: not the median between them
    logits[3, 10], logits[3, 11], logits[3, 12] = 5, 5, 5  # spread over 80..103
    lengths = readout.lengths(logits).tolist()
    assert 16 <= lengths[0] <= 23
    assert lengths[1] == 256
    assert lengths[2] >= 206
    assert 80 <= lengths[3] <= 103
    assert readout.loss(logits[:1], torch.tensor([20.0])) < readout.loss(logits[:1], torch.tensor([200.0]))
    # for any distribution the length read out is one that the most probability lies within 50 and 100 of
    random = torch.randn(6, readout.outputs, generator=torch.Generator().manual_seed(1)) * 3
    lengths = readout.lengths(random)
    probabilities = torch.softmax(random, dim=-1)
    per_length = torch.cat([probabilities[:, :-1].repeat_interleave(8, dim=1) / 8, probabilities[:, -1:]], dim=1)
    ys = torch.arange(257.0)
    for row in range(6):
        score = torch.stack([per_length[row][(ys - c).abs() <= 50].sum() + per_length[row][(ys - c).abs() <= 100].sum()
                             for c in range(1, 257)])
        assert score[int(lengths[row]) - 1] >= score.max() - 1e-4


def test_the_expected_length_is_the_mean_of_the_distribution_and_lies_between_short_and_cut():
    from predictor.model import BucketReadout, RegressionReadout

    readout = BucketReadout(max_tokens=256, width=8, smoothing=16.0)
    logits = torch.full((3, readout.outputs), -30.0)
    logits[0, 2] = 5  # all in 16..23: its middle
    logits[1, -1] = 5  # all cut: the cap
    logits[2, 2], logits[2, -1] = 5, 5.5  # short or cut: the window read-out picks cut, the mean lies between
    short = math.exp(5) / (math.exp(5) + math.exp(5.5))
    assert readout.expected(logits).tolist() == pytest.approx([19.5, 256, short * 19.5 + (1 - short) * 256])
    assert readout.expected(logits)[2] < readout.lengths(logits)[2]
    one_unit = RegressionReadout(max_tokens=256)
    out = torch.tensor([[0.3], [-2.0]])
    assert torch.equal(one_unit.expected(out), one_unit.lengths(out))  # its one length serves for both


def test_a_bucket_head_trains_saves_and_serves_the_lengths_it_was_trained_to(tiny_model, tiny_tokenizer, tmp_path):
    from predictor.model import readout_for
    from predictor.train import batch_output

    settings = PredictorSettings(max_tokens=200, lora_layers=1, rank=4, head="buckets", bucket_width=20,
                                 bucket_smoothing=20.0)
    torch.manual_seed(0)
    regressor = LengthRegressor(copy.deepcopy(tiny_model).model, 200, readout_for(settings))
    assert regressor.head.out_features == 11
    model = with_new_adapter(regressor, settings)
    prompts, targets, question, features = length_rule_features(regressor, tiny_tokenizer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def within_50():
        with torch.no_grad():
            return ((batch_lengths(model, features, list(range(32)), 1) - targets).abs() <= 50).float().mean().item()

    before = within_50()
    model.train()
    for _ in range(25):
        for group in length_batches([len(p) for p in prompts], 8, random.Random(0)):
            loss = regressor.readout.loss(batch_output(model, features, group, 1), targets[group])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    assert within_50() > max(before, 0.8)
    model.save_pretrained(tmp_path)
    (tmp_path / "settings.json").write_text(settings.model_dump_json())

    predictor = predictor_on(tiny_model, tiny_tokenizer, tmp_path, batch_size=5)
    assert predictor.regressor.head.out_features == 11
    with torch.no_grad():
        expected = batch_lengths(model, features, list(range(32)), 1)
    assert predictor.predict_ids([p + question for p in prompts]) == [int(v) for v in expected]
    lengths, means, entries = predictor.estimate_with_kv(prompts)
    with torch.no_grad():
        out = batch_output(model, features, list(range(32)), 1)
    assert lengths == [int(v) for v in expected] and len(entries) == len(prompts)
    assert means == pytest.approx(regressor.readout.expected(out).tolist(), abs=1e-2)
    assert means != pytest.approx([float(v) for v in lengths], abs=1e-2)  # not the served lengths again


def test_an_adapter_saved_before_bucket_heads_loads_as_a_regression_head(tiny_model, tiny_tokenizer, saved):
    settings = json.loads((saved / "settings.json").read_text())
    del settings["head"], settings["bucket_width"], settings["bucket_smoothing"]
    (saved / "settings.json").write_text(json.dumps(settings))
    assert PredictorSettings.load(saved).head == "regression"
    predictor = predictor_on(tiny_model, tiny_tokenizer, saved)
    assert predictor.regressor.head.out_features == 1
    lengths, means, _ = predictor.estimate_with_kv(sequences(3, seed=9))
    assert all(1 <= n <= 200 for n in lengths)
    assert lengths == [max(1, min(200, math.ceil(m))) for m in means]
