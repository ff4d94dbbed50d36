"""`python -m bench steps`: the engine's decode step with CUDA graphs against the same engine run
eagerly, in one run, at several batch sizes.

Each batch size decodes `--new-tokens` tokens for each of B prompts of `--prompt-tokens` random
tokens (end token ignored, drafts off, so every step after the first is a plain decode pass), first
once untimed (a graph is captured the first time a shape needs it), then timed, the two engines
alternating `--repeats` times, the best of each counting. Reports milliseconds per step and tokens/s.
Without CUDA there are no graphs and only the eager engine is timed. Beside it, one prefill pass over
the B prompts, their attention item by item against in padded groups (engine.item_attention).

`--shape` runs a model of a published shape with random weights (speed does not depend on them), so
no model files are needed; `--model` runs real weights instead (the embedded default, a directory).
Writes bench/results/steps.json (or steps_<shape>.json).
"""
from __future__ import annotations

import argparse
import random
import time

from bench.common import machine, table, write_result
from bench.random_model import SHAPES, random_model, word_tokenizer
from bench.schedule_policies import timed_decode
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llama import PrefillItem
from engine.loader import load_hf_model, resolve_model_dir, select_device_and_dtype


def prefill_seconds(runner, prompts: list[list[int]], grouped: bool) -> float:
    """Seconds of one prefill pass over `prompts` (into slots 0, 1, ...), their attention item by
    item or in padded groups (engine.item_attention)."""
    runner.batched_item_attention = grouped
    started = time.perf_counter()
    runner.prefill([PrefillItem(slot, prompt, 0) for slot, prompt in enumerate(prompts)]).cpu()
    return time.perf_counter() - started


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="random weights of this shape (default: --model's real weights)")
    parser.add_argument("--model", default=EngineConfig().model, help="real weights (default: the embedded SmolLM2)")
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]

    config = EngineConfig(model=args.model, max_batch_size=max(batches), speculative_tokens=0,
                          max_model_len=args.prompt_tokens + args.new_tokens + 1)
    device, dtype = select_device_and_dtype(config)
    if args.shape:
        model, tokenizer = random_model(args.shape, device, dtype), word_tokenizer(SHAPES[args.shape]["vocab_size"])
    else:
        model, tokenizer = load_hf_model(resolve_model_dir(config.model, config.cache_dir), dtype, device)
    systems = {"eager": LLMEngine(model, tokenizer, config.model_copy(update={"cuda_graphs": False}))}
    if device.type == "cuda":
        systems["graphs"] = LLMEngine(model, tokenizer, config)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(max(batches))]

    per_batch, rows = {}, []
    for batch in batches:
        for engine in systems.values():  # untimed: allocations, kernel choice, graph capture
            timed_decode(engine, prompts[:batch], args.new_tokens)
        best = {}
        for _ in range(args.repeats):
            for name, engine in systems.items():
                seconds, steps, _ = timed_decode(engine, prompts[:batch], args.new_tokens)
                best[name] = min(best.get(name, (float("inf"), 0)), (seconds, steps))
        entry = {}
        for name, (seconds, steps) in best.items():
            entry[f"{name}_ms_per_step"] = round(1000 * seconds / steps, 2)
            entry[f"{name}_tok_s"] = round(batch * steps / seconds, 1)
        if "graphs" in best:
            entry["graph_speedup"] = round(entry["eager_ms_per_step"] / entry["graphs_ms_per_step"], 2)
        runner, default = systems["eager"].runner, systems["eager"].runner.batched_item_attention
        for grouped in (False, True):  # untimed first: kernel choice
            prefill_seconds(runner, prompts[:batch], grouped)
        for name, grouped in (("per_item", False), ("grouped", True)):
            seconds = min(prefill_seconds(runner, prompts[:batch], grouped) for _ in range(args.repeats))
            entry[f"prefill_{name}_ms"] = round(1000 * seconds, 2)
        runner.batched_item_attention = default
        per_batch[str(batch)] = entry
        rows.append([batch] + [entry.get(k, "-") for k in ("eager_ms_per_step", "graphs_ms_per_step", "graph_speedup",
                                                            "eager_tok_s", "graphs_tok_s", "prefill_per_item_ms",
                                                            "prefill_grouped_ms")])
    graphs = systems.get("graphs")
    result = {
        "model": f"random weights, {args.shape} shape" if args.shape else config.model,
        "device": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "batches": per_batch,
        "graphs_captured": graphs.runner.graphs.captured if graphs else None,
        "machine": machine(),
    }
    path = write_result(f"steps_{args.shape}" if args.shape else "steps", result)
    print(table(["batch", "eager ms/step", "graphs ms/step", "speedup", "eager tok/s", "graphs tok/s",
                 "prefill ms, item by item", "prefill ms, grouped"], rows))
    print(f"\nwrote {path}")
    return result
