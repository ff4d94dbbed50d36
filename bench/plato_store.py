"""Where `python -m bench plato` keeps its answers as it makes them, and the order it makes them in.

A full run (80 questions, eight variants) takes over an hour on the 2-core box, longer than one
shell command or what is left of a session, so every answer is appended to a file the moment it is
made and a later invocation with the same settings answers only what is missing. Variants answer a
question one after another (`turns`), so each question's variants meet the machine in the same
minute: this box's speed moves by a quarter from hour to hour, and run variant after variant, a
ratio between two of them was good to only about +-0.1.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def signature_folder_name(signature: dict) -> str:
    """A short stable name for a run's settings."""
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:12]


class PlatoRunStore:
    """One folder per set of settings (`signature`): `signature.json`, `<variant>.jsonl` (one row per
    question answered alone, with its `id`) and `together.json` (per variant, the questions sent all
    at once, their rows and the wall time)."""

    def __init__(self, root: Path, signature: dict):
        self.folder = root / signature_folder_name(signature)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "signature.json"
        if not path.exists():
            path.write_text(json.dumps(signature, indent=1, sort_keys=True) + "\n")

    def clear(self) -> None:
        """Drop every kept answer and in-flight run (the settings stay)."""
        for path in [*self.folder.glob("*.jsonl"), self.folder / "together.json"]:
            path.unlink(missing_ok=True)

    def _answers_path(self, variant: str) -> Path:
        return self.folder / f"{variant}.jsonl"

    def answered(self, variant: str) -> dict[str, dict]:
        """The kept rows of `variant`, by question id (a line cut short by a killed run is skipped)."""
        path, rows = self._answers_path(variant), {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                rows[row["id"]] = row
        return rows

    def add(self, variant: str, row: dict) -> None:
        """Keep one answered question (`row["id"]`) at once."""
        with self._answers_path(variant).open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _together(self) -> dict:
        path = self.folder / "together.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def together(self, variant: str, ids: list[str]) -> tuple[list[dict], float] | None:
        """The kept all-in-flight run of `variant` on exactly these questions, if any."""
        kept = self._together().get(variant)
        if kept is None or kept["ids"] != ids:
            return None
        return kept["rows"], kept["wall_s"]

    def save_together(self, variant: str, ids: list[str], rows: list[dict], wall_s: float) -> None:
        kept = self._together()
        kept[variant] = {"ids": ids, "rows": rows, "wall_s": wall_s}
        (self.folder / "together.json").write_text(json.dumps(kept, indent=1) + "\n")


def turns(question_ids: list[str], variants: list[str], done: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(question id, variant) for every answer still to make: question by question, each question's
    variants one after another, starting one variant further along each question so no variant is
    always the first after a pause."""
    out = []
    for k, qid in enumerate(question_ids):
        shift = k % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            if qid not in done.get(variant, set()):
                out.append((qid, variant))
    return out
