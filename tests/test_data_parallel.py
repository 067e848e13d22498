"""Data-parallel attention on CPU over Gloo: two ranks (one process each), each with its own
requests, scheduler and KV cache, attention replicated and the MLP / MoE layers split over
both (LLaDA2-MoE: three of its six experts per rank). A rank with nothing to run takes
``IDLE`` forwards that join its peer's MLP collectives with zero rows; the tokens equal the
single process's, nothing deadlocks (every call runs under a deadline), and a rank that dies
ends the engine with a clear error.

One data-parallel engine for the module (its ranks are spawned once)."""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager

import pytest

from dllm import LLM, SamplingParams
from dllm.async_llm import AsyncLLM
from dllm.models.moe import StackedExperts
from dllm.models.parallel import record_collectives
from dllm.request import FinishReason
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import fail_on_token
from tests.test_tensor_parallel import _alive

# 6 experts (3 per rank under ep 2), an MLP width 2 ranks split evenly, one dense first layer.
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             intermediate_size=64, moe_intermediate_size=32, num_experts=6, n_group=3,
             topk_group=2, first_k_dense_replace=1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
DEADLINE = 60  # seconds any one data-parallel call may take before the run is ended


@contextmanager
def deadline(seconds: float = DEADLINE):
    """A hang (ranks waiting on each other) ends the test process with every thread's
    traceback instead of blocking CI; a slow call fails the test."""
    start = time.monotonic()
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert time.monotonic() - start < seconds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path_factory.mktemp("dp") / "moe",
                                    seed=1, **SHAPE))


@pytest.fixture(scope="module")
def single(ckpt) -> LLM:
    return LLM(ckpt, max_running_requests=4, page_size=4, block_size=4)


@pytest.fixture(scope="module")
def dp(ckpt):
    with deadline(120):
        llm = LLM(ckpt, max_running_requests=4, page_size=4, block_size=4, data_parallel_size=2,
                  expert_parallel_size=2)
    yield llm
    llm.engine.shutdown()


def _want(single: LLM, prompts, params) -> list[list[int]]:
    """Each prompt alone on the single-process engine."""
    return [single.generate([p], params)[0].token_ids for p in prompts]


def _forwards(llm: LLM) -> list[tuple[int, int]]:
    with deadline():
        return llm.engine.dp_forward_counts()


def test_the_ranks_split_the_experts_and_replicate_attention(dp, single):
    model = dp.engine.model
    experts = next(m for m in model.modules() if isinstance(m, StackedExperts))
    assert (experts.first_expert, experts.local_experts) == (0, 3)
    layer, whole = model.model.layers[0], single.engine.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj.weight
    assert qkv.shape == whole.self_attn.qkv_proj.weight.shape  # every head
    # the dense first layer: its width split in two
    assert layer.mlp.down_proj.weight.shape[1] * 2 == whole.mlp.down_proj.weight.shape[1]
    assert dp.engine.ranks.world == 2 and dp.engine.dp_size == 2


def test_one_request_the_other_rank_idles_throughout(dp, single):
    """One request: rank 0 runs it, rank 1 runs only IDLE forwards, one per forward of rank
    0's, every step; the tokens are the single process's."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    before = _forwards(dp)
    with deadline():
        out = dp.generate([PROMPTS[0]], params)
    (run0, idle0), (run1, idle1) = [(a - c, b - d) for (a, b), (c, d)
                                    in zip(_forwards(dp), before, strict=True)]
    assert [o.token_ids for o in out] == _want(single, PROMPTS[:1], params)
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 12
    assert (idle0, run1) == (0, 0)
    assert idle1 == run0 >= 4  # a prefill and the denoise and commit forwards of 3 blocks
    with deadline():
        dp.engine.check_memory()


def test_staggered_arrivals_and_uneven_lengths(dp, single):
    """A arrives alone (to rank 0; rank 1 idles), B three steps later (to rank 1, the less
    loaded), C after it (a tie: to rank 0). B is the longest, so rank 0 idles at the end
    while rank 1 finishes it. Greedy and sampled tokens equal those of each request alone in
    one process."""
    for params in (SamplingParams(max_new_tokens=12, ignore_eos=True),):
        lengths = [4, 24, 4]
        reqs = [dp.engine.make_request(p, _with_len(params, n))
                for p, n in zip(PROMPTS, lengths, strict=True)]
        before = _forwards(dp)
        with deadline():
            dp.engine.add_request(reqs[0])
            for _ in range(3):
                dp.engine.step()
            dp.engine.add_request(reqs[1])
            assert dp.engine.remote[reqs[1].rid][1] == 1
            dp.engine.step()
            dp.engine.add_request(reqs[2])
            assert reqs[2].rid not in dp.engine.remote  # rank 0's
            while any(not r.finished for r in reqs):
                dp.engine.step()
        counts = [(a - c, b - d) for (a, b), (c, d) in zip(_forwards(dp), before, strict=True)]
        assert all(run > 0 and idle > 0 for run, idle in counts), counts  # both ran and idled
        assert counts[0][0] + counts[0][1] == counts[1][0] + counts[1][1]  # in lockstep
        for req, n in zip(reqs, lengths, strict=True):
            want = _want(single, [req.prompt_ids], _with_len(params, n))[0]
            assert dp.engine.output_of(req).token_ids == want
            assert req.finish_reason is FinishReason.LENGTH
        assert not dp.engine.remote
        with deadline():
            dp.engine.check_memory()


def _with_len(params: SamplingParams, n: int) -> SamplingParams:
    return dataclasses.replace(params, max_new_tokens=n)


def test_many_requests_spread_over_both_ranks(dp, single):
    """Sampled: each request's tokens are those it gets alone in one process."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_k=20,
                            seed=7)
    prompts = PROMPTS + [[40, 41, 42, 43]]
    with record_collectives() as log, deadline():
        out = dp.generate(prompts, params)
    assert [o.token_ids for o in out] == _want(single, prompts, params)
    # Each MLP gathers both ranks' rows of the hidden size (64); no logits cross the ranks.
    gathers = {shape for op, shape in log if op == "all_gather"}
    assert gathers and all(len(s) == 2 and s[1] == 64 for s in gathers)
    with deadline():
        dp.engine.check_memory()


