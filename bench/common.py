"""Helpers every benchmark shares: data files, timing, result files, tables."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
RESULTS = REPO / "bench" / "results"


def load_jsonl(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def timed(fn):
    """(result, seconds) of one call."""
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


async def streamed_pieces(service, request) -> tuple[list[str], float, float]:
    """A streamed chat completion through a CompletionService: its text pieces, and the seconds to the
    first piece (to the end when none came) and to the end."""
    started, first, pieces = time.perf_counter(), None, []
    async for chunk in service.stream(request):
        piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if piece:
            first = first or time.perf_counter()
            pieces.append(piece)
    end = time.perf_counter()
    return pieces, (first or end) - started, end - started


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (it reads fine in a terminal too)."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def device_signature(device: torch.device, dtype: torch.dtype) -> dict:
    """What a kept run's signature adds for where it ran: nothing on the CPU (the folders of the runs kept
    before this was added stay theirs), the device and dtype elsewhere, so a run on a GPU never resumes
    answers or timings made on the CPU, nor the other way round."""
    return {} if device.type == "cpu" else {"device": f"{device.type} {str(dtype).replace('torch.', '')}"}
