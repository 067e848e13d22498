"""Online serving benchmark against a running dllm (or any OpenAI-compatible) server, in the
manner of ``sglang.bench_serving``: streaming completions at a fixed concurrency or with
Poisson arrivals; request throughput, output tokens/s, TTFT, TPOT and end-to-end latency
percentiles. Prints a table and writes ``bench/results/online-*.json`` / ``.md``.

    dllm serve --model DIR --port 8000 &
    python bench/engine/online.py --base-url http://127.0.0.1:8000 --num-requests 200 --concurrency 32

Prompts are random words of ``--prompt-words`` words; every request asks for ``--max-tokens``
with ``ignore_eos`` (a dllm extension, ignored elsewhere) so all requests do the same work.
TTFT is the first chunk that carries output tokens: one with text, or one whose usage
(``stream_options.continuous_usage_stats``) counts them — random-weight models emit tokens the
test tokenizer decodes to no text, so text alone would put TTFT at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
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
    error: str = ""


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
              denoise_steps: bool = False, logprobs: int | None = None) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if denoise_steps:  # the step events arrive as named events, skipped below
        body["stream_options"]["denoise_steps"] = True
    if logprobs is not None:
        body["logprobs"] = logprobs
    start = time.perf_counter()
    ttft, tokens = None, 0
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
    except httpx.HTTPError as exc:
        return Result(False, error=repr(exc))
    latency = time.perf_counter() - start
    return Result(True, ttft if ttft is not None else latency, latency, tokens)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
               for _ in range(args.num_requests)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600,
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(p: str, delay: float) -> Result:
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
        "errors": [asdict(r) for r in results if not r.ok][:5],
    }
    return summary


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
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--denoise-steps", action="store_true",
                    help="every request asks for step events (stream_options.denoise_steps)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="every request asks for logprobs with this many alternatives")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    s = asyncio.run(run(args))
    rows = [("requests/s", s["request_throughput"]), ("output tok/s", s["output_tok_s"])] + [
        (k, v) for k, v in s.items() if k.endswith("_ms")]
    table = "| metric | value |\n|---|---|\n" + "".join(f"| {k} | {v:.2f} |\n" for k, v in rows)
    traced = (" (step events on)" if s["denoise_steps"] else "") + (
        f" (logprobs {s['logprobs']})" if s["logprobs"] is not None else "")
    print(f"{s['num_requests']} requests ({s['failed']} failed), concurrency {s['concurrency']}, "
          f"rate {s['request_rate']}, {s['duration_s']:.1f} s{traced}\n{table}")
    when = stamp()
    write_report(args.out, "online", f"# Online benchmark {when}\n\n{table}", s, when)
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
