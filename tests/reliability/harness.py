"""The reliability scenarios, shared by ``tests/reliability/`` (CI-sized counts) and
``bench/stress.py`` (the full run): a real ``dllm serve`` of the built-in model on 127.0.0.1,
and one function per scenario that drives it and returns its figures.

Every loop here is bounded in count and in time, and all traffic goes to 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HOST = "127.0.0.1"
JSON = {"content-type": "application/json"}
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/generate",
               "/abort_request")
# A request of the built-in model (context 1024, blocks of 8) that runs for a while: one token
# per denoise step, every step run.
LONG = {"prompt": "Count the letters in banana", "max_tokens": 960, "ignore_eos": True,
        "dllm": {"algorithm": "low_confidence_static", "steps_per_block": 8}}


# ---- the server -----------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    port: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_mb(self) -> float:
        return rss_mb(self.pid)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# The server (and the /health probe) run in a session of their own, as programs started from
# another terminal or as services: Linux's scheduler (autogroups) then shares the CPU between
# them and the load generator as between programs, instead of among their threads lumped
# together (where the generator's 64 streams compete with the server's engine and event loop,
# and with the probe, directly).
OWN_SESSION = True


def start(log: Path, *flags: str, python: str | None = None, max_fds: int | None = None
          ) -> Server:
    """``dllm serve`` (the built-in model unless ``--model`` is among ``flags``), run by
    ``python`` (default: this interpreter), with at most ``max_fds`` open files if given, in
    a session of its own unless ``OWN_SESSION`` is false."""
    port = free_port()
    out = open(log, "wb")

    def limit_fds() -> None:
        if max_fds is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_fds, max_fds))

    proc = subprocess.Popen(
        [python or sys.executable, "-m", "dllm.server.cli", "serve", "--host", HOST, "--port",
         str(port), *flags], stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit_fds,
        start_new_session=OWN_SESSION, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out.close()
    return Server(proc, f"http://{HOST}:{port}", log, port)


def wait_ready(server: Server, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n"
                               f"{server.logs()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s:\n{server.logs()[-3000:]}")


def stop(server: Server, timeout: float = 60.0) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


@contextmanager
def serving(logs: Path, *specs: tuple[str, tuple[str, ...]], python: str | None = None,
            max_fds: int | None = None) -> Iterator[list[Server]]:
    """Servers of ``(name, flags)``, started at once, stopped on the way out."""
    servers = [start(logs / f"{name}.log", *flags, python=python, max_fds=max_fds)
               for name, flags in specs]
    try:
        for s in servers:
            wait_ready(s)
        yield servers
    finally:
        for s in servers:
            stop(s)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.replace('"', "")] = float(value)
    return out


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["dllm:num_requests_running"] == 0 and m["dllm:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def is_openai_error(status: int, raw: bytes) -> bool:
    """An ``{"error": {"message", "type", "param", "code"}}`` body, ASCII only."""
    if not raw.isascii():
        return False
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} \
        and isinstance(err["message"], str) and bool(err["message"])


# ---- /health while a scenario runs ------------------------------------------------------------
# The probe runs in a process of its own: its latencies are the server's, not the time the
# scenario's own event loop (64 streams of the load, say) takes to notice an answer.
_PROBE = r"""
import http.client, json, sys, threading, time
host, port, every = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies, failures, conn = [], 0, None
while not stop.is_set():
    t = time.perf_counter()
    try:
        conn = conn or http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            failures += 1
    except (OSError, http.client.HTTPException):
        failures, conn = failures + 1, None
    latencies.append((time.perf_counter() - t) * 1000)
    if len(latencies) == 1:
        print("ready", flush=True)
    stop.wait(every)
