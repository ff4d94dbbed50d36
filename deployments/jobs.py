"""Batch jobs: a file of prompts in, a Parquet file of answers out.

The job sends every row to the running Serve application over its OpenAI-compatible HTTP API
(`POST /v1/chat/completions`), the path users' requests take (ingress, then batcher, then
decoders), so a batch is admitted, scheduled and limited exactly like live traffic and measures
the same thing. Run it anywhere that reaches the API:

    python -m deployments.jobs --input prompts.jsonl --output out/            # here
    ray job submit --working-dir . -- python -m deployments.jobs --input prompts.jsonl --output /abs/out
    submit_job("prompts.jsonl", "out", address="http://<head>:8265")           # from Python

A stopped job restarted with the same `--output` skips the rows already written (see
deployments.job_io.AnswerStore). `submit_job` talks to the Ray dashboard's Jobs API
(`http://<head>:8265`, what `ray job submit --address` takes), not to a Ray Client address
(`ray://<head>:10001`, what `ray.init("ray://...")` takes): the job itself needs no Ray at all.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
import typing
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.job_io import AnswerStore, JobInputError, ServerUnavailable, answer_row, read_rows
from graph.orchestrator import RequestMode

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
API_KEY_ENV = "PLATO_API_KEY"


class JobConfig(BaseModel):
    """One batch job; each field is also a command-line option (`max_tokens` is `--max-tokens`)."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="JSONL or Parquet file of rows with `prompt` or `messages`, optional `id`, "
                       "`max_tokens`, `temperature`, `mode`, `priority`.")
    output: str = Field(description="Folder for the answers: parts/ while running, answers.parquet when done. "
                        "Rerun with the same folder to resume.")
    base_url: str = Field(DEFAULT_BASE_URL, description="Where the Serve application's HTTP API listens.")
    api_key: str | None = Field(None, description=f"Bearer key of the API; default: the {API_KEY_ENV} variable.")
    concurrency: int = Field(8, ge=1, description="Requests in flight at once.")
    max_tokens: int | None = Field(None, ge=1, description="Answer budget of rows that set none (else the server's).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Temperature of rows that set none.")
    mode: RequestMode | None = Field(None, description="Answer mode of rows that set none.")
    priority: int | None = Field(None, description="Priority of rows that set none (the API's: lower goes first, "
                                 "0 by default); 1 lets interactive requests go before the job's.")
    max_retries: int = Field(8, ge=0, description="Retries of one request on 429/502/503/504 or a lost connection "
                             "(honouring Retry-After, else backing off to 30 s); then the job stops, resumable.")
    timeout_s: float = Field(600.0, gt=0, description="Longest wait for one answer, in seconds.")
    flush_rows: int = Field(32, ge=1, description="Answers per part file.")
    flush_s: float = Field(30.0, gt=0, description="Longest time answers wait in memory before a part is written.")
    progress_s: float = Field(10.0, ge=0, description="Seconds between progress lines (0: one per row).")


@dataclass
class JobSummary:
    """What a run did: rows in the input, written by earlier runs, answered and failed in this one;
    when done, the answers file and its rows with an error (from all runs)."""

    total: int
    skipped: int
    answered: int = 0
    errors: int = 0
    answers_path: str | None = None
    errors_in_answers: int | None = None


class Progress:
    """Prints `done/total rows, rows/s, ETA` at most every `every_s` seconds (and at the end)."""

    def __init__(self, summary: JobSummary, every_s: float):
        self.summary, self.every_s = summary, every_s
        self.started = self.last = time.monotonic()
        self.shown = summary.skipped

    def tick(self, force: bool = False) -> None:
        now, s = time.monotonic(), self.summary
        done = s.skipped + s.answered + s.errors
        if done == self.shown or (not force and now - self.last < self.every_s):
            return
        self.last, self.shown = now, done
        rate = (s.answered + s.errors) / max(now - self.started, 1e-9)
        eta = f"{(s.total - done) / rate:.0f}s" if rate else "?"
        print(f"{done}/{s.total} rows ({done / max(s.total, 1):.0%}), {rate:.2f} rows/s, ETA {eta}, "
              f"{s.errors} with errors", flush=True)


