"""Autoregressive models through the same engine: greedy output equals transformers'
``generate()`` token for token, alone and batched with different prompt lengths."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from dllm import LLM, AsyncLLM, SamplingParams
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import run_staggered

ARCHS = ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"]
LENGTHS = [1, 4, 9, 17]


@pytest.fixture(scope="module", params=ARCHS)
def ar(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return LLM(str(path), page_size=4, max_running_requests=8), hf


def prompt_of(n: int) -> list[int]:
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_alone_and_batched(ar):
    llm, hf = ar
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [hf_greedy(hf, prompt_of(n), 12) for n in LENGTHS]
    alone = [llm.generate(prompt_of(n), params)[0].token_ids for n in LENGTHS]
    batched = [o.token_ids for o in llm.generate([prompt_of(n) for n in LENGTHS], params)]
    assert alone == want
    assert batched == want
    out = llm.generate(prompt_of(4), params)[0]
    assert out.num_forward_passes == 12  # one prefill, then one decode per further token
    llm.engine.check_memory()


def test_chunked_prefill_and_staggered_arrivals(ar):
    llm, hf = ar
    e = llm.engine
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    reqs = [e.make_request(prompt_of(n), params) for n in (17, 3, 9)]
    assert run_staggered(e, reqs) == [hf_greedy(hf, prompt_of(n), 6)
                                                         for n in (17, 3, 9)]
    e.check_memory()


def test_sampling_is_seeded_and_stops(ar):
    llm, _ = ar
    p = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    a, b = (llm.generate(prompt_of(6), p)[0].token_ids for _ in range(2))
    assert a == b
    stop_id = a[3]
    out = llm.generate(prompt_of(6), SamplingParams(
        max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True,
        stop_token_ids=[stop_id]))[0]
    assert out.token_ids == a[: a.index(stop_id) + 1] and out.finish_reason == "stop"


def test_fifty_concurrent_streams_complete(ar):
    llm, _ = ar
    a = AsyncLLM(engine=llm.engine)

    async def one(i: int) -> tuple[int, list[int]]:
        ids, n = [], 0
        async for chunk in a.generate_stream(prompt_of(1 + i % 13),
                                             SamplingParams(max_new_tokens=5, ignore_eos=True)):
            ids += chunk.delta_token_ids
            n += 1
        return n, ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    try:
        results = asyncio.run(main())
    finally:
        a.shutdown()
    assert all(n == 5 and len(ids) == 5 for n, ids in results)  # streamed token by token
    llm.engine.check_memory()
    llm.engine.clear_prefix_cache()  # the prefix cache's pages, freed
    assert llm.engine.kv_pool.num_free_pages == llm.engine.kv_pool.num_usable_pages


def test_idle_step_touches_no_memory(ar):
    llm, _ = ar
    e = llm.engine
    before = [b.clone() for b in e.kv_pool.k_buffers]
    free = e.kv_pool.num_free_pages
    e.idle_step()
    assert e.kv_pool.num_free_pages == free
    assert all(torch.equal(a, b) for a, b in zip(before, e.kv_pool.k_buffers, strict=True))