print(json.dumps([latencies, failures]), flush=True)
"""


class HealthProbe:
    """GET /health every ``every`` seconds on its own connection, from a process of its own
    (started before the scenario, stopped after it); latencies in ms."""

    def __init__(self, url: str, every: float = 0.05):
        self.url, self.every = url, every
        self.latencies: list[float] = []
        self.failures = 0
        self._proc: subprocess.Popen | None = None

    async def __aenter__(self) -> HealthProbe:
        host, port = self.url.rsplit("//", 1)[1].rsplit(":", 1)
        # In a session of its own (a health checker is a program of its own): its latency
        # is then the server's, not also its wait for a CPU behind the load generator.
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, host, port, str(self.every)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=OWN_SESSION)
        first = await asyncio.to_thread(self._proc.stdout.readline)  # one answer: it runs
        if first.strip() != "ready":
            self._proc.kill()
            raise RuntimeError(f"the /health probe did not start: {first!r}")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        out, _ = await asyncio.to_thread(self._proc.communicate, "", 60)
        self.latencies, self.failures = json.loads(out.strip().splitlines()[-1])

    def figures(self) -> dict[str, float]:
        return {"health_p99_ms": round(percentile(self.latencies, 99), 1),
                "health_max_ms": round(max(self.latencies, default=float("nan")), 1),
                "health_failures": self.failures}


def sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- load with disconnects --------------------------------------------------------------------
@dataclass
class LoadResult:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    disconnected: int = 0
    latencies: list[float] = field(default_factory=list)


def _load_body(rng: random.Random, i: int) -> tuple[str, dict]:
    n = rng.randint(4, 24)
    kind = rng.choice(["cmpl", "cmpl_stream", "chat", "chat_stream", "generate"])
    if kind.startswith("cmpl"):
        return "/v1/completions", {"prompt": f"What is {i % 500}+{rng.randint(1, 99)}?",
                                   "max_tokens": n, "stream": kind.endswith("stream"),
                                   "temperature": rng.choice([0, 0.7]), "seed": i}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Reverse the word: w{i}"}],
            "max_tokens": n, "stream": kind.endswith("stream")}
    return "/generate", {"text": f"Sort these words: b{i}, a, c",
                         "sampling_params": {"max_new_tokens": n}}


async def _one_load(c: httpx.AsyncClient, rng: random.Random, i: int, drop: bool,
                    res: LoadResult) -> None:
    route, body = _load_body(rng, i)
    t = time.perf_counter()
    if drop:  # hang up at a random moment: before the answer, or after the first block
        try:
            if body.get("stream"):
                async with c.stream("POST", route, json=body) as r:
                    async for _ in r.aiter_lines():
                        break
            else:
                await asyncio.wait_for(c.post(route, json=body), rng.uniform(0.0, 0.3))
        except (asyncio.TimeoutError, httpx.HTTPError):
            pass
        res.disconnected += 1
        return
    try:
        if body.get("stream"):
            async with c.stream("POST", route, json=body) as r:
                text = "".join([line + "\n" async for line in r.aiter_lines()])
                status = r.status_code
            if status != 200:
                res.errors.append(f"{route} {status} {text[:200]}")
                return
            events = sse_events(text)
            if events[-1] != "[DONE]" or "error" in events[-2]:
                res.errors.append(f"{route} stream ended with {events[-2:]!r:.200}")
                return
        else:
            r = await c.post(route, json=body)
            if r.status_code != 200:
                res.errors.append(f"{route} {r.status_code} {r.text[:200]}")
                return
        res.ok += 1
        res.latencies.append(time.perf_counter() - t)
    except httpx.HTTPError as exc:
        res.errors.append(f"{route} {type(exc).__name__}: {exc}")


async def load_with_disconnects(server: Server, n: int, concurrency: int, drop: float,
                                seed: int = 0, timeout: float = 600.0) -> dict[str, Any]:
    rng = random.Random(seed)
    drops = [rng.random() < drop for _ in range(n)]
    res = LoadResult()
    before = server.rss_mb()
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)

    async def guarded(c, i):
        async with sem:
            await _one_load(c, random.Random(seed * 100003 + i), i, drops[i], res)

    tokens0 = (await asyncio.to_thread(metrics, server.url)).get(
        "dllm:generation_tokens_total", 0.0)
    t = time.perf_counter()
    async with HealthProbe(server.url) as probe:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            await asyncio.wait_for(asyncio.gather(*(guarded(c, i) for i in range(n))), timeout)
    wall = time.perf_counter() - t
    m = await asyncio.to_thread(wait_idle, server.url)
    tokens = m.get("dllm:generation_tokens_total", 0.0) - tokens0
    return {"requests": n, "concurrency": concurrency, "disconnected": res.disconnected,
            "ok": res.ok, "errors": len(res.errors), "error_samples": res.errors[:3],
            "p50_s": round(percentile(res.latencies, 50), 3),
            "p99_s": round(percentile(res.latencies, 99), 3), "wall_s": round(wall, 1),
            "requests_per_s": round(res.ok / wall, 2),
            "output_tokens_per_s": round(tokens / wall, 1),
            "leaked_kv_pages": m["dllm:kv_cache_used_pages"],
            "leaked_request_slots": m["dllm:num_requests_running"]
            + m["dllm:num_requests_waiting"],
            "rss_before_mb": round(before, 1), "rss_after_mb": round(server.rss_mb(), 1),
            **probe.figures()}


# ---- fuzz of malformed bodies -----------------------------------------------------------------
class Raw:
    """A value written into the JSON text as is (NaN, a 5,000-digit integer, an escape)."""

    def __init__(self, text: str):
        self.text = text


def _render(body: Any) -> bytes:
    raws: list[str] = []

    def sub(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"__RAW{len(raws) - 1}__"
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    text = json.dumps(sub(body))
    for i, raw in enumerate(raws):
        text = text.replace(f'"__RAW{i}__"', raw)
    return text.encode()


BIG_INT = Raw("1" * 5000)
SURROGATE = Raw('"\\ud800"')
LOW_SURROGATE = Raw('"x\\udfff"')
_COMMON = [Raw("NaN"), Raw("Infinity"), Raw("1e400"), BIG_INT, "x", [], {}, [None], SURROGATE]
_INT = _COMMON + [2**63, 2**64, -(2**63) - 1, -1, True, ""]
_FLOAT = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), BIG_INT, -1, "x", "",
          [], {}, True, [0.5], LOW_SURROGATE]
_STOP = [5, [5], [""], "", ["a"] * 1000, ["s" * 1000], [SURROGATE], {}, True, [[]]]
_STOP_IDS = [[-1], [2**63], [500], "x", [True], 5, [Raw("NaN")], [BIG_INT], list(range(1000))]
_DLLM = [{"steps_per_block": -1}, {"steps_per_block": "4"}, {"factor": Raw("Infinity")},
         {"alg_temp": Raw("NaN")}, {"threshold": 2}, {"no_such_key": 1},
         {"algorithm": "nope"}, {"algorithm": 5}, {"max_post_edit_steps": 10**9},
         {"algorithm": "joint_threshold", "max_post_edit_steps": 10**9},
         {"steps_per_block": 4}, {"eb_gamma": -1}, {"remasking": "x"},
         {"threshold": Raw("1e400")}, {"block_size": 3}, {"cfg_scale": 1.0}, "x", 5, [],
         {"threshold": SURROGATE}, {"algorithm": "low_confidence_static",
                                   "steps_per_block": BIG_INT}]
_BOOL = ["x", 1, [], {}, Raw("NaN")]
_RID = ["", "a b", "a\nb", SURROGATE, 5, "x" * 1000, "\u00e9t\u00e9", []]
_SAMPLING = {"max_new_tokens": _INT, "temperature": _FLOAT, "top_p": _FLOAT + [0, 1.5],
             "top_k": [v for v in _INT if v != -1] + [-2], "seed": _INT, "stop": _STOP,
             "stop_token_ids": _STOP_IDS, "dllm": _DLLM, "ignore_eos": _BOOL}
_SHARED = {k: v for k, v in _SAMPLING.items() if k != "max_new_tokens"}
# Every value of a field's list is invalid there: one of them makes a valid body malformed.
MUTATIONS: dict[str, dict[str, list]] = {
    "/v1/completions": {
        "prompt": [5, {}, [], "", [True, 2], [[1, -1]], [1] * 3000, [["a"]], [{}], SURROGATE,
                   None, [BIG_INT], ["x"] * 100, [2**63]],
        "max_tokens": _INT + [0, 100000], "n": [0, 65, "x", Raw("NaN"), BIG_INT],
        "stream": _BOOL, "model": [5, "no-such-model", SURROGATE], **_SHARED},
    "/v1/chat/completions": {
        "messages": [[], "hi", [{}], [{"role": "user"}], [{"role": 5, "content": "x"}],
                     [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": SURROGATE}], {}, [5] * 2000],
        "max_tokens": _INT + [0], "max_completion_tokens": _INT + [0], **_SHARED},
    "/v1/embeddings": {"input": [5, "x", [], SURROGATE], "dimensions": _INT,
                       "encoding_format": ["x", 5]},
    "/generate": {"text": [5, [], "", [5], {}, ["x"] * 100, SURROGATE],
                  "input_ids": [["x"], [-1], [2**63], [[1], "x"], [1] * 3000, True],
                  "sampling_params": [5, "x", [], True], "rid": _RID,
                  "stream": _BOOL},
    "/abort_request": {"rid": [*_RID, None]},
}
_NESTED = {"/generate": _SAMPLING}
BASE = {
    "/v1/completions": {"prompt": "What is 2+2?", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/embeddings": {"input": "hello"},
    "/generate": {"text": "What is 2+2?", "sampling_params": {"max_new_tokens": 2}},
    "/abort_request": {"rid": "fuzz"},
}
RAW_BODIES = [b"", b" ", b"null", b"[]", b"[1,2]", b'"text"', b"1", b"{", b'{"prompt": "hi",',
              b"\xff\xfe{}", b"\xed\xa0\x80", b"{" * 2000 + b"}" * 2000, b"[" * 100000,
              b'{"prompt": NaN}', b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
              b'{"a": 1}' * 3, b"\x00" * 64]


def fuzz_bodies(n: int, seed: int = 0) -> list[tuple[str, bytes, dict[str, str]]]:
    """At least ``n`` malformed requests ``(route, body bytes, headers)`` over every POST
    route: raw non-objects and broken JSON, the wrong content type, and valid bodies with one
    to three fields set to a value invalid there."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for route in POST_ROUTES:
        for raw in RAW_BODIES:
            out.append((route, raw, JSON))
        for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
            out.append((route, _render(BASE[route]), {"content-type": ctype}))
    while len(out) < n:
        route = rng.choice(POST_ROUTES)
        body = json.loads(json.dumps(BASE[route]))
        for _ in range(rng.randint(1, 3)):
            nested = _NESTED.get(route)
            if nested and rng.random() < 0.5 and isinstance(body.get("sampling_params"), dict):
                key = rng.choice(sorted(nested))
                body["sampling_params"][key] = rng.choice(nested[key])
                continue
            key = rng.choice(sorted(MUTATIONS[route]))
            body[key] = rng.choice(MUTATIONS[route][key])
        if rng.random() < 0.2:
            body["some_unknown_field"] = rng.choice([1, "x", None])  # allowed, ignored
        out.append((route, _render(body), JSON))
    return out


