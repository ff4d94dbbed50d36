"""`python -m bench engine`: this engine against plain `transformers` `generate`, in one run.

Measures total tokens/s at several batch sizes (same prompts, same number of new tokens, greedy),
the shared-prefix case (four continuations of a 300-token prefix: recomputed one by one vs
prefilled once and decoded as one batch), and the memory-bandwidth roofline at batch 1.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import load_jsonl, machine, table, timed, write_result
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import load_hf_model, resolve_model_dir, select_device_and_dtype
from engine.types import GenerationRequest, SamplingParams

PREFIX_TOKENS = 300
PREFIX_QUESTIONS = [
    "Which of these questions is about health?",
    "Summarise the first question in five words.",
    "Which question would a student ask?",
    "Pick one question and answer it briefly.",
]


def measure_bandwidth_gbs(gib: float = 1.0) -> float:
    """Read bandwidth of main memory, from summing a tensor far larger than the caches."""
    data = torch.ones(int(gib * 2**30) // 4)
    data.sum()
    _, seconds = timed(lambda: [data.sum() for _ in range(3)])
    return 3 * data.numel() * 4 / seconds / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes a batch-1 decode step must read: every weight once, except the input embedding table,
    of which one row is read (unless it is tied to the output projection, which reads all of it)."""
    params = sum(p.numel() for p in model.parameters())  # a tied table is counted once
    if not model.config.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    return params * next(model.parameters()).element_size()


def _chat_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    questions = [row["prompt"] for row in load_jsonl("vicuna80.jsonl")][:count]
    return [engine.encode_chat([{"role": "user", "content": q}]) for q in questions]


def hf_generate_tok_s(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        _, seconds = timed(lambda: model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=pad,
        ))
    return len(prompts) * new_tokens / seconds


