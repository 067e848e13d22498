"""Step events and log-probabilities over HTTP, against a real server process: the official
``openai`` client's ``logprobs`` / ``top_logprobs`` (non-stream and stream), the named
``denoise_step`` SSE events (their replay gives the output, one per denoise forward), and a
stream that did not ask, byte for byte the same as one that did minus its events."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.test_server import _start, _stop, _wait_ready

PROMPT = "Diffusion models write"
DLLM = {"algorithm": "low_confidence_static", "steps_per_block": 4}


@pytest.fixture(scope="module")
def server(sdar_dir, tmp_path_factory):
    s = _start(sdar_dir, tmp_path_factory.mktemp("denoise-logs") / "server.log",
               "--num-kv-pages", "512", "--served-model-name", "tiny-sdar")
    try:
        _wait_ready(s)
        yield s
    finally:
        _stop(s)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(sdar_dir):
    return AutoTokenizer.from_pretrained(sdar_dir, local_files_only=True)


def messages(raw: bytes) -> list[tuple[str | None, str]]:
    """The SSE messages of a body: ``(event name or None, data)``."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        event = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((event, "\n".join(data)))
    return out


def replay(events: list[dict]) -> list[int]:
    out: dict[int, int] = {}
    for ev in events:
        for g in ev["given"]:
            out[ev["block"]["offset"] + g["position"]] = g["token_id"]
        for c in ev["committed"]:
            out[ev["block"]["offset"] + c["position"]] = c["token_id"]
    assert sorted(out) == list(range(len(out)))
    return [out[i] for i in range(len(out))]


def test_completion_logprobs_openai_client(client, http):
    out = client.completions.create(model="tiny-sdar", prompt=PROMPT, max_tokens=10,
                                    logprobs=3, extra_body={"ignore_eos": True, "dllm": DLLM})
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert n == 10 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # tokens decoding to the same text share a key
        values = list(top.values())
        assert values == sorted(values, reverse=True) and values[0] >= chosen - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The same request on /generate: the same tokens and values.
    native = http.post("/generate", json={
        "text": PROMPT, "return_logprob": True, "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, "dllm": DLLM}}).json()
    meta = native["meta_info"]
    assert [v for v, _, _ in meta["output_token_logprobs"]] == lp.token_logprobs
    assert [i for _, i, _ in meta["output_token_logprobs"]] == native["output_ids"]
    assert all(len(t) == 3 for t in meta["output_top_logprobs"])
    # Streamed: the chunks' logprobs joined are the same.
    stream = client.completions.create(model="tiny-sdar", prompt=PROMPT, max_tokens=10,
                                       logprobs=3, stream=True,
                                       extra_body={"ignore_eos": True, "dllm": DLLM})
    got = [v for c in stream for v in (c.choices[0].logprobs.token_logprobs
                                       if c.choices[0].logprobs else [])]
    assert got == lp.token_logprobs


def test_chat_logprobs_openai_client(client):
    kw = dict(model="tiny-sdar", messages=[{"role": "user", "content": "Hello"}],
              max_tokens=8, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "dllm": DLLM})
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-6
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    streamed = [t.logprob for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.logprob for t in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content


def _raw_stream(url: str, body: dict) -> bytes:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        return r.read()


_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def test_step_events_replay_and_leave_other_streams_unchanged(server, http, tokenizer):
    """Three streams at once: two ask for step events (completions, chat), one does not.
    The events of each replay to its output and count its denoise forwards; the stream that
    asked, without its events, is byte for byte the stream that did not (ids and times
    aside)."""
    base = {"model": "tiny-sdar", "prompt": PROMPT, "max_tokens": 11, "ignore_eos": True,
            "dllm": DLLM, "stream": True, "stream_options": {"include_usage": True}}
    asked = {**base, "stream_options": {"include_usage": True, "denoise_steps": True}}
    chat = {"model": "tiny-sdar", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 7, "ignore_eos": True, "stream": True,
            "stream_options": {"denoise_steps": True}}

    async def run():
        return await asyncio.gather(
            asyncio.to_thread(_raw_stream, server.url + "/v1/completions", asked),
            asyncio.to_thread(_raw_stream, server.url + "/v1/completions", base),
            asyncio.to_thread(_raw_stream, server.url + "/v1/chat/completions", chat))

    with_steps, without, chat_raw = asyncio.run(run())
    msgs = messages(with_steps)
    events = [json.loads(d) for e, d in msgs if e == "denoise_step"]
    assert events and all(e["object"] == "denoise.step" for e in events)
    assert not any(e == "denoise_step" for e, _ in messages(without))
    kept = b"".join(b"data: " + d.encode() + b"\n\n" for e, d in msgs if e is None)
    assert _VOLATILE.sub(b"", kept) == _VOLATILE.sub(b"", without)
    assert msgs[-1] == (None, "[DONE]")
    # Replay: the events' tokens are the output; one event per denoise forward.
    ids = replay(events)[:11]
    text = "".join(json.loads(d)["choices"][0]["text"] for e, d in msgs
                   if e is None and d != "[DONE]" and json.loads(d)["choices"])
    assert tokenizer.decode(ids) == text
    native = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 11, "ignore_eos": True, "dllm": DLLM}}).json()
    assert native["output_ids"] == ids
    assert len(events) == native["meta_info"]["num_denoise_forwards"]
    assert [e["forward"] for e in events] == list(range(1, len(events) + 1))
    # The chat stream's events: the same contract on the other route.
    chat_msgs = messages(chat_raw)
    chat_events = [json.loads(d) for e, d in chat_msgs if e == "denoise_step"]
    chat_text = "".join(json.loads(d)["choices"][0]["delta"].get("content", "")
                        for e, d in chat_msgs if e is None and d != "[DONE]")
    assert tokenizer.decode(replay(chat_events)[:7]) == chat_text


def test_native_generate_step_events(server, http):
    body = {"text": PROMPT, "stream": True, "stream_options": {"denoise_steps": True},
            "sampling_params": {"max_new_tokens": 9, "ignore_eos": True, "dllm": DLLM}}
    msgs = messages(_raw_stream(server.url + "/generate", body))
    events = [json.loads(d) for e, d in msgs if e == "denoise_step"]
    final = json.loads([d for e, d in msgs if e is None and d != "[DONE]"][-1])
    assert replay(events)[:9] == final["output_ids"]
    assert len(events) == final["meta_info"]["num_denoise_forwards"]
    plain = messages(_raw_stream(server.url + "/generate", {**body, "stream_options": None}))
    assert not any(e for e, _ in plain)


def test_openai_client_sees_step_events_as_objects(client):
    """The openai client passes the named events through as objects of their own
    (``object == "denoise.step"``): a client that asked can tell them from chunks."""
    stream = client.completions.create(
        model="tiny-sdar", prompt=PROMPT, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "denoise_steps": True},
        extra_body={"ignore_eos": True, "dllm": DLLM})
    kinds = [c.object for c in stream]
    assert "denoise.step" in kinds and "text_completion" in kinds


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 1}, "top_logprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 99},
     "top_logprobs_num"),
    ("/generate", {"text": "hi", "top_logprobs_num": 2}, "top_logprobs_num"),
])
def test_bad_logprob_fields(http, route, body, param):
    r = http.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