async def _check_server(client: httpx.AsyncClient, config: JobConfig) -> str:
    """The served model's name; refuses to start when nothing listens or the key is wrong."""
    try:
        response = await client.get("/v1/models")
    except httpx.TransportError as exc:
        raise JobInputError(f"cannot reach the API at {config.base_url} ({exc}); is the application running "
                            "(`plato serve`)? Set --base-url to where it listens") from None
    if response.status_code == 401:
        raise JobInputError(f"the API at {config.base_url} wants a key: pass --api-key or set {API_KEY_ENV}")
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return response.json()["data"][0]["id"]
    return "?"


async def run_job(config: JobConfig) -> JobSummary:
    """Answers every row of `config.input` not yet in `config.output`; writes answers.parquet when
    all are in. Raises JobInputError before any request, ServerUnavailable mid-way (resumable)."""
    rows = read_rows(config.input)
    store = AnswerStore(config.output)
    written = store.claim(config.input, rows)
    todo = [r for r in rows if r.id not in written]
    summary = JobSummary(total=len(rows), skipped=len(rows) - len(todo))
    bad = [r.error for r in todo if r.error]
    print(f"{len(todo)} of {len(rows)} rows to do ({len(bad)} bad), {len(written)} already in {config.output}",
          flush=True)
    for error in bad[:20]:
        print(f"bad row: {error}", flush=True)
    if len(bad) > 20:
        print(f"... and {len(bad) - 20} more bad rows (see the error column)", flush=True)
    api_key = config.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, timeout=timeout, limits=limits) as client:
        if any(r.request for r in todo):
            model = await _check_server(client, config)
            print(f"asking {model} at {config.base_url}, {config.concurrency} requests at a time", flush=True)
        queue, progress, flushed = iter(todo), Progress(summary, config.progress_s), time.monotonic()
        defaults = config.model_dump(include={"max_tokens", "temperature", "mode", "priority"}, exclude_none=True)

        async def worker():
            nonlocal flushed
            for row in queue:
                record = await answer_row(client, row, defaults, config.max_retries) if row.request else row.result()
                store.add(record)
                if record["error"]:
                    summary.errors += 1
                else:
                    summary.answered += 1
                if len(store.pending) >= config.flush_rows or time.monotonic() - flushed > config.flush_s:
                    store.flush()
                    flushed = time.monotonic()
                progress.tick()

        workers = [asyncio.create_task(worker()) for _ in range(config.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            store.flush()
            progress.tick(force=True)
    table = store.finish()
    summary.answers_path, summary.errors_in_answers = store.answers_path, len(table) - table["error"].null_count
    return summary


def run_job_sync(config: JobConfig) -> JobSummary:
    """run_job in a fresh event loop; SIGTERM (what `ray job stop` sends) stops it like Ctrl-C,
    after writing the answers already in."""

    async def main():
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        return await run_job(config)

    return asyncio.run(main())


def run_and_report(config: JobConfig) -> int:
    """Runs a job as a command does: 0 done, 1 stopped part-way (rerun to resume), 2 cannot start."""
    try:
        summary = run_job_sync(config)
    except JobInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ServerUnavailable, KeyboardInterrupt, asyncio.CancelledError) as exc:
        print(f"stopped ({str(exc) or 'interrupted'}); rerun the same command to resume", file=sys.stderr,
              flush=True)
        return 1
    print(f"wrote {summary.answers_path}: {summary.total} rows, {summary.errors_in_answers} with an error",
          flush=True)
    return 0


def _option_type(annotation) -> tuple[type, list | None]:
    inner = next(a for a in typing.get_args(annotation) or (annotation,) if a is not type(None))
    if typing.get_origin(inner) is typing.Literal:
        return str, list(typing.get_args(inner))
    return inner, None


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per JobConfig field, described by the field's description."""
    hints = typing.get_type_hints(JobConfig)
    for name, info in JobConfig.model_fields.items():
        kind, choices = _option_type(hints[name])
        extra = {"required": True} if info.is_required() else {"default": info.default}
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, choices=choices, help=info.description, **extra)


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> JobConfig:
    """The JobConfig of parsed options; a value JobConfig refuses is a usage error (exit 2)."""
    try:
        return JobConfig(**{name: getattr(args, name) for name in JobConfig.model_fields})
    except ValidationError as exc:
        parser.error("; ".join(f"--{e['loc'][0].replace('_', '-')}: {e['msg']}" for e in exc.errors()))


