"""Train the length predictor's LoRA adapter on the committed labels.

    python -m predictor.train                      # writes predictor/adapters/<model>/

Resumable at two points: the frozen lower layers' output for each training prompt is computed once
and cached in parts under --work, and every epoch ends with a checkpoint there; a rerun picks up
from both. The split is the labels' own fixed hash split; only `train` rows are used here.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.loader import default_cache_dir, load_hf_model, resolve_model_dir
from predictor.labels import DEFAULT_OUT as DEFAULT_LABELS
from predictor.labels import read_labels
from predictor.metrics import length_metrics
from predictor.model import LengthRegressor, PredictorSettings, pad_batch, with_new_adapter
from predictor.predict import DEFAULT_ADAPTER
from predictor.prompt import prediction_ids

DEFAULT_EDGES = [32, 64, 128, 256]


def length_batches(lengths: list[int], batch_size: int, rng: random.Random | None) -> list[list[int]]:
    """Indices grouped by similar length (little padding); the order of groups shuffled if rng."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if rng is not None:
        rng.shuffle(groups)
    return groups


def cached_features(regressor: LengthRegressor, sequences: list[list[int]], upto: int, work: Path,
                    batch_size: int, pad_id: int) -> list[torch.Tensor]:
    """Hidden states entering layer `upto`, one [len, hidden] float16 tensor a prompt, cached in
    parts so that an interrupted run keeps what it computed."""
    work.mkdir(parents=True, exist_ok=True)
    features: list[torch.Tensor | None] = [None] * len(sequences)
    groups = length_batches([len(s) for s in sequences], batch_size, None)
    per_part, started = 16, time.perf_counter()
    for first in range(0, len(groups), per_part):
        part = work / f"features-{upto}-{first // per_part:05d}.pt"
        chunk = groups[first : first + per_part]
        if part.exists():
            stored = torch.load(part)
        else:
            stored = {}
            for group in chunk:
                ids, mask = pad_batch([sequences[i] for i in group], pad_id)
                hidden = regressor.bottom_features(ids, mask, upto).to(torch.float16)
                for row, i in enumerate(group):
                    stored[i] = hidden[row, : len(sequences[i])].clone()
            torch.save(stored, part)
            done = min(first + per_part, len(groups))
            rate = done / (time.perf_counter() - started)
            print(f"features {done}/{len(groups)} batches  ETA {(len(groups) - done) / rate:.0f} s", flush=True)
        for i, tensor in stored.items():
            features[i] = tensor
    return features  # type: ignore[return-value]


def _padded(features: list[torch.Tensor], group: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(features[i].shape[0] for i in group)
    hidden = torch.zeros(len(group), width, features[group[0]].shape[1])
    mask = torch.zeros(len(group), width, dtype=torch.long)
    for row, i in enumerate(group):
        hidden[row, : features[i].shape[0]] = features[i].float()
        mask[row, : features[i].shape[0]] = 1
    return hidden, mask


def predict_cached(model, features: list[torch.Tensor], start: int, batch_size: int) -> list[float]:
    model.eval()
    predictions = [0.0] * len(features)
    with torch.no_grad():
        for group in length_batches([f.shape[0] for f in features], batch_size, None):
            hidden, mask = _padded(features, group)
            for i, value in zip(group, model.base_model.model.predict_from(hidden, mask, start).tolist()):
                predictions[i] = value
    return predictions


def train(args: argparse.Namespace) -> dict:
    rows = read_labels(args.labels)
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "val"]
    max_tokens = max(r["max_tokens"] for r in rows)
    settings = PredictorSettings(max_tokens=max_tokens, lora_layers=args.lora_layers, rank=args.rank)
    print(f"{len(train_rows)} train, {len(val_rows)} val prompts; labels capped at {max_tokens}", flush=True)

    hf_model, tokenizer = load_hf_model(resolve_model_dir(args.model), torch.float32, torch.device("cpu"))
    regressor = LengthRegressor(hf_model.model, max_tokens)
    start = regressor.num_layers - settings.lora_layers
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    encode = [prediction_ids(tokenizer, r["prompt"]) for r in train_rows + val_rows]
    features = cached_features(regressor, encode, start, args.work / _work_key(args.labels, rows, start),
                               args.batch, pad_id)
    train_features, val_features = features[: len(train_rows)], features[len(train_rows) :]
    targets = torch.tensor([float(r["label"]) for r in train_rows])

    torch.manual_seed(args.seed)
    model = with_new_adapter(regressor, settings)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    checkpoint = args.work / "checkpoint.pt"
    first_epoch = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
        print(f"resuming after epoch {first_epoch}", flush=True)
    rng = random.Random(args.seed)
    history = []
    for epoch in range(args.epochs):
        groups = length_batches([f.shape[0] for f in train_features], args.batch, rng)
        if epoch < first_epoch:
            continue  # keep the shuffles identical to an uninterrupted run
        model.train()
        started, total = time.perf_counter(), 0.0
        for step, group in enumerate(groups, 1):
            hidden, mask = _padded(train_features, group)
            predicted = model.base_model.model.predict_from(hidden, mask, start)
            loss = (predicted - targets[group]).abs().mean() / max_tokens
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * max_tokens
            if step % 20 == 0 or step == len(groups):
                print(f"epoch {epoch + 1}/{args.epochs}  batch {step}/{len(groups)}  train MAE {total / step:.1f}"
                      f"  {time.perf_counter() - started:.0f} s", flush=True)
        val = length_metrics(predict_cached(model, val_features, start, args.batch), [r["label"] for r in val_rows],
                             args.edges) if val_rows else {}
        history.append({"epoch": epoch + 1, "train_mae": round(total / len(groups), 1), "val": val})
        print(f"epoch {epoch + 1}: val {val}", flush=True)
        torch.save({"model": {k: v for k, v in model.state_dict().items() if "lora_" in k or "head" in k},
                    "optimizer": optimizer.state_dict(), "epoch": epoch}, checkpoint)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    (args.out / "settings.json").write_text(settings.model_dump_json(indent=2))
    summary = {"model": args.model, "train_prompts": len(train_rows), "val_prompts": len(val_rows),
               "settings": settings.model_dump(), "lr": args.lr, "batch": args.batch, "epochs": args.epochs,
               "seed": args.seed, "history": history}
    (args.out / "training.json").write_text(json.dumps(summary, indent=2))
    write_card(args.out, summary)
    return summary


