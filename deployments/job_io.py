"""Batch job input and output, no Ray: rows read from JSONL or Parquet and checked, each answered
over the HTTP API with retries, answers written as numbered Parquet parts that a restarted job
resumes from, then as one file."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.openai_schema import ChatCompletionRequest, ChatMessage
from graph.orchestrator import RequestMode

ANSWERS_FILE = "answers.parquet"
PARTS_DIR = "parts"
MANIFEST_FILE = "job.json"
RETRIED_STATUSES = {429, 502, 503, 504}

OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("row", pa.int64()),  # the row's line (JSONL) or row number (Parquet), from 1: the input's order
    ("prompt", pa.string()),
    ("messages", pa.string()),  # JSON text, as given: a bad row's messages may fit no typed column
    ("answer", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("latency_s", pa.float64()),
    ("mode", pa.string()),
    ("error", pa.string()),
])


class JobInputError(ValueError):
    """The job cannot start: a missing or unreadable input, or an output folder it must not touch."""


class JobRow(BaseModel):
    """One input row as the job checks it. Types are strict (`"max_tokens": "10"` is a bad row, not
    a 10). The chat API's other fields (response_format, stop, seed, top_p, ...) go to the server as
    given, which checks them with the rest (roles, lengths) per request; columns that are no field of
    the API are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str | int | None = Field(None, description="The caller's id for the row; a stable one is made when absent.")
    prompt: str | None = Field(None, min_length=1, description="A question, sent as one user message.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="A chat, oldest message first.")
    max_tokens: int | None = Field(None, ge=1, description="This row's answer budget; the job's default when absent.")
    temperature: float | None = Field(None, ge=0.0, le=2.0,
                                      description="This row's temperature; the job's default when absent.")
    mode: RequestMode | None = Field(None, description="How to answer this row; the job's default when absent.")
    priority: int | None = Field(None, description="This row's priority (lower goes first); the job's default "
                                 "when absent.")


@dataclass
class InputRow:
    """A row ready to send (`request` set) or to write as a bad row (`error` set)."""

    id: str
    row: int
    prompt: str | None
    messages: str | None
    request: dict | None = None
    error: str | None = None
    mode: str | None = None

    def result(self, **answer) -> dict:
        """This row's output record with the answer's fields (or its error) filled in."""
        record = dict.fromkeys(OUTPUT_SCHEMA.names)
        record.update(id=self.id, row=self.row, prompt=self.prompt, messages=self.messages, mode=self.mode,
                      error=self.error)
        record.update(answer)
        return record


def _as_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, default=str)


# a row has one answer column, with no log probabilities or plan: fields that would ask for more are
# refused unless neutral, rather than sent and their answer dropped
_ONE_ANSWER = {"n": (1,), "stream": (False,), "logprobs": (False,), "top_logprobs": (0,), "return_plan": (False,)}
_PASSED_ON = set(ChatCompletionRequest.model_fields) - set(JobRow.model_fields) - {"messages"}
BATCH_URL = "/v1/chat/completions"


def _from_batch_line(raw: dict) -> tuple[dict, str | None]:
    """A line of OpenAI's batch input (vLLM's run_batch reads the same: {"custom_id", "method", "url",
    "body"}) as a plain row, the custom id as its id; with what is wrong with it, if anything."""
    if "body" not in raw and "custom_id" not in raw:
        return raw, None
    body = raw.get("body")
    row = {**body, "id": raw.get("custom_id")} if isinstance(body, dict) else {"id": raw.get("custom_id")}
    if not isinstance(body, dict):
        return row, "body: a JSON object, the request, is needed"
    if raw.get("url", BATCH_URL) != BATCH_URL:
        return row, f"url: only {BATCH_URL} is served by a job, not {raw.get('url')!r}"
    if raw.get("method", "POST") != "POST":
        return row, f"method: POST, not {raw.get('method')!r}"
    return row, None


