"""``dllm generate``: complete one prompt on the terminal, or a JSONL file.

    dllm generate --model DIR "a prompt"            # streamed to stdout
    dllm generate --model DIR --input in.jsonl --output out.jsonl

Input lines: ``{"prompt": ...}`` (a /v1/completions body), ``{"messages": [...]}`` (a
/v1/chat/completions body), or OpenAI batch lines ``{"custom_id", "method", "url", "body"}``.
Each body goes through the same code as the HTTP API (``dllm.server.openai_api``); the
sampling flags are defaults for fields a line does not set. Output lines have the OpenAI batch
output shape ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``; a line without ``custom_id`` is ``line-N`` (N counts from 1).

All valid lines run through the engine together (continuous batching); each result is written
and flushed as soon as it finishes, so the output is in completion order (match lines by
``custom_id``) and an interrupted run loses only what was in flight. The output file is
appended to, and a re-run skips every ``custom_id`` already in it, failures included (delete
a line to retry it). A bad line (malformed JSON, bad fields, too long) gets its own output line
with ``error`` set, and the others go on; a line repeating an earlier ``custom_id`` is one
such, under its own ``line-N`` id (so it cannot be mistaken for the first line's result)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, TextIO

from dllm.cli_args import (
    check_output_path,
    engine_config_from_args,
    json_object,
    take_positional_model,
)
from dllm.watch import add_watch_flags

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


@dataclass
class Job:
    """One input line: a request to run, or (``error`` set) a line that cannot run."""

    line: int
    custom_id: str
    url: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, str] | None = None


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("words", nargs="*", metavar="[MODEL] PROMPT",
                   help="a prompt to complete (streamed to the terminal), after the model's "
                        "directory if it is not given by --model: with two arguments the first "
                        "is the model; with one, it is the model if it is a checkpoint "
                        "directory (holds config.json), else the prompt")
    p.add_argument("--input", help="JSONL input: {prompt}, {messages} or OpenAI batch lines")
    p.add_argument("--output", help="JSONL output in the OpenAI batch output shape (appended; "
                                    "custom_ids already there are skipped)")
    p.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    add_watch_flags(p, "one prompt: show it denoise")
    g = p.add_argument_group("sampling (defaults for input lines that do not set them)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: 128, capped by the context length")
    g.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--dllm", type=json_object, default=None,
                   help='per-request diffusion settings as JSON, e.g. \'{"threshold": 0.9}\'')


def run_generate(args: argparse.Namespace) -> int:
    if hasattr(args, "words"):
        args.prompt = take_positional_model(args, args.words, "prompt")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.input or args.output:
        if not (args.input and args.output):
            raise ValueError("--input and --output go together")
        if args.prompt:
            raise ValueError("give either a prompt or --input/--output, not both")
        if not os.path.isfile(args.input):
            raise FileNotFoundError(f"no such input file: {args.input}")
        check_output_path(args.output, "a JSONL file (created, or appended to)")
    elif not args.prompt:
        raise ValueError("give a prompt, or --input FILE --output FILE")
    if getattr(args, "watch", False):
        if args.input:
            raise ValueError("--watch shows one prompt; it does not go with --input/--output")
        return watch_prompt(args)

    from dllm.async_llm import AsyncLLM
    from dllm.engine import Engine
    from dllm.server.openai_api import OpenAIServing
    from dllm.server.serving import Serving

    cfg = engine_config_from_args(args)
    llm = AsyncLLM(engine=Engine(cfg))
    try:
        context = llm.engine.context_length
        if args.max_new_tokens is not None and args.max_new_tokens >= context:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} does not fit the context "
                             f"length of {context} tokens (prompt + output; --max-model-len "
                             "sets it, up to the model's)")
        api = OpenAIServing(Serving(llm, cfg.served_model_name))
        defaults = sampling_defaults(args)
        if args.input:
            args.interrupt_note = (f"the lines finished are in {args.output}; the same command "
                                   "again resumes (it skips their custom_ids)")
            return asyncio.run(run_file(api, args.input, args.output, defaults,
                                        max_in_flight=4 * cfg.max_running_requests))
        if not args.chat and is_chat_only(llm.engine.info.path):
            print("dllm: hint: this model was trained on chat messages only; add --chat (or "
                  "use dllm chat) to have the prompt answered", file=sys.stderr)
        return asyncio.run(run_prompt(api, args.prompt, args.chat, defaults))
    finally:
        llm.shutdown()


def watch_prompt(args: argparse.Namespace) -> int:
    """``--watch``: the one prompt drawn as it denoises (``dllm.watch``)."""
    from dllm.engine import Engine
    from dllm.sampling_params import SamplingParams
    from dllm.watch import Watcher

    engine = Engine(engine_config_from_args(args))
    try:
        if engine.mask_token_id is None:
            raise ValueError("--watch shows a diffusion model denoise; "
                             f"{engine.info.architecture} is autoregressive")
        d = sampling_defaults(args)
        params = SamplingParams(
            max_new_tokens=d.get("max_tokens", min(128, engine.max_new_tokens_room(
                [{"role": "user", "content": args.prompt}] if args.chat else args.prompt))),
            temperature=d.get("temperature", 0.0), top_p=d.get("top_p", 1.0),
            top_k=d.get("top_k", 0), stop=d.get("stop"), dllm=d.get("dllm") or {})
        if not args.chat and is_chat_only(engine.info.path):
            print("dllm: hint: this model was trained on chat messages only; add --chat (or "
                  "use dllm chat) to have the prompt answered", file=sys.stderr)
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        out = Watcher(engine, delay=args.watch_delay).run(prompt, params)
        if out.error:
            raise RuntimeError(out.error)
        return 0
    finally:
        engine.shutdown()


def is_chat_only(path: str) -> bool:
    """The built-in models answer chat messages only (they never saw plain text)."""
    from dllm.checkpoint import BUILTIN_MODEL_DIR

    here = os.path.realpath(path)
    return os.path.dirname(here) == os.path.dirname(os.path.realpath(BUILTIN_MODEL_DIR)) and \
        os.path.basename(here).startswith("builtin")


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    given = {"max_tokens": args.max_new_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "stop": args.stop, "dllm": args.dllm}
    return {k: v for k, v in given.items() if v is not None}


# ---- one prompt ---------------------------------------------------------------------------
async def run_prompt(api, prompt: str, chat: bool, defaults: dict[str, Any],
                     out: TextIO | None = None) -> int:
    """Stream the completion of one prompt to ``out`` (stdout) as its blocks commit."""
    from dllm.server.protocol import APIError

    out = out or sys.stdout

    body = {**defaults, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    try:
        chunks = await (api.chat(body) if chat else api.completions(body))
    except APIError as exc:
        raise ValueError(exc.message) from None
    async for chunk in chunks:
        if "error" in chunk:
            raise ValueError(chunk["error"]["message"])
        for choice in chunk["choices"]:
            out.write(choice.get("text") or choice.get("delta", {}).get("content") or "")
        out.flush()
    out.write("\n")
    return 0


# ---- a JSONL file -------------------------------------------------------------------------
def parse_line(raw: str, n: int) -> Job:
    """Line ``n`` (from 1) of the input as a job; never raises."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return _bad(n, f"line-{n}", "invalid_json", f"line {n} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return _bad(n, f"line-{n}", "invalid_line", f"line {n} is not a JSON object")
    cid = obj.get("custom_id", f"line-{n}")
    if not isinstance(cid, str) or not cid:
        return _bad(n, f"line-{n}", "invalid_line", "custom_id must be a non-empty string")
    if any(k in obj for k in ("url", "body", "method")):  # an OpenAI batch line
        if obj.get("method", "POST") != "POST":
            return _bad(n, cid, "invalid_line", "method must be POST")
        if obj.get("url") not in (COMPLETIONS_URL, CHAT_URL):
            return _bad(n, cid, "invalid_line",
                        f"url must be {COMPLETIONS_URL} or {CHAT_URL}, got "
                        f"{str(obj.get('url'))[:100]!r}")
        if not isinstance(obj.get("body"), dict):
            return _bad(n, cid, "invalid_line", "body must be a JSON object")
        return Job(n, cid, obj["url"], obj["body"])
    body = {k: v for k, v in obj.items() if k != "custom_id"}
    if "messages" in body:
        return Job(n, cid, CHAT_URL, body)
    if "prompt" in body:
        return Job(n, cid, COMPLETIONS_URL, body)
    return _bad(n, cid, "invalid_line",
                "a line needs 'prompt', 'messages', or the OpenAI batch fields "
                "custom_id/method/url/body")


