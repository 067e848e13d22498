"""Scale-out behind sglang-router: two ``dllm serve`` instances of the built-in model (CPU)
behind ``python -m sglang_router.launch_router --worker-urls A B`` serve the official
``openai`` client's requests, with the single server's answers, and the router registers both
workers from their ``/server_info``, ``/model_info``, ``/health`` and ``/get_load``.

Needs the optional extra ``dllm[router]`` (``pip install sglang-router``); skipped without it."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from dllm.server.metrics import PREFIX
from tests.reliability.harness import HOST, free_port, metrics, serving

pytest.importorskip("sglang_router", reason="sglang-router is not installed "
                    "(pip install 'dllm[router]')")
openai = pytest.importorskip("openai")

PROMPTS = ["What is 2 plus 3?", "Sort the letters of cab", "Reverse the word stone",
           "How many letters are in banana?"]


def _finished(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith(f"{PREFIX}requests_finished"))


def _wait_workers(router: str, proc: subprocess.Popen, n: int, timeout: float = 120.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the router exited"
        try:
            workers = httpx.get(router + "/workers", timeout=5).json()["workers"]
            if len(workers) == n and all(w["is_healthy"] for w in workers):
                return workers
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the router did not register {n} healthy workers in {timeout} s")


def test_two_servers_behind_sglang_router(tmp_path):
    with serving(tmp_path, ("a", ()), ("b", ())) as (a, b):
        name = httpx.get(a.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert httpx.get(a.url + "/get_load", timeout=10).json() == [
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        info = httpx.get(a.url + "/model_info", timeout=10).json()
        assert info["served_model_name"] == name and info["is_generation"] is True
        assert httpx.get(a.url + "/get_server_info", timeout=10).json()["dp_size"] == 1

        port = free_port()
        log = open(tmp_path / "router.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST, "--port",
             str(port), "--worker-urls", a.url, b.url, "--policy", "round_robin",
             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        router = f"http://{HOST}:{port}"
        try:
            workers = _wait_workers(router, proc, 2)
            assert sorted(w["url"] for w in workers) == sorted([a.url, b.url])
            assert {w["model_id"] for w in workers} == {name}
            assert {w["metadata"]["architectures"] for w in workers} == {
                f'["{info["architectures"][0]}"]'}

            client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
            direct = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
            assert [m.id for m in client.models.list().data] == [name]
            before = _finished(a.url), _finished(b.url)
            for prompt in PROMPTS:  # greedy: the router's answer is the single server's
                messages = [{"role": "user", "content": prompt}]
                got = client.chat.completions.create(model=name, messages=messages,
                                                     max_tokens=24, temperature=0)
                want = direct.chat.completions.create(model=name, messages=messages,
                                                      max_tokens=24, temperature=0)
                assert got.choices[0].message.content == want.choices[0].message.content
                assert got.choices[0].message.content
                assert got.usage.completion_tokens == want.usage.completion_tokens
            stream = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24,
                temperature=0, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            first = direct.chat.completions.create(
                model=name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24,
                temperature=0)
            assert text == first.choices[0].message.content
            done = _finished(a.url) - before[0], _finished(b.url) - before[1]
            # a saw its 5 direct requests plus its share of the router's 5 (round robin)
            assert done[1] >= 2 and done[0] >= 5 + 2 and sum(done) == 5 + 5 + 0
            assert proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