async def fuzz(server: Server, n: int, seed: int = 0, concurrency: int = 8) -> dict[str, Any]:
    bodies = fuzz_bodies(n, seed)
    by_route: dict[str, dict[int, int]] = {r: {} for r in POST_ROUTES}
    bad: list[str] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(c: httpx.AsyncClient, route: str, raw: bytes, headers: dict[str, str]):
        async with sem:
            try:
                r = await c.post(route, content=raw, headers=headers)
            except httpx.HTTPError as exc:  # the server dropped the connection
                key = type(exc).__name__
                by_route[route][key] = by_route[route].get(key, 0) + 1
                bad.append(f"{route} {key} {raw[:80]!r}")
                return
        by_route[route][r.status_code] = by_route[route].get(r.status_code, 0) + 1
        if not (400 <= r.status_code < 500 and is_openai_error(r.status_code, r.content)):
            bad.append(f"{route} {r.status_code} {raw[:80]!r} -> {r.text[:160]}")

    async with HealthProbe(server.url) as probe:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            await asyncio.wait_for(asyncio.gather(*(one(c, *b) for b in bodies)), 300)
    alive = httpx.post(server.url + "/v1/completions", json=BASE["/v1/completions"],
                       timeout=60).status_code
    return {"bodies": len(bodies), "not_4xx_openai": len(bad), "bad_samples": bad[:5],
            "status_by_route": {r: dict(sorted(v.items(), key=str)) for r, v in
                                by_route.items()},
            "answers_after": alive, **probe.figures()}