def _check(raw: dict, number: int, where: str) -> InputRow:
    raw, batch_problem = _from_batch_line(raw)
    content = {k: v for k, v in raw.items() if k != "id"}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()
    row = InputRow(id=f"row{number}-{digest[:10]}", row=number, prompt=_as_text(raw.get("prompt")),
                   messages=_as_text(raw.get("messages")), mode=_as_text(raw.get("mode")))
    try:
        checked = JobRow.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in exc.errors())
        row.error = f"{where}: {problems}"
        if isinstance(raw.get("id"), (str, int)) and not isinstance(raw.get("id"), bool):
            row.id = str(raw["id"])
        return row
    if checked.id is not None:
        row.id = str(checked.id)
    if batch_problem:
        row.error = f"{where}: {batch_problem}"
        return row
    if (checked.prompt is None) == (checked.messages is None):
        row.error = f"{where}: {'give prompt or messages, not both' if checked.prompt else 'no prompt or messages'}"
        return row
    if raw.get("tools") and raw.get("tool_choice") != "none":  # 'auto', the default with tools, may call
        row.error = f"{where}: tool_choice: a job row's answer is text, not tool calls; set tool_choice to 'none'"
        return row
    more = [k for k, neutral in _ONE_ANSWER.items() if raw.get(k) not in (None, *neutral)]
    if more:
        row.error = (f"{where}: {more[0]}: a job row gets one answer, written without log probabilities, plan "
                     f"or streaming; leave {more[0]} out")
        return row
    messages = [{"role": "user", "content": checked.prompt}] if checked.prompt is not None else raw["messages"]
    params = checked.model_dump(include={"max_tokens", "temperature", "mode", "priority"}, exclude_none=True)
    passed_on = {k: v for k, v in raw.items() if k in _PASSED_ON and v is not None}  # a Parquet null: not given
    row.request = {"messages": messages, **passed_on, **params}
    return row


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raw = exc
            yield number, f"line {number}", raw, line


def _parquet_rows(path: str):
    for number, raw in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield number, f"row {number}", raw, None


def read_rows(path: str) -> list[InputRow]:
    """Every row of a JSONL or Parquet file (by extension; .json and .ndjson are JSONL), bad ones
    included with their `error`. Ids are unique: a repeated id is a bad row kept as `<id>@<row>`."""
    if not os.path.isfile(path):
        raise JobInputError(f"input file {path} does not exist")
    is_parquet = path.endswith((".parquet", ".pq"))
    try:
        source = list(_parquet_rows(path) if is_parquet else _jsonl_rows(path))
    except (OSError, UnicodeDecodeError, pa.ArrowException) as exc:
        raise JobInputError(f"cannot read {path} as {'Parquet' if is_parquet else 'JSONL'}: {exc}") from None
    rows, first_at = [], {}
    for number, where, raw, line in source:
        if isinstance(raw, dict):
            row = _check(raw, number, where)
        else:
            why = f"not valid JSON ({raw})" if isinstance(raw, Exception) else "not a JSON object"
            digest = hashlib.sha256(line.encode()).hexdigest()
            row = InputRow(id=f"row{number}-{digest[:10]}", row=number, prompt=None, messages=None,
                           error=f"{where}: {why}")
        if row.id in first_at:
            kept = f"{row.id}@{number}"
            duplicate = f"{where}: duplicate id {row.id!r} (first at {first_at[row.id]}); written as {kept!r}"
            row.error = "; ".join(filter(None, [duplicate, row.error]))
            row.id, row.request = kept, None
        first_at[row.id] = where
        rows.append(row)
    return rows


class ServerUnavailable(RuntimeError):
    """The API could not be reached, or stayed overloaded, through every retry."""


def _retry_after(response: httpx.Response) -> float | None:
    with contextlib.suppress(KeyError, ValueError):
        return min(float(response.headers["retry-after"]), 60.0)
    return None