def _bad(n: int, cid: str, code: str, message: str) -> Job:
    return Job(n, cid, error={"code": code, "message": message})


def read_jobs(path: str) -> list[Job]:
    jobs: list[Job] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            job = parse_line(raw, n)
            if job.custom_id in first_line:
                # The error line must not carry the repeated id, or it could not be told from
                # the first line's result: it gets this line's own ``line-N`` id.
                cid = f"line-{n}"
                while cid in first_line:  # an earlier line chose "line-N" as its custom_id
                    cid += "-duplicate"
                job = _bad(n, cid, "duplicate_custom_id",
                           f"line {n} repeats custom_id {job.custom_id[:100]!r} of line "
                           f"{first_line[job.custom_id]}; this line did not run (give it a "
                           "custom_id of its own)")
            first_line.setdefault(job.custom_id, n)
            jobs.append(job)
    return jobs


def done_custom_ids(path: str) -> set[str]:
    """custom_ids already in an output file (a torn last line is ignored)."""
    done: set[str] = set()
    if not os.path.isfile(path):
        return done
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
                done.add(obj["custom_id"])
    return done


def output_line(job: Job, status: int | None = None, request_id: str | None = None,
                body: dict[str, Any] | None = None) -> dict[str, Any]:
    error = job.error
    if error is None and body is not None and "error" in body:
        err = body["error"]
        error = {"code": err.get("code") or err.get("type"), "message": err.get("message")}
    response = None if status is None else {"status_code": status, "request_id": request_id,
                                            "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.custom_id,
            "response": response, "error": error}