# ---- big bodies and prompts -------------------------------------------------------------------
async def _stream_gaps(url: str, stop: asyncio.Event) -> list[float]:
    """A long stream; the arrival times of its chunks while ``stop`` is not set."""
    times: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the stream beside the scenario got {r.status_code}: "
                                   f"{(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    times.append(time.perf_counter())
                if stop.is_set():
                    break
    return times


async def big_prompts(server: Server, chars: int = 9_500_000, parallel: int = 8,
                      invalid_items: int = 1_000_000) -> dict[str, Any]:
    """One prompt of ``chars`` characters, then ``parallel`` of them at once, then a body of
    ``invalid_items`` invalid list items, each while a stream runs."""
    body = json.dumps({"prompt": "x" * chars, "max_tokens": 4}).encode()
    # A prompt list of a million invalid items (10^6 validation errors before).
    invalid = b'{"prompt": [' + b",".join([b"{}"] * invalid_items) + b"]}"
    out: dict[str, Any] = {"prompt_chars": chars, "invalid_body_mb": round(len(invalid) / 2**20,
                                                                         1)}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
        for name, payload, count in [("one", body, 1), ("parallel", body, parallel),
                                     ("invalid_items", invalid, 1)]:
            stop = asyncio.Event()
            gaps = asyncio.create_task(_stream_gaps(server.url, stop))
            await asyncio.sleep(2.0)  # the stream is running (its own cadence measured)
            rss0 = server.rss_mb()
            peak = rss0
            t = time.perf_counter()
            async with HealthProbe(server.url) as probe:
                posts = [asyncio.create_task(c.post("/v1/completions", content=payload,
                                                    headers=JSON)) for _ in range(count)]
                while not all(p.done() for p in posts):
                    peak = max(peak, server.rss_mb())
                    await asyncio.sleep(0.02)
                answers = [p.result() for p in posts]
                elapsed = time.perf_counter() - t
                await asyncio.sleep(0.5)
            stop.set()
            times = await gaps
            window = [x for x in times if x >= t - 0.5]
            gap = max((b - a for a, b in zip(window, window[1:], strict=False)), default=0.0)
            # The stream's own cadence: its longest gap in the 2 s before (the first chunk,
            # after the prompt's prefill, left out); None: under two chunks then.
            before = [x for x in times[1:] if x < t]
            own = max((b - a for a, b in zip(before, before[1:], strict=False)), default=None)
            out[name] = {"statuses": sorted({r.status_code for r in answers}),
                         "openai_shaped": all(is_openai_error(r.status_code, r.content)
                                              for r in answers),
                         "seconds": round(elapsed, 2),
                         "extra_rss_mb": round(peak - rss0, 1),
                         "max_stream_gap_s": round(gap, 3), "stream_chunks": len(window),
                         "stream_gap_before_s": None if own is None else round(own, 3),
                         **probe.figures()}
    return out