def ours_tok_s(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    results, seconds = timed(lambda: engine.generate([GenerationRequest(prompt_ids=p, params=params) for p in prompts]))
    assert all(r.completion_tokens == new_tokens for r in results)
    return sum(r.completion_tokens for r in results) / seconds


def dtype_probe(model_dir: str, device, prompts: list[list[int]], new_tokens: int) -> dict:
    """This engine at batch 16 in float32 and bfloat16, and how often bf16's greedy answers match."""
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model, tokenizer = load_hf_model(model_dir, dtype, device)
        engine = LLMEngine(model, tokenizer, EngineConfig(max_batch_size=len(prompts), max_model_len=1024))
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        ours_tok_s(engine, prompts[:2], 4)
        results, seconds = timed(lambda: engine.generate([GenerationRequest(prompt_ids=p, params=params) for p in prompts]))
        out[name] = {"tok_s": round(len(prompts) * new_tokens / seconds, 1), "tokens": [r.token_ids for r in results]}
    same = sum(a == b for a, b in zip(out["float32"]["tokens"], out["bfloat16"]["tokens"]))
    return {"batch": len(prompts), "new_tokens": new_tokens,
            "float32_tok_s": out["float32"]["tok_s"], "bfloat16_tok_s": out["bfloat16"]["tok_s"],
            "bf16_greedy_matches_fp32": f"{same}/{len(prompts)}"}


def prefix_case(engine: LLMEngine, new_tokens: int) -> dict:
    """Four continuations of one 300-token prefix: one by one from scratch vs prefix reused, batched."""
    document = " ".join(row["prompt"] for row in load_jsonl("vicuna80.jsonl"))
    prefix = engine.encode_chat([{"role": "user", "content": document}], add_generation_prompt=False)[:PREFIX_TOKENS]
    suffixes = [engine.encode(f"\n\nQuestion: {q}<|im_end|>\n<|im_start|>assistant\n") for q in PREFIX_QUESTIONS]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = lambda: [GenerationRequest(prompt_ids=prefix + s, params=params) for s in suffixes]

    saved_bytes = engine.prefix_cache.max_bytes
    engine.prefix_cache.max_bytes = 0  # no reuse: every continuation prefills all of its prompt
    one_by_one, recompute_s = timed(lambda: [engine.generate([r])[0] for r in requests()])
    engine.prefix_cache.max_bytes = saved_bytes

    def reuse():
        engine.prefill_prefix(prefix)
        return engine.generate(requests())

    batched, reuse_s = timed(reuse)
    return {
        "prefix_tokens": len(prefix),
        "continuations": len(suffixes),
        "new_tokens": new_tokens,
        "recompute_one_by_one_s": round(recompute_s, 3),
        "prefix_reused_batched_s": round(reuse_s, 3),
        "prefix_batch_speedup": round(recompute_s / reuse_s, 2),
        "outputs_match": [a.token_ids for a in one_by_one] == [b.token_ids for b in batched],
        "prefix_hit_tokens": [b.prefix_hit_tokens for b in batched],
    }


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench engine", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and batch sizes (under two minutes)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence")
    parser.add_argument("--model", default=EngineConfig().model, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per batch size, alternating the two systems; the best of each counts "
                        "(default 2, --quick 1), so a noisy moment on a shared machine hits both alike")
    args = parser.parse_args(argv)
    batches = [1, 16] if args.quick else [1, 4, 8, 16]
    new_tokens = args.new_tokens or (24 if args.quick else 64)

    config = EngineConfig(model=args.model, max_batch_size=max(batches), max_model_len=1024)
    device, dtype = select_device_and_dtype(config)
    hf_model, tokenizer = load_hf_model(resolve_model_dir(config.model), dtype, device)
    engine = LLMEngine(hf_model, tokenizer, config)
    prompts = _chat_prompts(engine, max(batches))
    ours_tok_s(engine, prompts[:2], 4)  # warm-up: first calls allocate and pick kernels
    hf_generate_tok_s(hf_model, tokenizer, prompts[:2], 4)

    rows, per_batch = [], {}
    repeats = args.repeats or (1 if args.quick else 2)
    for batch in batches:
        hf = ours = 0.0
        for _ in range(repeats):
            hf = max(hf, hf_generate_tok_s(hf_model, tokenizer, prompts[:batch], new_tokens))
            ours = max(ours, ours_tok_s(engine, prompts[:batch], new_tokens))
        per_batch[str(batch)] = {"ours_tok_s": round(ours, 1), "hf_tok_s": round(hf, 1), "speedup_vs_hf": round(ours / hf, 2)}
        rows.append([batch, f"{ours:.1f}", f"{hf:.1f}", f"{ours / hf:.2f}x"])

    prefix = prefix_case(engine, 16 if args.quick else 32)
    dtypes = None if args.quick else dtype_probe(resolve_model_dir(config.model), device, prompts[:16], 32)
    bandwidth = measure_bandwidth_gbs()
    roofline = bandwidth * 1e9 / weight_bytes_per_token(hf_model)
    result = {
        "model": config.model,
        "dtype": str(dtype).replace("torch.", ""),
        "new_tokens": new_tokens,
        "quick": args.quick,
        "repeats": repeats,
        "batches": per_batch,
        "prefix": prefix,
        "prefix_batch_speedup": prefix["prefix_batch_speedup"],
        "dtype_probe": dtypes,
        "memory_bandwidth_gbs": round(bandwidth, 1),
        "roofline_batch1_tok_s": round(roofline, 1),
        "roofline_fraction_batch1": round(per_batch["1"]["ours_tok_s"] / roofline, 2),
        "machine": machine(),
    }
    path = write_result("engine", result)
    print(table(["batch", "ours tok/s", "HF generate tok/s", "speedup"], rows))
    print(
        f"\nshared prefix ({prefix['prefix_tokens']} tokens, {prefix['continuations']} continuations of "
        f"{prefix['new_tokens']} tokens): recomputed one by one {prefix['recompute_one_by_one_s']} s, "
        f"reused + batched {prefix['prefix_reused_batched_s']} s -> {prefix['prefix_batch_speedup']}x "
        f"(outputs match: {prefix['outputs_match']})"
    )
    if dtypes:
        print(f"dtype at batch {dtypes['batch']}: float32 {dtypes['float32_tok_s']} tok/s, bfloat16 "
              f"{dtypes['bfloat16_tok_s']} tok/s; bf16 greedy answers equal to fp32: {dtypes['bf16_greedy_matches_fp32']}")
    print(
        f"memory bandwidth {result['memory_bandwidth_gbs']} GB/s -> batch-1 roofline {result['roofline_batch1_tok_s']} tok/s; "
        f"ours reaches {result['roofline_fraction_batch1']:.0%} of it\nwrote {path}"
    )
    return result
