"""Overlapped scheduling (``overlap_schedule``): each step is queued before the previous
step's result is read, and rows continue from results still in flight on the device. On the
CPU a forward finishes before ``step`` returns, so the overlapped path runs here in full: its
outputs and forward counts must equal the plain loop's, request by request."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import fail_on_token

MIXED = [  # algorithm settings and sampling of each request, cycled
    dict(temperature=0.0, dllm={"algorithm": "low_confidence_static", "steps_per_block": 2}),
    dict(temperature=0.8, top_k=20, dllm={"algorithm": "low_confidence_dynamic",
                                          "threshold": 0.5, "steps_per_block": 4}),
    dict(temperature=0.0, dllm={"algorithm": "threshold", "threshold": 0.6}),
    dict(temperature=0.7, dllm={"algorithm": "joint_threshold", "threshold": 0.6,
                                "edit_threshold": 0.5, "max_post_edit_steps": 2}),
]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 200, (1 + (5 * i) % 13,), generator=g).tolist() for i in range(n)]


def params_list(n: int, max_new: int, **extra) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=max_new + i % 3, seed=i, **{**MIXED[i % 4], **extra})
            for i in range(n)]


def run(llm: LLM, ps: list[list[int]], params: list[SamplingParams], staggered: bool = True):
    """Requests join one per step (so rows start, resolve and finish at every step); returns
    each request's tokens, forward counts and finish reason, and how many forwards carried
    rows from a result still in flight."""
    e = llm.engine
    carried = []
    forward = e.runner.forward

    def counting(batch, post=None):
        carried.append(batch.carry is not None)
        return forward(batch, post)

    e.runner.forward = counting
    try:
        reqs = [e.make_request(p, sp) for p, sp in zip(ps, params, strict=True)]
        waiting = list(reqs)
        while any(not r.finished for r in reqs):
            if waiting:
                e.add_request(waiting.pop(0))
                if not staggered:
                    while waiting:
                        e.add_request(waiting.pop(0))
            e.step()
        e.drain()
    finally:
        e.runner.forward = forward
    e.check_memory()
    e.clear_prefix_cache()  # the prefix cache's pages, freed
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages
    # Counted as with separate commits: the plain schedule merges every commit into the next
    # block's first step, the overlap schedule only those it is sure of (one forward fewer
    # each); every commit happens exactly once either way.
    outs = [(r.output_ids, r.num_forward_passes + r.num_merged_commits, r.num_denoise_forwards,
             r.num_commit_forwards + r.num_merged_commits, r.num_blocks_committed,
             r.finish_reason) for r in reqs]
    return outs, sum(carried)


def pair(path: str, **kw) -> tuple[LLM, LLM]:
    return (LLM(path, overlap_schedule=True, **kw), LLM(path, overlap_schedule=False, **kw))


def test_overlap_is_off_on_cpu_by_default(sdar_dir):
    llm = LLM(sdar_dir, max_running_requests=2)
    assert llm.engine.overlap is False
    assert LLM(sdar_dir, max_running_requests=2, overlap_schedule=True).engine.overlap


@pytest.mark.parametrize("staggered", [True, False])
def test_block_diffusion_overlap_equals_plain(sdar_dir, staggered):
    over, plain = pair(sdar_dir, max_running_requests=5, page_size=4)
    ps, params = prompts(12), params_list(12, 9)
    got, carried = run(over, ps, params, staggered)
    want, none = run(plain, ps, params, staggered)
    assert got == want
    assert none == 0 and carried > 10  # rows really continued from in-flight results


def test_block_diffusion_overlap_with_stops(sdar_dir):
    """EOS-like stop ids and stop strings end requests inside a block while their next
    forward is already queued: the queued forward is dropped, the output is the same."""
    over, plain = pair(sdar_dir, max_running_requests=4, page_size=4)
    ps = prompts(8, seed=1)
    free = [o.token_ids for o in plain.generate(ps, params_list(8, 12))]
    plain.engine.clear_prefix_cache()  # both runs below prefill (equal forward counts)
    text = plain.engine.tokenizer.decode(free[0][4:7])
    params = params_list(8, 12, stop_token_ids=[free[i][5 + i] for i in (1, 3, 6)],
                         stop=[text])
    got, _ = run(over, ps, params)
    want, _ = run(plain, ps, params)
    assert got == want
    assert any(reason.value == "stop" for *_, reason in want)


def test_shifted_logits_overlap_equals_plain(tmp_path):
    """Fast-dLLM v2: the next block's first token comes from the commit forward's result,
    so an overlapped row waits for it; outputs and forward counts are unchanged."""
    path = str(make_tiny_checkpoint("Fast_dLLM_QwenForCausalLM", tmp_path, seed=5))
    over, plain = pair(path, max_running_requests=4, page_size=4)
    ps = prompts(6, seed=2)
    params = [SamplingParams(max_new_tokens=20 + i, seed=i, temperature=0.5 * (i % 2),
                             ignore_eos=True) for i in range(6)]
    got, carried = run(over, ps, params)
    want, _ = run(plain, ps, params)
    assert got == want and carried > 0


def test_llada2_overlap_equals_plain(tmp_path):
    path = str(make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path, seed=6))
    over, plain = pair(path, max_running_requests=3, page_size=8)
    ps = prompts(5, seed=3)
    params = [SamplingParams(max_new_tokens=40, seed=i, temperature=0.6 * (i % 2),
                             ignore_eos=True) for i in range(5)]
    got, carried = run(over, ps, params)
    want, _ = run(plain, ps, params)
    assert got == want and carried > 0


@pytest.mark.parametrize("chunk", [4096, 5])
def test_autoregressive_overlap_equals_plain(tmp_path, chunk):
    """Decode rows continue from the token sampled by a decode or a (chunked) prefill still
    in flight; a request sure to reach ``max_new_tokens`` is not decoded once more."""
    path = str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, seed=7))
    over, plain = pair(path, max_running_requests=4, max_prefill_tokens=chunk)
    ps = prompts(9, seed=4)
    params = [SamplingParams(max_new_tokens=1 + 3 * i, seed=i, temperature=0.9 * (i % 2),
                             top_p=0.9, stop_token_ids=[55]) for i in range(9)]
    got, carried = run(over, ps, params)
    want, _ = run(plain, ps, params)
    assert carried > 0
    if chunk < 4096:
        # A slot freed one step later admits the next request one step later, so a shared
        # prefill budget may split its prompt differently: same tokens, other forward counts.
        got, want = ([(o[0], o[-1]) for o in outs] for outs in (got, want))
    assert got == want


def test_failure_under_overlap_spares_the_others(sdar_dir):
    """A forward that fails for one request's tokens is retried request by request after the
    in-flight results are applied: only that request ends with an error."""
    over, plain = pair(sdar_dir, max_running_requests=4, page_size=4)
    poison = 7
    ps = [p for p in prompts(12, seed=5) if poison not in p][:3]
    ps.insert(1, [poison] * 6)
    params = [SamplingParams(max_new_tokens=9, ignore_eos=True, seed=i) for i in range(4)]
    with fail_on_token(over.engine.model, poison):
        got, _ = run(over, ps, params)
    want, _ = run(plain, [ps[0], *ps[2:]], [params[0], *params[2:]])
    assert got[1][-1].value == "error"
    assert [got[0], *got[2:]] == want


def test_abort_while_in_flight_frees_memory(sdar_dir):
    over, _ = pair(sdar_dir, max_running_requests=4, page_size=4)
    e = over.engine
    reqs = [e.make_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
            for p in prompts(3, seed=6)]
    for r in reqs:
        e.add_request(r)
    for _ in range(4):
        e.step()
    assert e.pipeline.pending and reqs[1].inflight == 1  # its last step is queued, not yet read
    e.abort(reqs[1].rid)
    while any(not r.finished for r in reqs):
        e.step()
    e.check_memory()
    e.clear_prefix_cache()  # the prefix cache's pages, freed
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages
    alone = LLM(over.engine.config.model, max_running_requests=4, page_size=4).generate(
        [r.prompt_ids for r in (reqs[0], reqs[2])], SamplingParams(max_new_tokens=30,
                                                                   ignore_eos=True))
    assert [reqs[0].output_ids, reqs[2].output_ids] == [o.token_ids for o in alone]


def test_async_streams_under_overlap_equal_plain_outputs(sdar_dir):
    """The engine thread of ``AsyncLLM`` steps an overlapped engine: concurrent streams end
    with the plain engine's outputs, their streamed tokens add up to them, and a client that
    leaves mid-stream aborts its request (memory returned once the queued step is applied)."""
    import asyncio

    from dllm import AsyncLLM

    ps, params = prompts(8, seed=7), params_list(8, 10)
    want = [o.token_ids for o in LLM(sdar_dir, max_running_requests=4, page_size=4,
                                     overlap_schedule=False).generate(ps, params)]
    a = AsyncLLM(sdar_dir, max_running_requests=4, page_size=4, overlap_schedule=True)
    assert a.engine.overlap

    async def one(p, sp) -> tuple[list[int], list[int]]:
        streamed, final = [], None
        async for chunk in a.generate_stream(p, sp):
            streamed += chunk.delta_token_ids
            final = chunk.output
        return streamed, final.token_ids

    async def leave_early() -> int:
        n = 0
        async for _ in a.generate_stream(ps[0], SamplingParams(max_new_tokens=40,
                                                              ignore_eos=True)):
            n += 1
            if n == 2:
                break  # the request is aborted while its next step may be queued
        return n

    async def main():
        return await asyncio.gather(leave_early(), *(one(p, sp) for p, sp in zip(
            ps, params, strict=True)))

    try:
        left, *got = asyncio.run(main())
        assert left == 2
        assert [final for _, final in got] == want
        assert all(streamed == final for streamed, final in got)
        e = a.engine
        a.call_in_engine(lambda engine: engine.check_memory())
        e.clear_prefix_cache()  # the prefix cache's pages, freed
        assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages
    finally:
        a.shutdown()


def test_failed_launch_after_a_stop_in_flight_retries_only_live_requests(tmp_path):
    """A batch that fails to launch is retried after the results in flight are applied; a
    decoding request that those results finish drops out of the retry, and the others keep
    their positions (an earlier version counted their in-flight forward twice, skipped
    tokens and never finished)."""
    path = str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, seed=7))
    poison, k = 7, 4
    free = LLM(path, overlap_schedule=False).generate(
        [[21, 22, 23]], SamplingParams(max_new_tokens=12, seed=1, temperature=5.0,
                                       ignore_eos=True))[0].token_ids
    stop = free[k]
    assert stop not in free[:k] and stop != poison

    def go(overlap: bool):
        e = LLM(path, overlap_schedule=overlap, max_running_requests=4).engine
        q = e.make_request([11, 12, 13, 14], SamplingParams(max_new_tokens=12, seed=0,
                                                            temperature=5.0, ignore_eos=True))
        r = e.make_request([21, 22, 23], SamplingParams(
            max_new_tokens=12, seed=1, temperature=5.0, ignore_eos=True, stop_token_ids=[stop]))
        p = e.make_request([poison] * 5, SamplingParams(max_new_tokens=12, ignore_eos=True))
        e.add_request(q)
        e.add_request(r)
        with fail_on_token(e.model, poison):
            for step in range(1, 60):
                if step == (k + 2 if overlap else k + 1):  # the step that applies r's stop
                    e.add_request(p)
                e.step()
                if q.finished and r.finished and p.finished:
                    break
        e.drain()
        e.check_memory()
        return [(x.output_ids, x.finish_reason, x.error) for x in (q, r, p)]

    got, want = go(True), go(False)
    assert got == want
    assert [x[1].value for x in got] == ["length", "stop", "error"]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "SDARForCausalLM"])
@pytest.mark.parametrize("how", ["abort", "stop"])
def test_a_reused_request_id_never_gets_the_old_requests_result(tmp_path, arch, how):
    """A request that ended (aborted, or stopped) while its next forward was queued, and a new
    request under the same id right after: the queued result goes nowhere."""
    path = str(make_tiny_checkpoint(arch, tmp_path, seed=0))

    def go(overlap: bool):
        e = LLM(path, overlap_schedule=overlap, max_running_requests=4, page_size=4).engine
        sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
        old = e.make_request([40, 41, 42, 43, 44, 45, 46, 47, 48], sp, rid="x")
        e.add_request(old)
        for _ in range(3):
            e.step()
        if how == "abort":
            e.abort("x")
        else:  # the old request stops at its next result; its following step is queued
            old.params = dataclasses.replace(old.params, max_new_tokens=len(old.output_ids) + 1)
            while not old.finished:
                e.step()
        new = e.make_request([100, 101, 102], sp, rid="x")
        e.add_request(new)
        while not new.finished:
            e.step()
        e.drain()
        e.check_memory()
        # as with separate commits (``run`` above says why)
        return (new.output_ids, new.num_forward_passes + new.num_merged_commits,
                new.finish_reason, new.inflight)

    assert go(True) == go(False)
