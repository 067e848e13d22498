"""Online serving benchmark against a running dllm (or any OpenAI-compatible) server, in the
manner of ``sglang.bench_serving``: streaming completions at a fixed concurrency or with
Poisson arrivals; request throughput, output tokens/s, TTFT, TPOT and end-to-end latency
percentiles. Prints a table and writes ``bench/results/online-*.json`` / ``.md``.

    dllm serve --model DIR --port 8000 &
    python bench/engine/online.py --base-url http://127.0.0.1:8000 --num-requests 200 --concurrency 32

Prompts are random words of ``--prompt-words`` words; every request asks for ``--max-tokens``
with ``ignore_eos`` (a dllm extension, ignored elsewhere) so all requests do the same work.

Shared prefixes (the prefix cache, issue 21): ``--shared-prefix-tokens N`` makes every prompt
the same N random token ids (a system prompt) followed by ``--prompt-tokens`` ids of its own;
``--warmup K`` sends K requests one by one before the timed ones (one primes the cache with the
shared prefix). ``--serve FLAGS`` starts the server itself (``dllm serve FLAGS``) once per
``--prefix-cache`` variant, so cache on and off are measured in one run, side by side
(``--serve-model sdar-8b``: a random-weight checkpoint of that shape, ``--load-format
dummy``). The cached prompt tokens come from each answer's
``usage.prompt_tokens_details.cached_tokens``. The issue's measurement, on one H200:

    python bench/engine/online.py --serve-model sdar-8b --serve "--context-length 4096 \
        --max-running-requests 64" --prefix-cache on,off --shared-prefix-tokens 1000 \
        --prompt-tokens 32 --warmup 1 --num-requests 256 --concurrency 64 --max-tokens 64
TTFT is the first chunk that carries output tokens: one with text, or one whose usage
(``stream_options.continuous_usage_stats``) counts them — random-weight models emit tokens the
test tokenizer decodes to no text, so text alone would put TTFT at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import stamp, write_report  # noqa: E402

WORDS = ("the of and to in is was for on are with as by at from his an were which this have "
         "model block token mask diffusion answer number word river stone light music garden").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    error: str = ""


async def one(client: httpx.AsyncClient, model: str, prompt: str | list[int],
              max_tokens: int, denoise_steps: bool = False,
              logprobs: int | None = None) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if denoise_steps:  # the step events arrive as named events, skipped below
        body["stream_options"]["denoise_steps"] = True
    if logprobs is not None:
        body["logprobs"] = logprobs
    start = time.perf_counter()
    ttft, tokens, usage_seen = None, 0, {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("object") == "denoise.step":
                    continue
                # The first token: a chunk with text, or (``continuous_usage_stats``, which
                # dllm and vLLM send) one whose usage counts output tokens, text or not.
                usage = chunk.get("usage") or {}
                if ttft is None and (usage.get("completion_tokens") or (
                        chunk.get("choices") and chunk["choices"][0].get("text"))):
                    ttft = time.perf_counter() - start
                if usage:
                    tokens = usage["completion_tokens"]
                    usage_seen = usage
    except httpx.HTTPError as exc:
        return Result(False, error=repr(exc))
    latency = time.perf_counter() - start
    details = usage_seen.get("prompt_tokens_details") or {}
    return Result(True, ttft if ttft is not None else latency, latency, tokens,
                  usage_seen.get("prompt_tokens", 0), details.get("cached_tokens") or 0)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def make_prompts(args: argparse.Namespace, rng: random.Random, n: int) -> list[str | list[int]]:
    """Random words, or (a shared prefix or ``--prompt-tokens``) token ids: the shared
    prefix, then ids of each prompt's own."""
    if not (args.shared_prefix_tokens or args.prompt_tokens):
        return [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(n)]
    lo, hi = args.token_range
    shared = [rng.randrange(lo, hi) for _ in range(args.shared_prefix_tokens)]
    return [shared + [rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]
            for _ in range(n)]


