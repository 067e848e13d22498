"""The HTTP server as a real process (``python -m dllm.server``) on a free port of 127.0.0.1:
the official ``openai`` client, streaming, the native ``/generate``, every error shape, auth,
body limits, client disconnects (no leaked KV pages), metrics and 100 concurrent streams."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from dllm.testing import make_tiny_checkpoint

API_KEY = "test-key-123"
MAX_REQUEST_BYTES = 64 * 1024
PROMPT = "Diffusion models write"
CONTEXT = 16384


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, log: Path, *extra: str) -> Server:
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dllm.server", "--model", model, "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning",
             "--max-request-bytes", str(MAX_REQUEST_BYTES), *extra],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Server(proc, f"http://127.0.0.1:{port}", log)


def _wait_ready(server: Server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.logs()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s:\n{server.logs()}")


def _stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@contextmanager
def running_servers(logs: Path, *specs: tuple[str, str, tuple[str, ...]]
                    ) -> Iterator[list[Server]]:
    """Servers of ``(model, name, extra flags)`` started at once (their start-ups overlap),
    yielded once all of them answer, stopped on the way out."""
    servers = [_start(model, logs / f"{name}.log", *extra) for model, name, extra in specs]
    try:
        for server in servers:
            _wait_ready(server)
        yield servers
    finally:
        for server in servers:
            _stop(server)


@pytest.fixture(scope="module")
def long_sdar_dir(tmp_path_factory) -> str:
    """A tiny SDAR with a long context, so that a request can run long enough to be
    interrupted (disconnect and abort tests) however fast the machine is."""
    path = tmp_path_factory.mktemp("sdar-long") / "tiny-sdar"
    return str(make_tiny_checkpoint("SDARForCausalLM", path, seed=0,
                                    max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def servers(long_sdar_dir, tmp_path_factory):
    """Both servers start at once (their start-up overlaps); one without and one with a key."""
    with running_servers(
            tmp_path_factory.mktemp("server-logs"),
            (long_sdar_dir, "plain", ("--num-kv-pages", "2048", "--log-stats-interval", "0.5",
                                      "--log-level", "info")),
            (long_sdar_dir, "keyed", ("--api-key", API_KEY, "--served-model-name", "keyed-model",
                                      "other-name", "--num-kv-pages", "256", "--strict-fields",
                                      "--allowed-origins", "http://example.com",
                                      "--engine-nice", "5"))
    ) as (plain, keyed):
        yield plain, keyed


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(long_sdar_dir):
    return AutoTokenizer.from_pretrained(long_sdar_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model_name(long_sdar_dir) -> str:
    return os.path.basename(os.path.normpath(long_sdar_dir))


def metrics_of(http: httpx.Client) -> dict[str, float]:
    """Samples by name (labels folded into the name as name{k=v})."""
    text = http.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until the engine holds no request; return the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_of(http)
        if m["dllm:num_requests_running"] == 0 and m["dllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


# ---- the openai client ----------------------------------------------------------------------
def test_health_and_models(http, model_name, long_sdar_dir):
    assert http.get("/health").json() == {"status": "ok"}
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [model_name]
    assert data[0]["root"] == long_sdar_dir


def test_access_and_periodic_stats_log_lines(server, http):
    """One info line per finished request (its id, token counts, forwards) and, every
    ``--log-stats-interval`` seconds while there is work, the running/waiting/KV/throughput
    line."""
    r = http.post("/generate", json={"text": PROMPT, "rid": "log-probe", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}).json()
    meta = r["meta_info"]
    access = (f"request log-probe: {meta['prompt_tokens']} prompt + "
              f"{meta['completion_tokens']} output tokens, ")
    stats = re.compile(r"running \d+, waiting \d+, KV cache [\d.]+% \((\d+)/(\d+) pages\), "
                       r"([\d.]+) output tokens/s, ([\d.]+) prompt tokens/s")
    deadline = time.monotonic() + 10
    while True:
        log = server.log.read_text(errors="replace")
        found = [m for m in stats.finditer(log) if float(m.group(3)) > 0]
        if access in log and found:
            break
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.2)
    line = log[log.index(access):].splitlines()[0]
    assert re.search(r"\d+ forwards \([\d.]+ tokens/forward\), [\d.]+ s, length$", line), line
    assert all(int(m.group(1)) <= int(m.group(2)) for m in found)


def test_completion_usage_and_text(client, http, tokenizer, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10,
                                    temperature=0)
    native = http.post("/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}).json()
    assert out.object == "text_completion" and out.model == model_name
    assert out.choices[0].text == native["text"]
    assert out.choices[0].finish_reason == native["meta_info"]["finish_reason"]["type"]
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=False))
    assert out.usage.completion_tokens == len(native["output_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_list_prompt_and_token_ids(client, model_name, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    out = client.completions.create(model=model_name, prompt=[PROMPT, "Other text"],
                                    max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6,
                                       temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert by_ids.choices[0].text == out.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_usage(client, model_name, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=model_name, messages=messages,
                                         max_completion_tokens=8, temperature=0)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert 1 <= out.usage.completion_tokens <= 8


def test_stream_equals_non_stream(client, http, model_name):
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=14, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    native = http.post("/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 14, "temperature": 0}}).json()
    assert len(text_chunks) == native["meta_info"]["num_blocks"]  # one per committed block
    assert len({c.id for c in chunks}) == 1


def test_stream_continuous_usage_stats(client, model_name):
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far; the output
    token count grows with each committed block and ends at the non-streamed count."""
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=14, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    text_chunks = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert len(counts) > 1 and counts == sorted(set(counts)) and counts[0] > 0
    assert counts[-1] == full.usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {full.usage.prompt_tokens}
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    plain = list(client.completions.create(**kw, stream=True))  # no usage without the option
    assert all(getattr(c, "usage", None) is None for c in plain)