async def run_file(api, input_path: str, output_path: str, defaults: dict[str, Any],
                   max_in_flight: int = 256) -> int:
    from tqdm.auto import tqdm

    jobs = read_jobs(input_path)
    done = done_custom_ids(output_path)
    todo = [j for j in jobs if j.custom_id not in done]
    skipped = len(jobs) - len(todo)
    counts = {"ok": 0, "failed": 0}
    tokens = 0
    start = time.monotonic()
    gate = asyncio.Semaphore(max_in_flight)
    _end_with_newline(output_path)
    with open(output_path, "a", encoding="utf-8") as out, \
            tqdm(total=len(todo), desc="generate", unit="req", file=sys.stderr,
                 disable=None) as bar:  # None: off when stderr is not a terminal

        def write(line: dict[str, Any]) -> None:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            counts["ok" if line["error"] is None else "failed"] += 1
            bar.update(1)

        async def run(job: Job) -> None:
            nonlocal tokens
            try:
                status, rid, body = await api.handle(job.url, {**defaults, **job.body})
            except Exception as exc:  # noqa: BLE001 - one line's failure is its own
                status, rid = 500, None
                body = {"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                  "type": "server_error", "param": None,
                                  "code": "internal_error"}}
            finally:
                gate.release()
            if status == 200:
                tokens += body["usage"]["completion_tokens"]
                bar.set_postfix_str(f"{tokens / (time.monotonic() - start):.1f} tok/s",
                                    refresh=False)
            write(output_line(job, status, rid, body))

        for job in todo:
            if job.error is not None:
                write(output_line(job))
        running: set[asyncio.Task] = set()
        for job in todo:  # at most ``max_in_flight`` lines are tokenized and queued at once
            if job.error is None:
                await gate.acquire()
                task = asyncio.create_task(run(job))
                running.add(task)
                task.add_done_callback(running.discard)
        await asyncio.gather(*running)
    elapsed = time.monotonic() - start
    print(f"dllm generate: {counts['ok']} done, {counts['failed']} failed, {skipped} skipped "
          f"(already in {output_path}); {tokens} tokens in {elapsed:.1f} s "
          f"({tokens / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def _end_with_newline(path: str) -> None:
    """A run killed mid-write may leave a torn last line; start ours on a fresh one."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