async def run(args: argparse.Namespace, base_url: str) -> dict:
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng, args.num_requests + args.warmup)
    warmup, prompts = prompts[: args.warmup], prompts[args.warmup :]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600,
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        for p in warmup:  # one by one, untimed (primes the prefix cache)
            r = await one(client, model, p, args.max_tokens)
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(p: str | list[int], delay: float) -> Result:
            await asyncio.sleep(delay)
            async with sem:
                return await one(client, model, p, args.max_tokens, args.denoise_steps,
                                 args.logprobs)

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if args.request_rate > 0:
                t += rng.expovariate(args.request_rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, d) for p, d in zip(prompts, delays,
                                                                        strict=True)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok
            if r.completion_tokens > 1]
    out_tokens = sum(r.completion_tokens for r in ok)
    summary = {
        "model": model, "num_requests": len(results), "failed": len(results) - len(ok),
        "concurrency": args.concurrency, "request_rate": args.request_rate or "inf",
        "denoise_steps": args.denoise_steps, "logprobs": args.logprobs,
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        **{f"ttft_{q}_ms": pct([r.ttft for r in ok], q) * 1e3 for q in (50, 90, 99)},
        **{f"tpot_{q}_ms": pct(tpot, q) * 1e3 for q in (50, 90, 99)},
        **{f"e2e_{q}_ms": pct([r.latency for r in ok], q) * 1e3 for q in (50, 90, 99)},
        "mean_ttft_ms": statistics.fmean([r.ttft for r in ok]) * 1e3 if ok else float("nan"),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "errors": [asdict(r) for r in results if not r.ok][:5],
    }
    summary["cached_fraction"] = (summary["cached_tokens"] / summary["prompt_tokens"]
                                  if summary["prompt_tokens"] else 0.0)
    return summary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """``dllm serve FLAGS`` on a free local port, until ``/health`` answers 200."""

    def __init__(self, flags: list[str], log_path: Path, timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "dllm.server.cli", "serve", *flags, "--host",
               "127.0.0.1", "--port", str(self.port)]
        print("starting:", shlex.join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; its log: "
                                   f"{log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready after {timeout} s: {log_path}")
            time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def serve_flags(args: argparse.Namespace) -> list[str]:
    flags = shlex.split(args.serve or "")
    if args.serve_model:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from offline import checkpoint_dir  # a random-weight checkpoint of a real shape

        root = Path(tempfile.mkdtemp(prefix="dllm-online-"))
        flags = ["--model", checkpoint_dir(args.serve_model, root), "--load-format", "dummy",
                 *flags]
    return flags


def run_variants(args: argparse.Namespace) -> dict[str, dict]:
    """One summary per variant: the given server, or one launched per ``--prefix-cache``."""
    if args.serve is None and not args.serve_model:
        return {"server": asyncio.run(run(args, args.base_url))}
    flags = serve_flags(args)
    os.makedirs(args.out, exist_ok=True)
    out = {}
    for variant in args.prefix_cache.split(","):
        if variant not in ("on", "off"):
            raise SystemExit(f"--prefix-cache takes on and/or off, got {variant!r}")
        extra = ["--disable-prefix-cache"] if variant == "off" else []
        server = LaunchedServer(flags + extra, Path(args.out) / f"online-server-{variant}.log",
                                args.serve_timeout)
        try:
            out[f"cache {variant}"] = asyncio.run(run(args, server.url))
        finally:
            server.stop()
    return out


def table_of(summaries: dict[str, dict]) -> str:
    first = next(iter(summaries.values()))
    rows = [("requests/s", "request_throughput"), ("output tok/s", "output_tok_s"),
            ("cached prompt tokens", "cached_fraction")] + [
        (k, k) for k in first if k.endswith("_ms")]
    head = "| metric | " + " | ".join(summaries) + " |\n|---|" + "---|" * len(summaries) + "\n"
    return head + "".join(
        f"| {label} | " + " | ".join(f"{s[key]:.2f}" for s in summaries.values()) + " |\n"
        for label, key in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=0.0,
                    help="Poisson arrivals per second (0: all at once, capped by concurrency)")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="token ids of each prompt's own (after the shared prefix)")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="random token ids every prompt starts with (a system prompt)")
    ap.add_argument("--token-range", type=lambda t: tuple(int(x) for x in t.split(",")),
                    default=(10, 200), help="LO,HI: the random token ids' range")
    ap.add_argument("--warmup", type=int, default=0,
                    help="requests sent one by one before the timed ones")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--denoise-steps", action="store_true",
                    help="every request asks for step events (stream_options.denoise_steps)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="every request asks for logprobs with this many alternatives")
    ap.add_argument("--serve", default=None,
                    help="start `dllm serve FLAGS` per variant instead of using --base-url")
    ap.add_argument("--serve-model", default=None,
                    help="with --serve: a random-weight checkpoint of this shape (sdar-8b, "
                         "qwen3-8b, sdar-4b, llada2-mini), --load-format dummy")
    ap.add_argument("--serve-timeout", type=float, default=900.0)
    ap.add_argument("--prefix-cache", default="on,off",
                    help="with --serve: the variants, on and/or off (--disable-prefix-cache)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    summaries = run_variants(args)
    table = table_of(summaries)
    s = next(iter(summaries.values()))
    failed = sum(v["failed"] for v in summaries.values())
    traced = (", step events on" if args.denoise_steps else "") + (
        f", logprobs {args.logprobs}" if args.logprobs is not None else "")
    head = (f"{s['num_requests']} requests per variant ({failed} failed), concurrency "
            f"{s['concurrency']}, rate {s['request_rate']}, shared prefix "
            f"{args.shared_prefix_tokens} tokens, warm-up {args.warmup}{traced}")
    print(f"{head}\n{table}")
    when = stamp()
    write_report(args.out, "online", f"# Online benchmark {when}\n\n{head}\n\n{table}",
                 {"args": vars(args), "variants": summaries}, when)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