def test_abort_and_bad_input_on_a_data_parallel_engine(dp, single):
    """A request running on rank 1 aborted from rank 0: it ends ABORT and rank 1's memory
    returns; a prompt too long is refused on rank 0 and the engine serves on."""
    engine = dp.engine
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first, second = (engine.make_request(p, params) for p in PROMPTS[:2])
    with deadline():
        engine.add_request(first)
        engine.add_request(second)
        assert engine.remote[second.rid][1] == 1
        engine.step()
        engine.step()
        aborted = engine.abort(second.rid)
        assert aborted is second and second.finish_reason is FinishReason.ABORT
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(engine.make_request(PROMPTS[2], params, first.rid))
        while not first.finished:
            engine.step()
        engine.check_memory()
    with pytest.raises(ValueError):
        engine.make_request(list(range(5, 5000)), params)
    small = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with deadline():
        assert [o.token_ids for o in dp.generate(PROMPTS[:2], small)] == _want(
            single, PROMPTS[:2], small)


def test_logprobs_come_back_from_the_other_rank(dp, single):
    """Attention and LM head are whole on every data-parallel rank, so log-probabilities are
    recorded there (unlike under tensor parallelism) and travel back to rank 0 with the
    tokens: the same tokens, alternatives and values (within 1e-5) as one process's."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
    with deadline():
        reqs = [dp.engine.make_request(p, params) for p in PROMPTS[:2]]
        dp.engine.add_request(reqs[0])
        dp.engine.add_request(reqs[1])
        assert dp.engine.remote[reqs[1].rid][1] == 1
        while any(not r.finished for r in reqs):
            dp.engine.step()
        outs = [dp.engine.output_of(r) for r in reqs]
    for got, prompt in zip(outs, PROMPTS, strict=False):
        ref = single.generate([prompt], params)[0]
        assert got.token_ids == ref.token_ids and len(got.logprobs) == 4
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
            assert abs(a.logprob - b.logprob) <= 1e-5
            assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a.top, b.top, strict=True))


@pytest.mark.parametrize("where", ["start", "layer 1"])
def test_a_batch_failing_on_one_rank_ends_only_its_request(dp, single, where):
    """Rank 0's batch raises (at the forward's start, or in layer 1's attention after layer
    0's MLP ran): its request ends with the error, rank 0 still joins the collectives of rank
    1's forward (the rest of its layers with zero rows), and rank 1's request gets the
    single-process tokens."""
    engine = dp.engine
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    poisoned = engine.make_request([7] * 6, params)
    good = engine.make_request(PROMPTS[1], params)
    inside = engine.model.model.layers[1].self_attn if where == "layer 1" else None
    with fail_on_token(engine.model, 7, inside=inside), deadline():
        engine.add_request(poisoned)
        engine.add_request(good)
        assert poisoned.rid not in engine.remote and engine.remote[good.rid][1] == 1
        while not (poisoned.finished and good.finished):
            engine.step()
    assert poisoned.finish_reason is FinishReason.ERROR and "injected failure" in poisoned.error
    assert engine.output_of(good).token_ids == _want(single, [PROMPTS[1]], params)[0]
    with deadline():
        engine.check_memory()


def test_streams_through_async_llm(dp, single):
    """The server's path: ``AsyncLLM`` on the data-parallel engine streams requests that run
    on either rank; each stream's chunks add up to the single-process tokens."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a = AsyncLLM(engine=dp.engine)

    async def one(prompt: list[int]) -> tuple[list[int], list[int]]:
        ids, final = [], None
        async for chunk in a.generate_stream(prompt, params):
            ids += chunk.delta_token_ids
            final = chunk.output
        return ids, final.token_ids

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    try:
        with deadline():
            got = asyncio.run(main())
    finally:
        a.shutdown()
    want = _want(single, PROMPTS, params)
    assert [ids for ids, _ in got] == [final for _, final in got] == want
    with deadline():
        dp.engine.check_memory()


def test_a_dead_rank_ends_the_engine_and_leaves_no_orphan(ckpt):
    """A data-parallel worker killed mid-run: rank 0 exits with a one-line error naming the
    rank within seconds, and no process is left. (Rank 0 killed: its worker ends by the same
    watchdog as a tensor-parallel one, tested in ``test_tensor_parallel``.)"""
    script = textwrap.dedent(f"""
        from dllm import LLM, SamplingParams
        llm = LLM({ckpt!r}, data_parallel_size=2, expert_parallel_size=2)
        print(llm.engine.ranks.workers[0].pid, flush=True)
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    time.sleep(0.5)
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    proc.wait(timeout=10)
    assert proc.returncode == 1
    err = proc.stderr.read().strip().splitlines()
    assert err == ["dllm: data-parallel rank 1 exited (code -9); stopping"]
    assert not _alive(worker)
    assert time.monotonic() - start < 10