def test_chat_stream_equals_non_stream(client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Tell me a story"}],
              max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage is None


def test_ignored_dllm_key_is_named(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "dllm": {
        "algorithm": "threshold", "steps_per_block": 4, "eb_gamma": 0.1}})
    err = assert_error(r, 400, "dllm")
    assert err["message"] == ("dllm: the algorithm 'threshold' does not use eb_gamma, "
                              "steps_per_block; it reads threshold")


def test_dllm_settings_per_request(client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    out = client.completions.create(**kw, extra_body={"dllm": {
        "algorithm": "low_confidence_static", "steps_per_block": 2}})
    assert out.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"dllm": {"no_such_key": 1}})
    assert e.value.body["param"] == "dllm"


# ---- native /generate -----------------------------------------------------------------------
def test_generate_native(http, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    sp = {"max_new_tokens": 9, "temperature": 0}
    a = http.post("/generate", json={"text": PROMPT, "sampling_params": sp}).json()
    b = http.post("/generate", json={"input_ids": ids, "sampling_params": sp, "rid": "mine"})
    assert b.json()["output_ids"] == a["output_ids"] and b.json()["meta_info"]["id"] == "mine"
    meta = a["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(a["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert set(meta["finish_reason"]) >= {"type", "matched"}
    batch = http.post("/generate", json={"text": [PROMPT, PROMPT], "sampling_params": sp})
    assert [r["text"] for r in batch.json()] == [a["text"], a["text"]]
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": sp,
                                                 "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == a["text"] and events[-2]["output_ids"] == a["output_ids"]
    assert events[-2]["meta_info"]["finish_reason"] == meta["finish_reason"]


def test_generate_stop_string_matched(http):
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = http.post("/generate", json={"text": PROMPT, "sampling_params": sp}).json()
    assert len(full["text"]) > 3
    stop = full["text"][2:4]
    out = http.post("/generate", json={"text": PROMPT,
                                       "sampling_params": {**sp, "stop": [stop]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and full["text"].startswith(out["text"])


# ---- errors ---------------------------------------------------------------------------------
LONG = "x " * (CONTEXT + 100)  # more tokens than the context, less than the body limit
ERRORS = [
    # (route, body (dict: JSON, str/bytes: raw), status, param)
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 10}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 65}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2, "echo": True}, 400, "echo"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", [1, 2, 3], 400, None),
    ("/v1/completions", '"a string"', 400, None),
    ("/v1/completions", '{"prompt": "hi",', 400, None),
    ("/v1/completions", b"\xff\xfe{}", 400, None),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}, 404, "model"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400,
     "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"dllm": {"threshold": "x"}}}, 400,
     "dllm"),
    ("/generate", {"text": ["a", "b"], "stream": True}, 400, "stream"),
    ("/generate", {"input_ids": [True, 2]}, 400, "input_ids"),
    ("/abort_request", {}, 400, "rid"),
    # Real ranges (int64 buffers, finite floats, the vocabulary), and the limits.
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1e400}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', 400, None),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", 400, None),
    ("/v1/completions", '{"prompt": "\\ud800"}', 400, None),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 33}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a" * 257]}, 400, "stop"),
    ("/v1/completions", {"prompt": ["hi"] * 65}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * (CONTEXT + 1)}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "dllm": {"steps_per_block": -1}}, 400, "dllm"),
    ("/v1/completions", {"prompt": "hi", "dllm": {"steps_per_block": "4"}}, 400, "dllm"),
    ("/v1/completions", {"prompt": "hi", "dllm": {"factor": 1.0}}, 400, "dllm"),
    ("/v1/completions", {"prompt": "hi", "dllm": {"algorithm": "joint_threshold",
                                                  "max_post_edit_steps": 10**9}}, 400, "dllm"),
    ("/generate", {"text": "hi", "rid": "a\nb"}, 400, "rid"),
    ("/generate", {"text": "hi", "rid": "x" * 300}, 400, "rid"),
    ("/abort_request", {"rid": "a b"}, 400, "rid"),
]


