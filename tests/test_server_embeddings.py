"""``/v1/embeddings`` on a real server process, through the official ``openai`` client: equal
to ``LLM.embed`` on the same checkpoint (float, base64, ``dimensions``, token ids), usage, every
error shape, auth and body limit, a generate-task server refusing it; and ``AsyncLLM.embed``
aborting what is unfinished when cancelled."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from dllm import LLM, AsyncLLM
from dllm.testing import make_tiny_checkpoint
from tests.test_embeddings import sentence_transformers_layout
from tests.test_server import MAX_REQUEST_BYTES, assert_error, running_servers, wait_idle

API_KEY = "embed-key"
NAME = "tiny-embed"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    """(a plain tiny Qwen3, the same weights in the sentence-transformers layout)."""
    root = tmp_path_factory.mktemp("server-emb")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base", seed=2)
    return str(base), sentence_transformers_layout(base, root / "st", "mean", True)


@pytest.fixture(scope="module")
def servers(dirs, tmp_path_factory):
    """An embedding server (``--task embed``, with a key) and a generate server on the plain
    checkpoint; they start together."""
    base, st = dirs
    with running_servers(
            tmp_path_factory.mktemp("server-emb-logs"),
            (st, "embed", ("--task", "embed", "--api-key", API_KEY, "--served-model-name", NAME,
                           "--num-kv-pages", "256")),
            (base, "generate", ("--num-kv-pages", "256"))) as (embed, generate):
        yield embed, generate


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers[0].url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(servers):
    with httpx.Client(base_url=servers[0].url, timeout=60, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def library(dirs) -> LLM:
    return LLM(dirs[1])


@pytest.fixture(scope="module")
def tokenizer(dirs):
    return AutoTokenizer.from_pretrained(dirs[0], local_files_only=True)


def vectors(data) -> np.ndarray:
    return np.array([d.embedding for d in data], dtype=np.float64)


def want(library: LLM, inputs, **kw) -> np.ndarray:
    return np.array([o.embedding for o in library.embed(inputs, **kw)], dtype=np.float64)


# ---- equal to the library -------------------------------------------------------------------
def test_float_equals_library(client, library, tokenizer):
    out = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == NAME
    assert [(d.object, d.index) for d in out.data] == [("embedding", i) for i in range(3)]
    got = vectors(out.data)
    assert got.shape == (3, 64)
    np.testing.assert_allclose(got, want(library, TEXTS), atol=1e-5, rtol=0)
    n = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS)
    assert out.usage.prompt_tokens == n and out.usage.total_tokens == n


def test_base64_equals_library(client, library, http):
    ref = want(library, TEXTS)
    # Asked for explicitly, the client hands back the base64 strings as they came.
    raw = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in raw.data)
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                    for d in raw.data])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    # Left out, the client asks for base64 and decodes it itself.
    auto = client.embeddings.create(model=NAME, input=TEXTS)
    np.testing.assert_allclose(vectors(auto.data), ref, atol=1e-5, rtol=0)
    # The server's own default is float.
    data = http.post("/v1/embeddings", json={"input": TEXTS[0]}).json()["data"]
    assert isinstance(data[0]["embedding"], list)
    np.testing.assert_allclose(data[0]["embedding"], ref[0], atol=1e-5, rtol=0)


def test_dimensions(client, library):
    for fmt in ("float", "base64"):
        out = client.embeddings.create(model=NAME, input=TEXTS, dimensions=16,
                                       encoding_format=fmt)
        got = vectors(out.data) if fmt == "float" else np.stack(
            [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in out.data])
        assert got.shape == (3, 16)
        np.testing.assert_allclose(got, want(library, TEXTS, dimensions=16), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)  # re-normalised


def test_single_string_and_token_ids(client, library, tokenizer, dirs):
    one = client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float")
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    by_ids = client.embeddings.create(model=dirs[1], input=ids[1], encoding_format="float")
    many = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert len(one.data) == len(by_ids.data) == 1 and len(many.data) == 3
    ref = want(library, TEXTS)
    np.testing.assert_allclose(vectors(one.data)[0], ref[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(vectors(by_ids.data)[0], ref[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(vectors(many.data), ref, atol=1e-5, rtol=0)
    assert one.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids[1])
    assert many.usage.total_tokens == sum(map(len, ids))


def test_concurrent_requests_free_their_memory(servers, http, library):
    async def run():
        client = openai.AsyncOpenAI(base_url=servers[0].url + "/v1", api_key=API_KEY,
                                    max_retries=0)
        async with client:
            return await asyncio.gather(*(client.embeddings.create(
                model=NAME, input=[f"{t} {i}" for t in TEXTS], encoding_format="float")
                for i in range(20)))

    outs = asyncio.run(run())
    np.testing.assert_allclose(vectors(outs[7].data),
                               want(library, [f"{t} 7" for t in TEXTS]), atol=1e-5, rtol=0)
    assert wait_idle(http)["dllm:kv_cache_used_pages"] == 0


# ---- errors ---------------------------------------------------------------------------------
ERRORS = [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": ["a", 1]}, 400, "input"),
    ({"input": [True, 2]}, 400, "input"),
    ({"input": [1, 2, 10**9]}, 400, "input"),
    ({"input": {"text": "hi"}}, 400, "input"),
    ({"model": NAME}, 400, "input"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "dimensions": 65}, 400, "dimensions"),
    ({"input": "hi", "dimensions": "8"}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "encoding_format": None}, 400, "encoding_format"),
    ({"input": "hi", "model": "no-such-model"}, 404, "model"),
    ([1, 2], 400, None),
    ("", 400, None),
]


@pytest.mark.parametrize("body,status,param", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_error_shapes(http, body, status, param):
    if isinstance(body, str):
        r = http.post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/embeddings", json=body)
    assert_error(r, status, param)


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NAME, input="hi", dimensions=1000)
    assert e.value.body["param"] == "dimensions"


def test_auth_and_body_limit(servers, http):
    url = servers[0].url + "/v1/embeddings"
    assert_error(httpx.post(url, json={"input": "hi"}), 401)
    assert_error(httpx.post(url, json={"input": "hi"}, headers={"Authorization": "Bearer x"}),
                 401)
    assert_error(http.post("/v1/embeddings", json={"input": "x" * (MAX_REQUEST_BYTES + 10)}),
                 413)


def test_generate_server_refuses_embeddings(servers, http):
    with httpx.Client(base_url=servers[1].url, timeout=60) as c:
        err = assert_error(c.post("/v1/embeddings", json={"input": "hi"}), 400)
        assert "--task embed" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}
                      ).status_code == 200
    # ... and an embedding server refuses generation.
    err = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 400)
    assert "/v1/embeddings" in err["message"]
    assert_error(http.post("/generate", json={"text": "hi"}), 400)


# ---- AsyncLLM.embed -------------------------------------------------------------------------
def test_async_embed_equals_library_and_cancel_aborts(dirs, library):
    llm = AsyncLLM(dirs[1], max_prefill_tokens=4)  # 4 tokens a step: long inputs take a while

    async def embed_then_cancel():
        outs = await llm.embed(TEXTS, dimensions=8)
        np.testing.assert_allclose([o.embedding for o in outs],
                                   want(library, TEXTS, dimensions=8), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="empty"):
            await llm.embed(["ok", ""])  # nothing is submitted
        task = asyncio.create_task(llm.embed(["word " * 300] * 4))
        while llm.num_streams < 4:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The loop closes now, before the engine has handled the aborts.

    try:
        asyncio.run(embed_then_cancel())
        deadline = time.monotonic() + 10
        while llm.num_streams or llm.call_in_engine(lambda e: e.has_work):
            assert time.monotonic() < deadline, "the unfinished requests were not aborted"
            time.sleep(0.01)
        llm.call_in_engine(lambda e: e.check_memory())
        again = asyncio.run(llm.embed("hello world"))  # the engine thread is still alive
        np.testing.assert_allclose(again[0].embedding, want(library, "hello world")[0],
                                   atol=1e-5, rtol=0)
    finally:
        llm.shutdown()