def _error_message(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return response.json()["error"]["message"]
    return response.text[:300]


async def answer_row(client: httpx.AsyncClient, row: InputRow, defaults: dict, max_retries: int) -> dict:
    """The row's output record: the answer, or the error of a status not worth retrying. 429, 502,
    503, 504 and lost connections are retried (after Retry-After, else a growing pause) up to
    `max_retries` times, then ServerUnavailable is raised. `defaults` fill the row's unset params."""
    body = {**defaults, **row.request}
    for attempt in range(max_retries + 1):
        started = time.monotonic()
        try:
            response = await client.post("/v1/chat/completions", json=body)
        except httpx.TransportError as exc:
            why, wait = f"{type(exc).__name__}: {exc}", None
        else:
            if response.status_code == 200:
                return _answer_record(row, response, time.monotonic() - started)
            why = f"HTTP {response.status_code}: {_error_message(response)}"
            if response.status_code not in RETRIED_STATUSES:
                return row.result(error=why, mode=body.get("mode"))
            wait = _retry_after(response)
        if attempt == max_retries:
            raise ServerUnavailable(f"{client.base_url}: {why} (after {attempt + 1} tries)")
        await asyncio.sleep(wait if wait is not None else min(30.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0))


def _answer_record(row: InputRow, response: httpx.Response, latency_s: float) -> dict:
    try:
        body = response.json()
        choice, usage = body["choices"][0], body.get("usage") or {}
        return row.result(answer=choice["message"]["content"], finish_reason=choice.get("finish_reason"),
                          prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                          latency_s=latency_s, mode=body.get("mode", row.request.get("mode")))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return row.result(error=f"unexpected response ({type(exc).__name__}: {exc}): {response.text[:300]}")


@dataclass
class AnswerStore:
    """The output folder: `parts/part-NNNNN.parquet` files, each written whole (temp file, then
    rename), so a job killed at any moment leaves only complete parts, and a restarted job skips
    every id they hold: each row is written exactly once. `answers.parquet` is all parts in input
    order, written when every row is in."""

    folder: str
    pending: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise JobInputError(f"output {self.folder} is a file; --output takes a folder")
        os.makedirs(os.path.join(self.folder, PARTS_DIR), exist_ok=True)

    def _parts(self) -> list[str]:
        parts_dir = os.path.join(self.folder, PARTS_DIR)
        names = sorted(n for n in os.listdir(parts_dir) if n.startswith("part-") and n.endswith(".parquet"))
        return [os.path.join(parts_dir, n) for n in names]

    def claim(self, input_path: str, rows: list[InputRow]) -> set[str]:
        """Ids already written. The folder is tied to its input by the ids' hash, so a folder that
        holds answers for other rows is refused instead of being mixed into."""
        ids_hash = hashlib.sha256("\n".join(r.id for r in rows).encode()).hexdigest()
        manifest_path = os.path.join(self.folder, MANIFEST_FILE)
        if os.path.exists(manifest_path):
            with open(manifest_path) as f:
                manifest = json.load(f)
            if manifest["ids_sha256"] != ids_hash:
                raise JobInputError(
                    f"{self.folder} holds answers for other rows ({manifest['rows']} rows of {manifest['input']}); "
                    "use another --output, or delete that folder to start over"
                )
        else:
            manifest = {"input": os.path.abspath(input_path), "rows": len(rows), "ids_sha256": ids_hash}
            _write_whole(manifest_path, lambda tmp: Path(tmp).write_text(json.dumps(manifest)))
        return {i for part in self._parts() for i in pq.read_table(part, columns=["id"])["id"].to_pylist()}

    def add(self, record: dict) -> None:
        self.pending.append(record)

    def flush(self) -> None:
        """Writes the pending records as the next part."""
        if not self.pending:
            return
        parts = self._parts()
        number = int(os.path.basename(parts[-1])[5:10]) + 1 if parts else 0
        table = pa.Table.from_pylist(self.pending, schema=OUTPUT_SCHEMA)
        path = os.path.join(self.folder, PARTS_DIR, f"part-{number:05d}.parquet")
        _write_whole(path, lambda tmp: pq.write_table(table, tmp))
        self.pending = []

    @property
    def answers_path(self) -> str:
        return os.path.join(self.folder, ANSWERS_FILE)

    def finish(self) -> pa.Table:
        """Writes answers.parquet from every part, in input order; returns what it wrote."""
        parts = [pq.read_table(p, schema=OUTPUT_SCHEMA) for p in self._parts()]
        table = pa.concat_tables(parts or [OUTPUT_SCHEMA.empty_table()]).sort_by("row")
        _write_whole(self.answers_path, lambda tmp: pq.write_table(table, tmp))
        return table


def _write_whole(path: str, write) -> None:
    """`write(temporary path)`, then a rename: readers, and a restarted job, never see half a file."""
    write(f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