@pytest.mark.parametrize("route,body,status,param", ERRORS,
                         ids=[f"{i}-{e[0]}" for i, e in enumerate(ERRORS)])
def test_error_shapes(http, route, body, status, param):
    if isinstance(body, (dict, list)):
        r = http.post(route, json=body)
    else:
        r = http.post(route, content=body, headers={"content-type": "application/json"})
    err = assert_error(r, status, param)
    assert len(err["message"]) < 600  # echoed input is clipped
    assert r.content.isascii()  # what is echoed is escaped


def test_error_echo_is_truncated(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "model": "m" * 5000})
    assert_error(r, 404, "model")
    assert len(r.json()["error"]["message"]) < 300
    r = http.post("/v1/completions", json={"prompt": "hi", "stop": ["s" * 3000, 5]})
    assert_error(r, 400, "stop")
    assert len(r.json()["error"]["message"]) < 300


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_server_survives_bad_input(http, client, model_name):
    json_type = {"content-type": "application/json"}
    for raw in [b"\x00" * 100, b"[" * 1000, b'{"prompt": {"a": 1}}', b"null", b"1e999"]:
        assert http.post("/v1/completions", content=raw, headers=json_type).status_code == 400
        assert_error(http.post("/v1/completions", content=raw), 415)  # no JSON content type
    assert client.completions.create(model=model_name, prompt="ok", max_tokens=2).choices


