"""Held-out evaluation of the length predictor against two baselines, on the labels' `val` split.

    python -m predictor.eval [--limit N]

- `lora`: the trained adapter (predictor.train) on the serving model.
- `zero_shot`: the serving model asked, before answering, how many words its answer will take
  (the number read from its reply, times 4/3 tokens a word; no number counts as a failure and
  gets half of max_tokens).
- `pooled_ridge`: ridge regression on the base model's final hidden state, mean-pooled over the
  same prompt + instruction, fitted on `train` rows.
- `lora_expected`: the adapter's expected length (the mean of a bucket head's distribution), which
  the benchmark's shortest-first policy orders by; `rank_correlation` tells how well each orders.
Also the cost, as predictor seconds per request over the decode seconds of that request's answer
(decode throughput measured on the same machine in the same run), two ways: `predict_over_decode`
with the prompt's KV handed in (only the length question runs: the serving cost once the decoder's
prompt KV is shared) and `predict_with_prompt_over_decode` with the prompt prefilled too. Writes
bench/results/predictor.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import load_hf_model, resolve_model_dir
from engine.types import GenerationRequest, SamplingParams
from predictor.labels import DEFAULT_OUT as DEFAULT_LABELS
from predictor.labels import read_labels
from predictor.metrics import length_metrics
from predictor.model import pad_batch
from predictor.predict import DEFAULT_ADAPTER, LengthPredictor, PredictorConfig
from predictor.prompt import MAX_PROMPT_TOKENS, chat_prompt_ids, prediction_ids

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "predictor.json"
ZERO_SHOT_QUESTION = ("\n\nDo not answer yet. About how many words will your answer to the message above have? "
                      "Reply with a single number.")
TOKENS_PER_WORD = 4 / 3


def zero_shot(engine: LLMEngine, prompts: list[str], max_tokens: int) -> tuple[list[float], int]:
    requests = []
    for i, prompt in enumerate(prompts):
        text = engine.tokenizer.decode(engine.encode(prompt)[:MAX_PROMPT_TOKENS]) + ZERO_SHOT_QUESTION
        ids = engine.encode_chat([{"role": "user", "content": text}])
        requests.append(GenerationRequest(id=str(i), prompt_ids=ids, params=SamplingParams(max_tokens=8)))
    predictions, failures = [], 0
    for result in engine.generate(requests):
        number = re.search(r"\d+", result.text.replace(",", ""))
        if number is None:
            failures += 1
            predictions.append(max_tokens / 2)
        else:
            predictions.append(min(max_tokens, int(number.group()) * TOKENS_PER_WORD))
    return predictions, failures


@torch.no_grad()
def pooled_states(decoder, sequences: list[list[int]], pad_id: int, batch: int = 16) -> torch.Tensor:
    pooled = torch.zeros(len(sequences), decoder.config.hidden_size)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for first in range(0, len(order), batch):
        group = order[first : first + batch]
        ids, mask = pad_batch([sequences[i] for i in group], pad_id)
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        means = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        pooled[group] = means
    return pooled


def ridge_fit_predict(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, alpha: float = 1.0):
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    a = torch.cat([(train_x - mean) / std, torch.ones(len(train_x), 1)], 1).double()
    b = torch.cat([(test_x - mean) / std, torch.ones(len(test_x), 1)], 1).double()
    eye = torch.eye(a.shape[1], dtype=torch.double)
    eye[-1, -1] = 0  # no penalty on the intercept
    weights = torch.linalg.solve(a.T @ a + alpha * len(a) * eye, a.T @ train_y.double())
    return (b @ weights).float()


def decode_seconds_per_token(engine: LLMEngine, prompts: list[str], max_tokens: int) -> float:
    """Machine seconds per generated token when the engine decodes these prompts together."""
    requests = [GenerationRequest(prompt_ids=engine.encode_chat([{"role": "user", "content": p}]),
                                  params=SamplingParams(max_tokens=max_tokens, stop_on_loop=True)) for p in prompts]
    started = time.perf_counter()
    tokens = sum(r.completion_tokens for r in engine.generate(requests))
    return (time.perf_counter() - started) / max(tokens, 1)


def evaluate(args: argparse.Namespace) -> dict:
    rows = read_labels(args.labels, args.parts)
    val = [r for r in rows if r["split"] == "val"][: args.limit]
    train = [r for r in rows if r["split"] == "train"][: args.ridge_train]
    max_tokens = max(r["max_tokens"] for r in rows)
    actual = [r["label"] for r in val]
    hf_model, tokenizer = load_hf_model(resolve_model_dir(args.model), torch.float32, torch.device("cpu"))
    engine = LLMEngine(hf_model, tokenizer, EngineConfig(model=args.model, max_batch_size=16, max_model_len=1024))
    labels = args.labels.resolve()
    shown = labels.relative_to(RESULTS.parents[2]) if labels.is_relative_to(RESULTS.parents[2]) else labels
    report: dict = {"labels": str(shown), "label_parts": args.parts, "val_prompts": len(val), "max_tokens": max_tokens,
                    "edges": args.edges}

    print(f"baseline zero_shot on {len(val)} prompts", flush=True)
    guesses, failures = zero_shot(engine, [r["prompt"] for r in val], max_tokens)
    report["zero_shot"] = {**length_metrics(guesses, actual, args.edges), "no_number_rate": round(failures / len(val), 3)}

    print(f"baseline pooled_ridge (fitted on {len(train)} train prompts)", flush=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_x = pooled_states(hf_model.model, [prediction_ids(tokenizer, r["prompt"]) for r in train], pad_id)
    val_x = pooled_states(hf_model.model, [prediction_ids(tokenizer, r["prompt"]) for r in val], pad_id)
    ridge = ridge_fit_predict(train_x, torch.tensor([float(r["label"]) for r in train]), val_x).clamp(1, max_tokens)
    report["pooled_ridge"] = length_metrics(ridge.tolist(), actual, args.edges)

    print("lora predictor", flush=True)
    predictor = LengthPredictor(hf_model, tokenizer, PredictorConfig(adapter=str(args.adapter)))
    predicted = predictor.predict([r["prompt"] for r in val])
    with_prompt = predictor.seconds / len(val)
    report["lora"] = length_metrics(predicted, actual, args.edges)

    print("lora predictor again, with each prompt's KV handed in", flush=True)
    prompt_ids = [chat_prompt_ids(tokenizer, r["prompt"]) for r in val]
    _, expected, entries = predictor.estimate_with_kv(prompt_ids)
    report["lora_expected"] = length_metrics(expected, actual, args.edges)
    predictor.seconds = 0.0
    again = predictor.predict_prompt_ids(prompt_ids, prefixes=entries)
    suffix_only = predictor.seconds / len(val)

    print("cost: decode throughput on a batch of 16 val prompts", flush=True)
    seconds_per_token = decode_seconds_per_token(engine, [r["prompt"] for r in val[:16]], max_tokens)
    decode_per_request = seconds_per_token * sum(actual) / len(actual)
    report["cost"] = {"predict_s_per_request": round(suffix_only, 4),
                      "predict_with_prompt_s_per_request": round(with_prompt, 4),
                      "decode_s_per_request": round(decode_per_request, 3),
                      "predict_over_decode": round(suffix_only / decode_per_request, 4),
                      "predict_with_prompt_over_decode": round(with_prompt / decode_per_request, 4),
                      "same_lengths_with_kv_handed_in": round(sum(a == b for a, b in zip(again, predicted)) / len(val),
                                                              3)}
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--parts", type=int, default=None, help="only the first N label parts (default: all)")
    parser.add_argument("--adapter", type=Path, default=DEFAULT_ADAPTER)
    parser.add_argument("--model", default=EngineConfig().model)
    parser.add_argument("--limit", type=int, default=None, help="evaluate on the first N val prompts only")
    parser.add_argument("--ridge-train", type=int, default=1000, help="train prompts the ridge baseline is fitted on")
    parser.add_argument("--edges", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128, 256])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = evaluate(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    names = ("zero_shot", "pooled_ridge", "lora", "lora_expected")
    width = max(map(len, names))
    print(f"{'':{width}}  {'MAE':>6} {'<=50':>6} {'<=100':>6} {'bin acc':>8} {'under':>6} {'rank r':>6}")
    for name in names:
        m = report[name]
        print(f"{name:{width}}  {m['mae']:6.1f} {m['within_50']:6.3f} {m['within_100']:6.3f} "
              f"{m['bin_accuracy']:8.3f} {m['under_rate']:6.3f} {m['rank_correlation']:6.3f}")
    cost = report["cost"]
    print(f"cost: prediction = {cost['predict_over_decode']:.2%} of the decode time it schedules with the prompt's "
          f"KV shared, {cost['predict_with_prompt_over_decode']:.2%} with the prompt prefilled for it")


if __name__ == "__main__":
    main()
