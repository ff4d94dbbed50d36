"""Write bench/lm_eval/sharegpt_next_word.jsonl: for the first 60 prompts of data/sharegpt_serve.jsonl
with 26 words or more (so the continuation is never a prompt's last word), the first 24 words as the
context and the 25th as the continuation."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTEXT_WORDS, ROWS = 24, 60


def main() -> None:
    rows = []
    for line in (ROOT / "data" / "sharegpt_serve.jsonl").read_text().splitlines():
        words = json.loads(line)["prompt"].split()
        if len(words) >= CONTEXT_WORDS + 2:
            rows.append({"context": " ".join(words[:CONTEXT_WORDS]), "continuation": " " + words[CONTEXT_WORDS]})
        if len(rows) == ROWS:
            break
    out = Path(__file__).with_name("sharegpt_next_word.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} rows -> {out}")


if __name__ == "__main__":
    main()