# ---- slow and silent sockets, the connection limit, header floods ---------------------------
async def _closed_after(reader: asyncio.StreamReader, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes the connection (reading what it sent), at most
    ``limit``."""
    t = time.perf_counter()
    got = b""
    try:
        while time.perf_counter() - t < limit:
            chunk = await asyncio.wait_for(reader.read(65536), limit)
            if not chunk:
                break
            got += chunk
    except (asyncio.TimeoutError, ConnectionError):
        pass
    return time.perf_counter() - t, got


async def slow_sockets(server: Server, silent: int, slow: int, header_timeout: float,
                       body_timeout: float) -> dict[str, Any]:
    limit = header_timeout + body_timeout + 15  # how long a socket is watched at most

    async def silent_one() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(HOST, server.port)
        try:
            return await _closed_after(reader, limit)
        finally:
            writer.close()

    async def slow_headers() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(HOST, server.port)
        t = time.perf_counter()
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            closer = asyncio.create_task(_closed_after(reader, limit))
            while not closer.done() and time.perf_counter() - t < limit:
                try:
                    writer.write(b"X")  # one byte of a header a second, never ending
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.sleep(1.0 if header_timeout > 1 else 0.2)
            seconds, got = await closer
            return time.perf_counter() - t if not got else seconds, got
        finally:
            writer.close()

    async def slow_body() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(HOST, server.port)
        t = time.perf_counter()
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
            closer = asyncio.create_task(_closed_after(reader, limit))
            while not closer.done() and time.perf_counter() - t < limit:
                try:
                    writer.write(b" ")
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.sleep(0.5)
            _, got = await closer
            return time.perf_counter() - t, got
        finally:
            writer.close()

    async with HealthProbe(server.url) as probe:
        results = await asyncio.gather(*[silent_one() for _ in range(silent)],
                                       *[slow_headers() for _ in range(slow)],
                                       *[slow_body() for _ in range(slow)])
    s, h, b = results[:silent], results[silent:silent + slow], results[silent + slow:]
    return {"silent": silent, "silent_closed_max_s": round(max(x[0] for x in s), 2),
            "slow_headers": slow, "slow_headers_closed_max_s": round(max(x[0] for x in h), 2),
            "slow_headers_408": sum(b" 408 " in x[1][:20] for x in h),
            "slow_body_closed_max_s": round(max(x[0] for x in b), 2),
            "slow_body_408": sum(b" 408 " in x[1][:20] for x in b),
            "header_timeout_s": header_timeout, "body_timeout_s": body_timeout,
            **probe.figures()}


async def connection_limit(server: Server, limit: int, extra: int) -> dict[str, Any]:
    """Hold ``limit`` silent connections, then open ``extra`` more: how fast are they
    refused, how much did the log grow."""
    log0 = server.log.stat().st_size
    held = []
    for _ in range(limit):
        held.append(await asyncio.open_connection(HOST, server.port))
    await asyncio.sleep(0.3)

    async def over() -> tuple[float, bytes]:
        t = time.perf_counter()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, server.port),
                                                    10)
        except (OSError, asyncio.TimeoutError):
            return time.perf_counter() - t, b""
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            _, got = await _closed_after(reader, 15)
            return time.perf_counter() - t, got
        except ConnectionError:
            return time.perf_counter() - t, b""
        finally:
            writer.close()

    refused = await asyncio.gather(*[over() for _ in range(extra)])
    for _, w in held:
        w.close()
    await asyncio.sleep(0.5)
    health = httpx.get(server.url + "/health", timeout=10).status_code
    return {"held": limit, "extra": extra,
            "extra_refused_503": sum(b" 503 " in got[:20] for _, got in refused),
            "extra_answered_200": sum(b" 200 " in got[:20] for _, got in refused),
            "extra_no_answer": sum(not got for _, got in refused),
            "extra_answer_max_s": round(max(t for t, _ in refused), 3),
            "log_growth_kb": round((server.log.stat().st_size - log0) / 1024, 1),
            "health_after": health}


async def header_floods(server: Server, count: int, one_size: int) -> dict[str, Any]:
    """``count`` headers in one request, and one header of ``one_size`` bytes."""
    out: dict[str, Any] = {}

    async def send(head: bytes, name: str) -> None:
        rss0 = server.rss_mb()
        t = time.perf_counter()
        reader, writer = await asyncio.open_connection(HOST, server.port)
        got = b""
        try:
            writer.write(head)
            await asyncio.wait_for(writer.drain(), 60)
            writer.write(b"\r\n")
            _, got = await _closed_after(reader, 30)
        except (ConnectionError, asyncio.TimeoutError):
            _, got = await _closed_after(reader, 5)
        finally:
            writer.close()
        m = re.match(rb"HTTP/1.1 (\d+)", got)
        # None: the server closed the connection while the client was still sending (the
        # kernel then resets it, and the client may never read the answer).
        out[name] = {"status": int(m.group(1)) if m else None,
                     "seconds": round(time.perf_counter() - t, 2),
                     "extra_rss_mb": round(server.rss_mb() - rss0, 1)}

    line = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    async with HealthProbe(server.url) as probe:
        await send(line + b"".join(b"X-H%d: v\r\n" % i for i in range(count)), "many_headers")
        await send(line + b"X-Big: " + b"a" * one_size + b"\r\n", "one_big_header")
    out["headers"], out["big_header_bytes"] = count, one_size
    return {**out, **probe.figures()}


# ---- abort races ------------------------------------------------------------------------------
async def abort_races(server: Server, trials: int, seed: int = 0, list_trials: int = 0
                      ) -> dict[str, Any]:
    """Start a request, abort it after a random delay: ``aborted`` must say whether the
    request ended by the abort."""
    rng = random.Random(seed)
    mismatches: list[str] = []
    counts = {"aborted_true": 0, "aborted_false": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
        async def one(i: int, batch: bool) -> None:
            rid = f"race-{seed}-{i}"
            # A list of 8 runs 8 times as long: at most 64 tokens each, so that one whose
            # abort came before the request existed (it then runs to its end) still ends
            # within the trial's bound on a loaded machine.
            lengths = [8, 16, 64] if batch else [8, 16, 64, 400]
            body = {**LONG, "max_tokens": rng.choice(lengths)}
            if batch:
                body["prompt"] = [f"{LONG['prompt']} {k} " * 8 for k in range(8)]
            run = asyncio.create_task(c.post("/v1/completions", json=body,
                                             headers={"X-Request-Id": rid}))
            await asyncio.sleep(rng.uniform(0.0, 0.05) if not batch else 0.0)
            ab = (await c.post("/abort_request", json={"rid": rid})).json()
            r = await run
            reasons = [ch["finish_reason"] for ch in r.json()["choices"]] \
                if r.status_code == 200 else [f"status {r.status_code}"]
            ended_by_abort = "abort" in reasons
            counts["aborted_true" if ab["aborted"] else "aborted_false"] += 1
            if ab["aborted"] != ended_by_abort:
                mismatches.append(f"{rid}: aborted={ab['aborted']} reasons={reasons}")

        async with HealthProbe(server.url) as probe:
            for i in range(trials):
                await asyncio.wait_for(one(i, False), 120)
            for i in range(list_trials):
                await asyncio.wait_for(one(trials + i, True), 120)
    m = await asyncio.to_thread(wait_idle, server.url)
    return {"trials": trials, "list_trials": list_trials, "mismatches": len(mismatches),
            "mismatch_samples": mismatches[:3], **counts,
            "leaked_kv_pages": m["dllm:kv_cache_used_pages"], **probe.figures()}


# ---- SIGTERM under load -----------------------------------------------------------------------
async def sigterm_under_load(server: Server, long_streams: int, long_plain: int, short: int,
                             shutdown_timeout: float) -> dict[str, Any]:
    """Long and short requests, then SIGTERM: each must end complete or with an OpenAI
    error (a stream: an error event, then ``[DONE]``); the server must exit 0 in time."""
    outcomes: dict[str, int] = {}
    bad: list[str] = []

    def count(kind: str) -> None:
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async def stream(c: httpx.AsyncClient, body: dict) -> None:
        try:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                text = "".join([line + "\n" async for line in r.aiter_lines()])
            events = sse_events(text)
            if r.status_code != 200:
                ok = is_openai_error(r.status_code, text.encode())
                count(f"stream_{r.status_code}" if ok else "stream_bad_error")
            elif events and events[-1] == "[DONE]" and "error" in events[-2]:
                count("stream_error_event")
            elif events and events[-1] == "[DONE]":
                count("stream_complete")
            else:
                count("stream_cut")
                bad.append(text[-200:])
        except httpx.HTTPError as exc:
            count("stream_transport_error")
            bad.append(repr(exc))

    async def plain(c: httpx.AsyncClient, body: dict) -> None:
        try:
            r = await c.post("/v1/completions", json=body)
            if r.status_code == 200:
                count("plain_complete")
            elif is_openai_error(r.status_code, r.content):
                count(f"plain_{r.status_code}")
            else:
                count("plain_bad_error")
                bad.append(r.text[:200])
        except httpx.HTTPError as exc:
            count("plain_transport_error")
            bad.append(repr(exc))

    short_body = {"prompt": "What is 1+1?", "max_tokens": 8}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
        tasks = [asyncio.create_task(stream(c, LONG)) for _ in range(long_streams)]
        tasks += [asyncio.create_task(plain(c, LONG)) for _ in range(long_plain)]
        tasks += [asyncio.create_task(plain(c, short_body)) for _ in range(short)]
        await asyncio.sleep(1.5)
        t = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), shutdown_timeout + 60)
        rc = await asyncio.to_thread(server.proc.wait, shutdown_timeout + 60)
        exit_s = time.perf_counter() - t
    log = server.logs()
    return {"requests": long_streams + long_plain + short, "outcomes": dict(sorted(
        outcomes.items())), "bad": len(bad), "bad_samples": bad[:3], "exit_code": rc,
        "exit_s": round(exit_s, 2), "shutdown_timeout_s": shutdown_timeout,
        "tracebacks": log.count("Traceback")}


def sigint_idle(server: Server) -> dict[str, Any]:
    t = time.perf_counter()
    server.proc.send_signal(signal.SIGINT)
    rc = server.proc.wait(60)
    return {"exit_code": rc, "exit_s": round(time.perf_counter() - t, 2),
            "tracebacks": server.logs().count("Traceback")}


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")
