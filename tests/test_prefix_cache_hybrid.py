"""The prefix cache over hybrid Mamba2 + attention models (issue 21): the track slots (the
"mamba extra buffers") and the state snapshots the tree keeps.

A prefill chunk or commit forward that ends on the track grid also writes its state into the
request's track slot in the same forward; the tree takes that slot as the node's snapshot; a
hit restores it into the new request's committed slot. Held here: the restored state equals
the state of a full prefill of the same tokens bit for bit; outputs are token-identical with
the cache on and off for the autoregressive hybrids and block diffusion over a hybrid, with
staggered arrivals, chunked prefill and the overlap schedule (two track slots); a pool short
of state slots evicts snapshots with their pages and loses no request; every state slot is
free or held by the tree at the end, and clearing the tree frees all."""

from __future__ import annotations

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.request import FinishReason
from dllm.testing.factory import make_tiny_hybrid_checkpoint
from dllm.testing.harness import run_staggered

LAYOUTS = ["granite-h-micro", "bamba", "nemotron-h", "mamba2", "granite-h-bd"]
INTERVAL = 8  # the track grid: lcm(block 4 or 1, page 4, 8) = 8 tokens


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrids")
    return {lay: str(make_tiny_hybrid_checkpoint(lay, root / lay, seed=0)) for lay in LAYOUTS}


def make(path: str, cache: bool = True, **kw) -> LLM:
    return LLM(path, page_size=4, max_running_requests=4, state_track_interval=INTERVAL,
               enable_prefix_cache=cache, **kw)


def states_of(llm: LLM, slot: int) -> list[torch.Tensor]:
    pool = llm.engine.runner.state_pool
    return [t[slot].clone() for t in pool.conv + pool.ssm]


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    shared = tokens(19, 1)
    prompts = [shared + tokens(k, 10 + k) for k in (0, 3, 9, 1)]
    prompts += [tokens(11, 20), shared[:9] + tokens(6, 21), list(prompts[2])]
    params = [SamplingParams(max_new_tokens=10 + i % 3, ignore_eos=True, seed=i,
                             temperature=0.7 if i % 2 else 0.0) for i in range(len(prompts))]
    return prompts, params


def run_waves(llm: LLM, prompts, params) -> tuple[list[list[int]], list[int]]:
    e = llm.engine
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out = run_staggered(e, reqs[:1]) + run_staggered(e, reqs[1:4]) + run_staggered(e, reqs[4:])
    e.drain()
    e.check_memory()
    return out, [r.cached_tokens for r in reqs]


def assert_tree_only_then_clear(llm: LLM) -> None:
    e = llm.engine
    e.check_memory()
    pages, states = e.prefix_cache.held()
    pool = e.runner.state_pool
    assert pool.num_free + len(states) == pool.num_slots
    assert e.kv_pool.num_free_pages + len(pages) == e.kv_pool.num_usable_pages
    e.clear_prefix_cache()
    assert pool.num_free == pool.num_slots
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_on_equals_off(checkpoints, layout, overlap) -> None:
    on = make(checkpoints[layout], overlap_schedule=overlap, max_prefill_tokens=16)
    off = make(checkpoints[layout], cache=False)
    assert on.engine.scheduler.tracking and on.engine.num_track_slots == (2 if overlap else 1)
    prompts, params = workload()
    got, cached = run_waves(on, prompts, params)
    want, none = run_waves(off, prompts, params)
    assert got == want and not any(none)
    assert cached[0] == 0 and all(c % INTERVAL == 0 for c in cached)
    assert cached[1] == cached[2] == cached[3] == 16  # the shared 19 tokens: snapshot at 16
    # 9 shared tokens: no snapshot at 8 (the first prefill ran [0, 16) in one chunk), no hit;
    # the prompt sent twice: its snapshot at 24 (the second chunk stopped on the grid)
    assert cached[5] == 0 and cached[6] == 24
    assert on.engine.prefix_cache.num_states > 0
    assert_tree_only_then_clear(on)