def test_body_too_large(http):
    big = {"prompt": "x" * (MAX_REQUEST_BYTES + 10), "max_tokens": 1}
    assert_error(http.post("/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit applies while the body streams in
        for _ in range(MAX_REQUEST_BYTES // 1000 + 10):
            yield b" " * 1000

    assert_error(http.post("/v1/completions", content=chunks(),
                           headers={"content-type": "application/json"}), 413)
    assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


# ---- auth -----------------------------------------------------------------------------------
def test_auth(keyed, long_sdar_dir):
    body = {"prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        assert_error(c.post("/v1/completions", json=body), 401)
        assert_error(c.post("/v1/completions", json=body,
                            headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.post("/generate", json={"text": "hi"}), 401)
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        ok = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["model"] == "keyed-model"
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model="keyed-model", prompt="hi", max_tokens=2).choices
    assert client.completions.create(model=long_sdar_dir, prompt="hi", max_tokens=2).choices
    # Within the context but more KV than this server's 256 pages hold: the scheduler refuses
    # it, still a 400.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="keyed-model", prompt="hi", max_tokens=8000)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    assert "KV cache" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="bad", max_retries=0
                      ).completions.create(model="keyed-model", prompt="hi", max_tokens=2)


def test_no_auth_without_key(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                  headers={"Authorization": "Bearer anything"})
    assert r.status_code == 200


# ---- disconnects, abort, metrics ------------------------------------------------------------
LONG_RUN = {"prompt": PROMPT, "max_tokens": CONTEXT - 100, "ignore_eos": True}


def test_stream_disconnect_frees_kv(server, http):
    before = wait_idle(http)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG_RUN, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # got the first block; now hang up
    after = wait_idle(http)
    assert after["dllm:kv_cache_used_pages"] == 0
    assert after["dllm:kv_cache_usage_perc"] == 0
    aborts = "dllm:requests_finished_total{finished_reason=abort}"
    assert after[aborts] == before[aborts] + 1


def test_non_stream_disconnect_aborts(server, http):
    before = wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG_RUN, timeout=1.0)
    after = wait_idle(http)
    assert after["dllm:kv_cache_used_pages"] == 0
    aborts = "dllm:requests_finished_total{finished_reason=abort}"
    assert after[aborts] == before[aborts] + 1


def test_abort_request(server, http):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG_RUN, "stream": True},
                      headers={"X-Request-Id": "abort-me"}) as r:
            lines = r.iter_lines()
            first = next(json.loads(x[6:]) for x in lines if x.startswith("data: "))
            assert first["id"] == "abort-me"
            assert http.post("/abort_request", json={"rid": "abort-me"}).json() == {
                "rid": "abort-me", "aborted": True}
            events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert http.post("/abort_request", json={"rid": "abort-me"}).json()["aborted"] is False
    assert wait_idle(http)["dllm:kv_cache_used_pages"] == 0


def test_duplicate_request_id(server, http):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG_RUN, "stream": True},
                      headers={"X-Request-Id": "dup"}) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator hangs up
            assert next(lines).startswith("data: ")
            again = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              headers={"X-Request-Id": "dup"})
            assert_error(again, 400)
    wait_idle(http)


def test_metrics_series(http, client, model_name):
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8)
    m = metrics_of(http)
    for name in ["dllm:num_requests_running", "dllm:num_requests_waiting",
                 "dllm:kv_cache_usage_perc", "dllm:kv_cache_used_pages",
                 "dllm:kv_cache_total_pages", "dllm:prompt_tokens_total",
                 "dllm:generation_tokens_total",
                 "dllm:requests_finished_total{finished_reason=length}",
                 "dllm:time_to_first_token_seconds_count",
                 "dllm:e2e_request_latency_seconds_count",
                 "dllm:denoise_forwards_per_block_count", "dllm:denoise_forwards_per_block_sum",
                 "dllm:tokens_per_forward_count"]:
        assert name in m, name
    assert m["dllm:prompt_tokens_total"] > 0 and m["dllm:generation_tokens_total"] > 0
    assert m["dllm:kv_cache_total_pages"] > 0
    assert m["dllm:denoise_forwards_per_block_sum"] >= m["dllm:denoise_forwards_per_block_count"]


def test_prefix_cache_usage_and_metrics(http, client, model_name):
    """A prompt sent twice: the second answer reports the prompt tokens the prefix cache
    served as ``usage.prompt_tokens_details.cached_tokens`` (whole chunks of lcm(page 16,
    block 4) tokens, the partial last block excluded), and ``/metrics`` counts them."""
    prompt = list(range(30, 30 + 2 * 16 + 2))  # 2 whole 16-token chunks and 2 tokens
    before = metrics_of(http)
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=4)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    after = wait_idle(http)
    for name in ("dllm:prefix_cache_queries_total", "dllm:prefix_cache_hits_total",
                 "dllm:prefix_cache_hit_rate", "dllm:prefix_cache_pages"):
        assert name in after, name
    assert (after["dllm:prefix_cache_hits_total"]
            - before.get("dllm:prefix_cache_hits_total", 0)) == 32
    assert (after["dllm:prefix_cache_queries_total"]
            - before.get("dllm:prefix_cache_queries_total", 0)) == 68
    assert 0 < after["dllm:prefix_cache_hit_rate"] <= 1
    assert after["dllm:prefix_cache_pages"] >= 2
    assert after["dllm:kv_cache_used_pages"] == 0  # cached pages no request uses are free


