"""``dllm.server.body_worker``: large bodies parsed in worker processes give the answers the
server gives when it parses them itself, and a worker that dies is replaced."""

from __future__ import annotations

import json
import os
import signal

import pytest

from dllm.server.args import Limits
from dllm.server.body_worker import BodyWorkers, parse_and_check
from dllm.server.protocol import APIError

CONTEXT = 1024
MAX_CHARS = 4 * CONTEXT * 8
LIMITS = Limits()

BODIES = [
    ("/v1/completions", {"prompt": ["y" * 5000] * 10, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "x" * (MAX_CHARS + 1)}),
    ("/v1/completions", {"prompt": ["ok", "x" * (MAX_CHARS + 1)]}),
    ("/v1/completions", {"prompt": [[1, 2]] * 65}),
    ("/v1/completions", {"prompt": [{}] * 2000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_CHARS},
                                           {"role": "user", "content": [
                                               {"type": "text", "text": "yy"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/generate", {"text": "z" * (MAX_CHARS + 5), "sampling_params": {"stop": ["a"] * 33}}),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["a"] * 33}}),
    ("/v1/embeddings", {"input": ["a" * (MAX_CHARS + 1)]}),
]
RAW = [b"", b"[1]", b"{" * 3000, b'{"prompt": NaN}', b'{"prompt": "\\ud800"}',
       b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", b"\xff\xfe{}"]


def answer(fn, *args):
    try:
        return "ok", fn(*args)
    except APIError as exc:
        return "error", exc.status, exc.to_dict()


@pytest.fixture(scope="module")
def workers():
    w = BodyWorkers(1)
    yield w
    w.close()


@pytest.mark.parametrize("raw", [json.dumps(b).encode() for _, b in BODIES] + RAW,
                         ids=[f"json{i}" for i in range(len(BODIES))]
                         + [f"raw{i}" for i in range(len(RAW))])
def test_same_answer_as_in_process(workers, raw):
    route = next((r for r, b in BODIES if json.dumps(b).encode() == raw), "/v1/completions")
    args = (raw, route, LIMITS, CONTEXT, MAX_CHARS)
    assert answer(workers.parse, *args) == answer(parse_and_check, *args)


def test_prompt_over_the_character_bound_is_named():
    raw = json.dumps({"prompt": ["ok", "x" * (MAX_CHARS + 1)]}).encode()
    _, status, err = answer(parse_and_check, raw, "/v1/completions", LIMITS, CONTEXT, MAX_CHARS)
    assert status == 400 and err["error"]["param"] == "prompt"
    assert err["error"]["message"] == (f"prompt.1: a prompt of {MAX_CHARS + 1} characters "
                                       f"exceeds the context length of {CONTEXT} tokens")
    within = json.dumps({"prompt": "x" * MAX_CHARS}).encode()
    assert parse_and_check(within, "/v1/completions", LIMITS, CONTEXT, MAX_CHARS)["prompt"]


def test_a_worker_that_dies_is_replaced(workers):
    raw = json.dumps({"prompt": "hi"}).encode()
    dead = workers._idle.queue[0].proc
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    # The body it would have had is parsed in this process; a new worker takes the next one.
    assert workers.parse(raw, "/v1/completions", LIMITS, CONTEXT, MAX_CHARS) == {"prompt": "hi"}
    fresh = workers._idle.queue[0].proc
    assert fresh.pid != dead.pid and fresh.poll() is None
    assert workers.parse(raw, "/v1/completions", LIMITS, CONTEXT, MAX_CHARS) == {"prompt": "hi"}