def job_entrypoint(config: JobConfig) -> str:
    """The shell command that runs `config` (the API key stays out: it goes in the job's environment)."""
    options = config.model_dump(exclude_defaults=True, exclude={"api_key"})
    flags = [part for name, value in options.items() for part in (f"--{name.replace('_', '-')}", str(value))]
    return shlex.join(["python", "-m", "deployments.jobs", *flags])


def _job_client(address: str):
    if address.startswith("ray://"):
        raise ValueError(f"{address} is a Ray Client address; Ray Jobs listens on the dashboard, "
                         "e.g. http://<head>:8265 (what `ray job submit --address` takes)")
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError as exc:
        raise JobInputError(f"{exc} Is a cluster running there (`ray start --head`)? Its dashboard's address "
                            "is the one to pass") from None


def submit_job(input: str, output: str, address: str = DEFAULT_DASHBOARD, *, working_dir: str = ".",
               submission_id: str | None = None, **options) -> str:
    """Submits `python -m deployments.jobs` to Ray Jobs with `working_dir` uploaded; returns the job id.
    An input inside working_dir travels with it; an output path is made absolute, since the job runs
    in a temporary copy of working_dir (on a multi-node cluster, choose one the head node can write
    and you can read). `options` are JobConfig fields (base_url, concurrency, ...); the API key, given or
    from $PLATO_API_KEY here, goes in the job's environment."""
    if not os.path.isfile(input):
        raise JobInputError(f"input file {input} does not exist")
    inside = os.path.relpath(os.path.abspath(input), os.path.abspath(working_dir))
    config = JobConfig(input=os.path.abspath(input) if inside.startswith("..") else inside,
                       output=os.path.abspath(output), **options)
    api_key = config.api_key or os.environ.get(API_KEY_ENV)
    runtime_env = {"working_dir": working_dir, "env_vars": {API_KEY_ENV: api_key} if api_key else {}}
    return _job_client(address).submit_job(entrypoint=job_entrypoint(config), runtime_env=runtime_env,
                                           submission_id=submission_id)


def job_status(job_id: str, address: str = DEFAULT_DASHBOARD) -> str:
    """The job's status: PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED."""
    return str(_job_client(address).get_job_status(job_id).value)


def job_logs(job_id: str, address: str = DEFAULT_DASHBOARD) -> str:
    """Everything the job has printed so far."""
    return _job_client(address).get_job_logs(job_id)


def wait_job(job_id: str, address: str = DEFAULT_DASHBOARD, timeout_s: float | None = None,
             poll_s: float = 2.0) -> str:
    """Waits for the job to end (or for timeout_s); returns its last status."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (status := job_status(job_id, address)) in {"PENDING", "RUNNING"}:
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    return status


def follow_job(job_id: str, address: str = DEFAULT_DASHBOARD, out: typing.TextIO = sys.stdout) -> str:
    """Prints the job's log as it grows (as `ray job logs -f` does) until it ends; returns its status."""
    client = _job_client(address)

    async def tail():
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())
    return wait_job(job_id, address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.jobs", description=__doc__.split("\n\n")[0])
    add_job_arguments(parser)
    return run_and_report(config_from_args(parser, parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