# ---- load -----------------------------------------------------------------------------------
def test_100_concurrent_streams(server, http):
    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
        body = {"prompt": f"{PROMPT} {i}", "max_tokens": 8, "stream": True,
                "temperature": 0.7, "seed": i}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["text"] for e in events[:-1]), \
            events[-2]["choices"][0]["finish_reason"]

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(100)))

    results = asyncio.run(run())
    assert len(results) == 100
    assert all(reason in ("stop", "length") for _, reason in results)
    assert wait_idle(http)["dllm:kv_cache_used_pages"] == 0


def test_api_key_covers_metrics_with_its_flag(long_sdar_dir):
    from dllm.config import EngineConfig
    from dllm.server.app import build_app
    from dllm.server.args import ServerConfig

    engine = EngineConfig(model=long_sdar_dir)
    covered = build_app(ServerConfig(engine=engine, api_key=API_KEY, api_key_metrics=True))
    open_ = build_app(ServerConfig(engine=engine, api_key=API_KEY))

    async def get(app, **headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return await c.get("/metrics", headers=headers)

    assert_error(asyncio.run(get(covered)), 401)
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert asyncio.run(get(covered, **key)).status_code == 200
    assert asyncio.run(get(open_)).status_code == 200


def test_not_ready_is_503(long_sdar_dir):
    """Before the engine is loaded (the app's lifespan never runs here) the API is 503."""
    from dllm.config import EngineConfig
    from dllm.server.app import build_app
    from dllm.server.args import ServerConfig

    app = build_app(ServerConfig(engine=EngineConfig(model=long_sdar_dir)))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return [await c.get("/health"), await c.get("/v1/models"),
                    await c.post("/v1/completions", json={"prompt": "hi"}),
                    await c.post("/generate", json={"text": "hi"})]

    for r in asyncio.run(run()):
        assert_error(r, 503)


# ---- the OpenAI fields a newcomer brings (issue 26) ----------------------------------------
def test_openai_client_n_echo_models_retrieve_and_unknown_fields(client, server):
    name = client.models.list().data[0].id
    two = client.completions.create(model=name, prompt="Diffusion", max_tokens=6, n=2,
                                    temperature=1.0, seed=7, echo=True)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.text.startswith("Diffusion") for c in two.choices)
    assert two.usage.completion_tokens == 12 and two.usage.prompt_tokens % 2 == 0  # 2 x 6
    again = client.completions.create(model=name, prompt="Diffusion", max_tokens=6, n=2,
                                      temperature=1.0, seed=7)
    # The same seed gives the same samples; the two samples have distinct seeds.
    assert [c.text for c in again.choices] == [c.text[len("Diffusion"):] for c in two.choices]
    one = client.completions.create(model=name, prompt="Diffusion", max_tokens=6,
                                    temperature=1.0, seed=7)
    assert one.choices[0].text == again.choices[0].text
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    card = client.models.retrieve(client.models.list().data[0].id)
    assert card.id == client.models.list().data[0].id and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = client.completions.with_raw_response.create(
        model=name, prompt="hi", max_tokens=2, extra_body={"temperture": 5, "min_p": 0.1},
        extra_headers={"X-Request-Id": "typo-request"})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while "typo-request" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    warned = [ln for ln in server.log.read_text().splitlines()
              if "typo-request" in ln and "WARNING" in ln]
    assert len(warned) == 1, warned  # once per request
    assert "ignored unknown fields 'min_p', 'temperture'" in warned[0]