def write_card(out: Path, summary: dict) -> None:
    """The adapter's card (replaces the generic one peft writes): data, split, settings, metrics."""
    last = summary["history"][-1]["val"] if summary["history"] else {}
    s = summary["settings"]
    lines = [
        "# Length-prediction adapter", "",
        f"LoRA (rank {s['rank']}, alpha {s['alpha']}, dropout {s['dropout']}) on the top {s['lora_layers']} decoder "
        f"layers of `{summary['model']}` (all attention and MLP projections), plus a one-unit head on the last "
        "token's final hidden state: predicted length = max_tokens x sigmoid(head). Input: the decoder's own chat "
        "prompt followed by a fixed length question (predictor/prompt.py).", "",
        "## Data", "",
        f"`predictor/data/labels`: the serving model's own greedy answers (loop stop on, max_tokens "
        f"{s['max_tokens']}), label = answer length in tokens. Split by a fixed hash of each prompt's id "
        f"(predictor/labels.py): {summary['train_prompts']} train, {summary['val_prompts']} held out. "
        "Prompts come from train_pool.jsonl and sharegpt4k.jsonl, never from the evaluation question sets.", "",
        "## Training", "",
        f"{summary['epochs']} epochs, batch {summary['batch']}, AdamW lr {summary['lr']}, L1 loss on tokens, seed "
        f"{summary['seed']}; lower layers frozen and their outputs cached (python -m predictor.train).", "",
        "## Held-out metrics (last epoch)", "",
        "| MAE (tokens) | within 50 | within 100 | bin accuracy | under-predicted |", "|---|---|---|---|---|",
        f"| {last.get('mae')} | {last.get('within_50')} | {last.get('within_100')} | {last.get('bin_accuracy')} | "
        f"{last.get('under_rate')} |", "",
        "Full comparison with the baselines: `python -m predictor.eval` (bench/results/predictor.json).", "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def _work_key(labels: Path, rows: list[dict], start: int) -> str:
    """Feature caches are only valid for the same prompts in the same order."""
    import hashlib

    digest = hashlib.sha256("\n".join(r["id"] for r in rows).encode()).hexdigest()[:12]
    return f"{labels.name}-{digest}-layer{start}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS, help="folder of label parquet parts")
    parser.add_argument("--model", default=EngineConfig().model, help="serving model (embedded default)")
    parser.add_argument("--out", type=Path, default=DEFAULT_ADAPTER, help="where the adapter is written")
    parser.add_argument("--work", type=Path, default=default_cache_dir() / "predictor-train",
                        help="feature cache and checkpoints")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--lora-layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--edges", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_EDGES)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    train(args)


if __name__ == "__main__":
    main()