@pytest.mark.parametrize("layout", ["granite-h-micro", "granite-h-bd"])
def test_the_restored_state_is_a_full_prefill_s_bit_for_bit(checkpoints, layout) -> None:
    """The snapshot a hit restores (the state after the first 16 tokens, written by the
    first request's prefill into its track slot) equals, bit for bit, the committed state a
    cache-off engine holds after prefilling those 16 tokens (its first prefill chunk)."""
    on = make(checkpoints[layout])
    off = make(checkpoints[layout], cache=False, max_prefill_tokens=16)
    first = tokens(21, 50)
    second = first[:18] + tokens(7, 51)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    on.generate(first, params)
    e = on.engine
    req = e.make_request(second, params)
    e.add_request(req)
    e.scheduler.admit()  # matched and restored; no forward yet
    assert req.cached_tokens == req.prefilled_len == 16
    node = req.prefix_node
    assert node.end == 16 and node.state is not None and node.state != req.state_slot
    restored = states_of(on, req.state_slot)
    assert all(torch.equal(a, b) for a, b in zip(restored, states_of(on, node.state),
                                                 strict=True))

    ref = off.engine.make_request(second, params)
    off.engine.add_request(ref)
    off.engine.step()  # its first prefill chunk: tokens [0, 16)
    assert ref.prefilled_len == 16
    full = states_of(off, ref.state_slot)
    assert any(t.abs().sum() > 0 for t in full)  # a state, not zeros
    assert all(torch.equal(a, b) for a, b in zip(restored, full, strict=True))

    while not req.finished:
        e.step()
    while not ref.finished:
        off.engine.step()
    assert e.output_of(req).token_ids == off.engine.output_of(ref).token_ids
    assert_tree_only_then_clear(on)


def test_consecutive_tracked_chunks_under_overlap_use_both_track_slots(checkpoints) -> None:
    """Prefill chunks of 8 tokens, each ending on the grid, queued back to back under the
    overlap schedule: the second is built while the first's result is unread, so it writes
    the other track slot; both snapshots reach the tree."""
    on = make(checkpoints["granite-h-micro"], overlap_schedule=True, max_prefill_tokens=8)
    off = make(checkpoints["granite-h-micro"], cache=False)
    prompt = tokens(27, 60)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert on.generate(prompt, params)[0].token_ids == off.generate(prompt, params)[0].token_ids
    ends = sorted(n.end for n in _nodes(on) if n.state is not None)
    assert ends == [8, 16, 24]
    again = on.generate(prompt[:25] + [7], params)[0]
    assert again.cached_tokens == 24
    assert again.token_ids == off.generate(prompt[:25] + [7], params)[0].token_ids
    assert_tree_only_then_clear(on)


def _nodes(llm: LLM) -> list:
    out, stack = [], list(llm.engine.prefix_cache.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def test_state_slot_pressure_evicts_snapshots_with_their_pages(checkpoints) -> None:
    """Two running requests (3 state slots each: committed, track, one for the tree): the
    distinct prefixes' snapshots outnumber the free slots, so admissions evict them (with
    their KV pages); every request finishes with the cache-off tokens."""
    path = checkpoints["granite-h-bd"]
    on = LLM(path, page_size=4, max_running_requests=2, state_track_interval=INTERVAL)
    off = LLM(path, page_size=4, max_running_requests=2, enable_prefix_cache=False)
    e = on.engine
    assert e.runner.state_pool.num_slots == 6
    prefixes = [tokens(17, 70 + i) for i in range(4)]
    order = [0, 1, 0, 1, 2, 3, 2, 3, 0, 1]  # reuse soon after, then after eviction
    prompts = [prefixes[k] + tokens(3, 80 + i) for i, k in enumerate(order)]
    params = [SamplingParams(max_new_tokens=9, ignore_eos=True, seed=i) for i in range(10)]
    want = [o.token_ids for o in off.generate(prompts, params)]
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got = run_staggered(e, reqs, after_step=e.check_memory)
    assert [r.finish_reason for r in reqs] == [FinishReason.LENGTH] * 10
    assert got == want
    assert e.prefix_cache.num_evicted_pages > 0  # only state slots were short
    assert e.kv_pool.num_usable_pages > 10 * 8
    assert sum(r.cached_tokens > 0 for r in reqs) >= 2
    assert_tree_only_then_clear(on)


def test_abort_after_a_restore_leaks_no_state_slot(checkpoints) -> None:
    on = make(checkpoints["granite-h-micro"], max_prefill_tokens=4)
    e = on.engine
    first = tokens(20, 90)
    on.generate(first, SamplingParams(max_new_tokens=4, ignore_eos=True))
    req = e.make_request(first[:17] + tokens(12, 91),
                         SamplingParams(max_new_tokens=4, ignore_eos=True))
    e.add_request(req)
    e.step()
    assert req.cached_tokens == 16 and req.needs_prefill
    e.abort(req.rid)
    assert req.state_slot is None and req.track_slots == []
    e.check_memory()
    assert_tree_only_then_clear(on)