def test_strict_fields_names_served_names_and_cors(keyed):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=keyed.url, timeout=60, headers=auth) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperture": 1})
        assert_error(r, 400, "temperture")
        assert "unknown field 'temperture'" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"model": "other-name", "prompt": "hi",
                                             "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["model"] == "keyed-model"
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["keyed-model",
                                                                        "other-name"]
        assert c.get("/v1/models/other-name").json()["id"] == "other-name"
        tok = c.post("/tokenize", json={"prompt": "hello"}).json()
        assert tok["count"] == len(tok["tokens"]) > 0
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {
            "prompt": "hello"}
        assert_error(c.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
        assert c.get("/version").json()["version"]
    # CORS: a preflight from the allowed origin is answered before the key is checked.
    pre = httpx.options(keyed.url + "/v1/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://example.com"
    other = httpx.options(keyed.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


# ---- CPU priorities -------------------------------------------------------------------------
def _threads(pid: int) -> dict[int, tuple[str, int]]:
    """{thread id: (name, niceness)} of a process (Linux)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, nice)
    return out


def _children(pid: int) -> list[tuple[str, int]]:
    """(command line, niceness) of a process's children."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                out.append((cmd, int(fields[16])))
        except (OSError, IndexError):
            continue
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_engine_runs_nicer_than_the_event_loop(server, keyed, http):
    """``--engine-nice 5`` (the keyed server): the engine thread and the threads it started
    (torch's) are named dllm-engine and run 5 nicer than the rest of the server (the event
    loop); the body-worker processes too. The default, 0 (the plain server): all at 0."""
    for srv in (server, keyed):  # the engine has run a step (its torch threads)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert r.status_code == 200, r.text
    for srv, nice in ((server, 0), (keyed, 5)):
        threads = _threads(srv.proc.pid)
        engine = [n for name, n in threads.values() if name == "dllm-engine"]
        rest = [n for name, n in threads.values() if name != "dllm-engine"]
        assert engine and rest, threads
        assert set(engine) == {nice}, threads
        assert set(rest) == {0}, threads
        workers = [n for cmd, n in _children(srv.proc.pid) if "dllm.server.body_worker" in cmd]
        assert workers == [nice, nice], _children(srv.proc.pid)


def test_engine_nice_and_cpu_threads_are_checked():
    from dllm.config import EngineConfig
    from dllm.server.args import ServerConfig

    engine = EngineConfig(model="unused")
    assert ServerConfig(engine=engine).engine_nice == 0
    assert ServerConfig(engine=engine, engine_nice=19, engine_cpu_threads=1).engine_nice == 19
    assert ServerConfig(engine=engine).engine_cpu_threads is None  # one core left (below)
    for bad in ({"engine_nice": -1}, {"engine_nice": 20}, {"engine_nice": True},
                {"engine_cpu_threads": -1}, {"engine_cpu_threads": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(engine=engine, **bad)


def test_a_cpu_engine_leaves_one_core_to_the_event_loop():
    """By default the engine thread of a CPU engine runs torch on every core this process may
    use but one (at least one); a number sets it, 0 keeps torch's default, and an engine on
    another device is left alone."""
    import os
    import threading

    import torch

    from dllm.config import EngineConfig
    from dllm.server.args import server_config_from_args
    from dllm.server.cli import parse
    from dllm.server.priority import default_cpu_threads, engine_thread_init

    for argv, want in (([], None), (["--engine-cpu-threads", "2"], 2),
                       (["--engine-cpu-threads", "0"], 0)):
        args = parse(["serve", "--model", "builtin", *argv])
        assert server_config_from_args(args, EngineConfig(model="x")).engine_cpu_threads == want
    cores = len(os.sched_getaffinity(0))
    assert default_cpu_threads() == max(1, cores - 1)
    before = torch.get_num_threads()

    def threads_after(cpu_threads, device_type: str) -> int:
        seen = []

        def run() -> None:
            engine_thread_init(0, cpu_threads, device_type)()
            seen.append(torch.get_num_threads())

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return seen[0]

    try:
        assert threads_after(None, "cpu") == max(1, cores - 1)
        assert threads_after(3, "cpu") == 3
        torch.set_num_threads(before)
        assert threads_after(0, "cpu") == before
        assert threads_after(None, "cuda") == before
    finally:
        torch.set_num_threads(before)
