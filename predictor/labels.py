"""Response-length labels: the serving model answers each prompt at one or more temperatures and
the label is the longest answer, capped at max_tokens (the recipe of Zheng et al., 2023, who use
0, 0.3, 0.5 and 0.7).

    python -m predictor.labels --source ../shared/data --n 3000

The defaults are what the committed labels were made with: greedy only, 256 tokens, with the
service's loop stop. Greedy because this engine is batch-invariant, so a greedy length is exactly
what the service (and the scheduling benchmark) will produce again, and because each extra
temperature costs as much again on a CPU (~90 tok/s here); sampled answers that run longer than
their prediction are what the batcher's failure collection is for. `--temperatures 0,0.3,0.5,0.7`
gives the paper's recipe where compute allows.

Resumable: finished rows go to numbered parquet parts under --out, --chunk rows a part, and a
rerun skips prompt ids already labelled (a stop loses at most the rows not yet written). Prompts are sampled with a fixed seed from the training pool
and the ShareGPT set (never from the evaluation sets) and each row keeps its prompt text, so the
labels alone are enough to train and evaluate the predictor.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.types import FinishReason, GenerationRequest, Result, SamplingParams
from predictor.prompt import chat_prompt_ids

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "labels"
SOURCES = ("train_pool.jsonl", "sharegpt4k.jsonl")
VALIDATION_SHARE = 0.15


def sample_prompts(source_dir: Path, count: int, seed: int) -> list[dict]:
    """A seeded random sample of prompts from both sources, each with a fixed train/val split."""
    rows = []
    for name in SOURCES:
        with open(source_dir / name) as f:
            for line in f:
                row = json.loads(line)
                rows.append({
                    "id": str(row["id"]),
                    "source": row.get("source", "sharegpt"),
                    "category": row.get("category") or "chat",
                    "prompt": row["prompt"],
                })
    rng = random.Random(seed)
    rng.shuffle(rows)
    chosen = rows[:count]
    for row in chosen:  # split by a hash of the id, so it never changes when --n grows
        digest = int(hashlib.sha256(row["id"].encode()).hexdigest()[:8], 16)
        row["split"] = "val" if digest % 1000 < VALIDATION_SHARE * 1000 else "train"
    return chosen


def done_ids(out: Path) -> set[str]:
    parts = sorted(out.glob("part-*.parquet"))
    return {i for p in parts for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()}


def read_labels(folder: Path, parts: int | None = None) -> list[dict]:
    """All labelled rows of a label folder (or of its first `parts` parts), in a fixed order (by id)."""
    parts = sorted(Path(folder).glob("part-*.parquet"))[:parts]
    if not parts:
        raise FileNotFoundError(f"no label parts (part-*.parquet) in {folder}")
    rows = [row for p in parts for row in pq.read_table(p).to_pylist()]
    return sorted(rows, key=lambda r: r["id"])


def _seed(prompt_id: str, temperature: float) -> int:
    return int(hashlib.sha256(f"{prompt_id}/{temperature}".encode()).hexdigest()[:8], 16)


def _label_row(row: dict, prompt_ids: list[int], results: list[Result], temperatures: list[float],
               max_tokens: int) -> dict:
    lengths = [r.completion_tokens for r in results]
    return {
        **row,
        "prompt_tokens": len(prompt_ids),
        "temperatures": temperatures,
        "lengths": lengths,
        "hit_cap": [r.finish_reason is FinishReason.LENGTH for r in results],
        "label": max(lengths),
        "max_tokens": max_tokens,
        "greedy_answer": next((r.text for r, t in zip(results, temperatures) if t == 0), None),
    }


def generate_labels(engine: LLMEngine, rows: list[dict], temperatures: list[float], max_tokens: int,
                    max_prompt_tokens: int) -> Iterator[dict]:
    """Yield one labelled row per prompt as soon as all its answers are done. Requests are fed
    continuously, so the batch stays full instead of draining at the end of each chunk."""
    pending, waiting = deque(rows), {}
    queue_target = 2 * engine.runner.max_slots
    in_flight = 0
    while pending or engine.has_work():
        while pending and in_flight < queue_target:
            row = pending.popleft()
            prompt_ids = chat_prompt_ids(engine.tokenizer, row["prompt"], max_prompt_tokens)
            waiting[row["id"]] = (row, prompt_ids, {})
            for t in temperatures:
                params = SamplingParams(max_tokens=max_tokens, temperature=t, seed=_seed(row["id"], t) if t else None,
                                        stop_on_loop=True)
                engine.add(GenerationRequest(id=f"{row['id']}@{t}", prompt_ids=prompt_ids, params=params))
                in_flight += 1
        for event in engine.step():
            if event.finish_reason is None:
                continue
            in_flight -= 1
            row_id, t = event.request_id.rsplit("@", 1)
            row, prompt_ids, done = waiting[row_id]
            done[float(t)] = engine.pop_result(event.request_id)
            if len(done) == len(temperatures):
                del waiting[row_id]
                yield _label_row(row, prompt_ids, [done[t] for t in temperatures], temperatures, max_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=Path("../shared/data"), help="folder with the source JSONL files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the parquet parts")
    parser.add_argument("--n", type=int, default=3000, help="prompts to label in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperatures", default="0", help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to this many tokens")
    parser.add_argument("--chunk", type=int, default=64, help="prompts per written part")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoded together")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    temperatures = [float(t) for t in args.temperatures.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = sample_prompts(args.source, args.n, args.seed)
    finished = done_ids(args.out)
    todo = [r for r in rows if r["id"] not in finished]
    print(f"{len(finished)} labelled already, {len(todo)} to go", flush=True)
    if not todo:
        return
    engine = LLMEngine.from_config(EngineConfig(max_batch_size=args.batch, max_model_len=1024))
    part = len(list(args.out.glob("part-*.parquet")))
    started, tokens, done, buffer = time.perf_counter(), 0, 0, []
    for row in generate_labels(engine, todo, temperatures, args.max_tokens, args.max_prompt_tokens):
        buffer.append(row)
        done += 1
        tokens += sum(row["lengths"])
        if len(buffer) == args.chunk or done == len(todo):
            pq.write_table(pa.Table.from_pylist(buffer), args.out / f"part-{part:05d}.parquet")
            part, buffer = part + 1, []
            rate = tokens / (time.perf_counter() - started)
            eta_h = (len(todo) - done) * (tokens / done) / rate / 3600
            print(f"{len(finished) + done}/{len(rows)} prompts  {rate:.0f} tok/s  ETA {eta_h:.1f} h", flush=True)


if __name__ == "__main__":
    main()
