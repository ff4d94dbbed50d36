"""`plato`: the command line of plato-serve (`python -m deployments.cli` works too).

    plato serve [--config cluster/local.yaml]          start the application (`serve run <config>`)
    plato ask "question" [--mode plato] [--stream]     ask the running application
    plato job run|submit|status|logs ...               batch jobs (deployments.jobs)
    plato bench <scenario> [options]                   benchmarks (`python -m bench`)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import typing

from deployments import jobs
from graph.orchestrator import RequestMode

DEFAULT_CONFIG = "cluster/local.yaml"


def _serve(args, parser) -> int:
    if not os.path.isfile(args.config):
        parser.error(f"config file {args.config} does not exist")
    serve_bin = shutil.which("serve", path=os.path.dirname(sys.executable)) or "serve"
    return subprocess.call([serve_bin, "run", args.config])


def _ask(args, parser) -> int:
    import openai

    api_key = args.api_key or os.environ.get(jobs.API_KEY_ENV) or "unused"
    client = openai.OpenAI(base_url=f"{args.base_url.rstrip('/')}/v1", api_key=api_key)
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    options = {name: value for name, value in options.items() if value is not None}
    if args.json and args.schema:
        parser.error("--json and --schema both ask for a format; give one")
    if args.json:
        options["response_format"] = {"type": "json_object"}
    if args.schema:
        try:
            with open(args.schema, encoding="utf-8") as file:
                schema = json.load(file)
        except (OSError, ValueError) as exc:
            parser.error(f"--schema: cannot read a JSON Schema from {args.schema}: {exc}")
        name = os.path.splitext(os.path.basename(args.schema))[0]
        options["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    if args.stream:
        options.update(stream=True, stream_options={"include_usage": True})
    started = time.monotonic()
    try:
        model = args.model or client.with_options(max_retries=0).models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.question}],
            extra_body={k: v for k, v in (("mode", args.mode), ("priority", args.priority)) if v is not None} or None,
            **options,
        )
        if args.stream:
            mode, usage = _print_stream(reply)
        else:
            mode, usage = (reply.model_extra or {}).get("mode"), reply.usage
            print(reply.choices[0].message.content)
    except openai.APIConnectionError as exc:
        parser.error(f"cannot reach the server at {args.base_url} ({exc.__cause__ or exc}); start it with "
                     "`plato serve` or point --base-url at it")
    except openai.APIStatusError as exc:
        message = exc.body.get("message") if isinstance(exc.body, dict) else None
        print(f"error: the server answered HTTP {exc.status_code}: {message or exc.message}", file=sys.stderr)
        return 1
    tokens = f"{usage.prompt_tokens}+{usage.completion_tokens} tokens, " if usage else ""
    print(f"[mode {mode}, {tokens}{time.monotonic() - started:.2f} s]", file=sys.stderr)
    return 0


def _print_stream(chunks) -> tuple[str | None, object]:
    mode = usage = None
    for chunk in chunks:
        mode, usage = (chunk.model_extra or {}).get("mode", mode), chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return mode, usage


def _job_run(args, parser) -> int:
    return jobs.run_and_report(jobs.config_from_args(parser, args))


def _job_submit(args, parser) -> int:
    config = jobs.config_from_args(parser, args)
    options = config.model_dump(exclude_defaults=True, exclude={"input", "output"})
    job_id = jobs.submit_job(config.input, config.output, args.address, working_dir=args.working_dir, **options)
    print(f"submitted {job_id}; follow it with `plato job logs {job_id} --follow`", flush=True)
    if not args.follow:
        return 0
    return 0 if jobs.follow_job(job_id, args.address) == "SUCCEEDED" else 1


def _job_status(args, parser) -> int:
    print(jobs.job_status(args.job_id, args.address))
    return 0


def _job_logs(args, parser) -> int:
    if args.follow:
        return 0 if jobs.follow_job(args.job_id, args.address) == "SUCCEEDED" else 1
    print(jobs.job_logs(args.job_id, args.address), end="")
    return 0


def _bench(args, parser) -> int:
    return subprocess.call([sys.executable, "-m", "bench", args.scenario, *args.options])


def _command(commands, name: str, handler, help: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=help, description=help)
    parser.set_defaults(handler=handler, parser=parser)
    return parser


def _job_parser(commands) -> None:
    job = commands.add_parser("job", help="batch jobs: a file of prompts in, Parquet answers out")
    job_commands = job.add_subparsers(dest="job_command", required=True)
    run = _command(job_commands, "run", _job_run, "run a job here, calling the HTTP API directly (no Ray Jobs)")
    jobs.add_job_arguments(run)
    submit = _command(job_commands, "submit", _job_submit,
                      "submit a job to Ray Jobs, with this folder as its working dir")
    jobs.add_job_arguments(submit)
    submit.add_argument("--working-dir", default=".", help="Folder uploaded with the job (this repository).")
    submit.add_argument("--follow", action="store_true",
                        help="Print the job's log until it ends; exit 1 unless it succeeded.")
    status = _command(job_commands, "status", _job_status, "a submitted job's status")
    logs = _command(job_commands, "logs", _job_logs, "a submitted job's log")
    logs.add_argument("--follow", "-f", action="store_true", help="Keep printing until the job ends.")
    for sub in (status, logs):
        sub.add_argument("job_id", help="The id `plato job submit` printed.")
    for sub in (submit, status, logs):
        sub.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS", jobs.DEFAULT_DASHBOARD),
                         help=f"The Ray dashboard's address (the Jobs API); default: $RAY_API_SERVER_ADDRESS, "
                         f"else {jobs.DEFAULT_DASHBOARD}.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plato", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = _command(commands, "serve", _serve, "start the application: the same as `serve run <config>`")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help="A Serve config file (see cluster/).")
    ask = _command(commands, "ask", _ask, "ask the running application one question")
    ask.add_argument("question")
    ask.add_argument("--mode", choices=typing.get_args(RequestMode), help="How to answer; default: the server's (ar).")
    ask.add_argument("--base-url", default=jobs.DEFAULT_BASE_URL, help="Where the HTTP API listens.")
    ask.add_argument("--api-key", help=f"Bearer key of the API; default: the {jobs.API_KEY_ENV} variable.")
    ask.add_argument("--model", help="The served model's name; default: the one GET /v1/models lists.")
    ask.add_argument("--max-tokens", type=int, help="Answer budget; default: the server's.")
    ask.add_argument("--temperature", type=float, help="Sampling temperature; default: the server's (0, greedy).")
    ask.add_argument("--priority", type=int, help="vLLM's priority: lower is decoded sooner when requests wait "
                     "(default 0).")
    ask.add_argument("--stream", action="store_true", help="Print tokens as they are decoded.")
    ask.add_argument("--json", action="store_true", help="JSON mode: the answer is one JSON object.")
    ask.add_argument("--schema", metavar="FILE", help="Structured output: the answer validates against the JSON "
                     "Schema in FILE.")
    _job_parser(commands)
    bench = _command(commands, "bench", _bench, "run a benchmark: the same as `python -m bench <scenario> ...`")
    from bench.__main__ import SCENARIOS

    bench.add_argument("scenario", choices=sorted(SCENARIOS), help="Which benchmark (the README's Benchmarks).")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="Passed on to the scenario.")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args, args.parser)
    except jobs.JobInputError as exc:
        args.parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
