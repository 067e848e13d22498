"""The radix prefix cache (issue 21, ``dllm.prefix_cache``) on the tiny checkpoints, CPU, fp32.

Outputs are token-identical with the cache on and off, for every block-diffusion and
autoregressive family, with staggered arrivals and shared and unshared prefixes, with and
without the overlap schedule; a request sharing a k-block prefix with a finished one prefills
only its other blocks (the model's ``EXTEND`` forwards are counted by a forward hook); a pool
too small for every prefix evicts without losing or changing any request; after all requests
end every page is free or held by the tree, and clearing the tree frees all; an abort in the
middle of a shared-prefix prefill leaks nothing. Full-attention dLLMs run without the cache
and say why."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.prefix_cache import PrefixCache
from dllm.request import FinishReason
from dllm.runner.forward_batch import ForwardMode
from dllm.runner.memory import TokenToKVPool
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import run_staggered

PAGE = 4
# architecture -> config overrides (the small block sizes keep the tests fast)
BLOCK_DIFFUSION = {
    "SDARForCausalLM": {},
    "SDARMoeForCausalLM": {},
    "LLaDA2MoeModelLM": {"block_size": 8},
    "Fast_dLLM_QwenForCausalLM": {"bd_size": 8},
}
AUTOREGRESSIVE = {"Qwen3ForCausalLM": {}, "LlamaForCausalLM": {}, "Qwen2ForCausalLM": {}}
FAMILIES = {**BLOCK_DIFFUSION, **AUTOREGRESSIVE}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {arch: str(make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=2, **kw))
            for arch, kw in FAMILIES.items()}


def engine_pair(path: str, **kw) -> tuple[LLM, LLM]:
    kw = {"page_size": PAGE, "max_running_requests": 6, **kw}
    return LLM(path, **kw), LLM(path, enable_prefix_cache=False, **kw)


def chunk_of(llm: LLM) -> int:
    return llm.engine.prefix_cache.chunk


def workload(chunk: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a 3-chunk prefix (plus a token) with tails of 0 to 2 chunks, the very
    same prompt twice, a prompt sharing 1 chunk, and unshared prompts; greedy and sampled."""
    shared = tokens(3 * chunk + 1, 1)
    prompts = [shared + tokens(k, 10 + k) for k in (0, 2, chunk + 1, 2 * chunk)]
    prompts += [list(prompts[1]), shared[:chunk] + tokens(chunk + 3, 30),
                tokens(2 * chunk + 3, 31), tokens(chunk - 1, 32), tokens(5 * chunk, 33)]
    params = [SamplingParams(max_new_tokens=6 + i % 5, ignore_eos=True, seed=i,
                             temperature=0.7 if i % 3 == 1 else 0.0) for i in range(len(prompts))]
    return prompts, params


def run_waves(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Two waves of staggered arrivals (one request joins per step): the second wave finds
    the first wave's prefixes in the cache, and joins while the first is still running."""
    e = llm.engine
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    half = len(reqs) // 2
    out = run_staggered(e, reqs[:2])
    out += run_staggered(e, reqs[2:half])
    out += run_staggered(e, reqs[half:])
    e.drain()
    e.check_memory()
    return [(o, r.cached_tokens) for o, r in zip(out, reqs, strict=True)]


def assert_tree_only_then_clear(llm: LLM) -> None:
    """No request left: every page is free or held by the tree; clearing frees them all."""
    e = llm.engine
    assert not e.has_work
    e.check_memory()
    held, _ = e.prefix_cache.held()
    assert e.kv_pool.num_free_pages + len(held) == e.kv_pool.num_usable_pages
    e.clear_prefix_cache()
    assert e.prefix_cache.num_nodes == 0 and e.prefix_cache.num_pages == 0
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages
    e.check_memory()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_cache_on_equals_off(checkpoints, arch) -> None:
    on, off = engine_pair(checkpoints[arch])
    prompts, params = workload(chunk_of(on))
    got, want = run_waves(on, prompts, params), run_waves(off, prompts, params)
    assert [o for o, _ in got] == [o for o, _ in want]
    assert all(c == 0 for _, c in want)
    cached = [c for _, c in got]
    assert sum(cached) > 0 and cached[0] == 0  # hits, and none for the first request
    c = chunk_of(on)
    assert all(n % c == 0 for n in cached)
    assert cached[4] >= 3 * c  # the prompt sent twice reuses at least the shared chunks
    assert on.engine.scheduler.num_cached_prompt_tokens == sum(cached)
    assert_tree_only_then_clear(on)


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "Fast_dLLM_QwenForCausalLM",
                                  "Qwen3ForCausalLM"])
def test_overlap_schedule_with_the_cache_equals_plain_without(checkpoints, arch) -> None:
    path = checkpoints[arch]
    over = LLM(path, page_size=PAGE, max_running_requests=6, overlap_schedule=True)
    plain = LLM(path, page_size=PAGE, max_running_requests=6, overlap_schedule=False,
                enable_prefix_cache=False)
    prompts, params = workload(chunk_of(over))
    got = run_waves(over, prompts, params)
    assert [o for o, _ in got] == [o for o, _ in run_waves(plain, prompts, params)]
    assert sum(c for _, c in got) > 0
    assert_tree_only_then_clear(over)


@contextmanager
def extend_tokens(llm: LLM) -> Iterator[list[int]]:
    """The token counts of the model's prefill (``EXTEND``) forwards while inside."""
    counts: list[int] = []

    def hook(module, args):
        if args[2].mode is ForwardMode.EXTEND:
            counts.append(int(args[0].shape[0]))

    handle = llm.engine.model.register_forward_pre_hook(hook)
    try:
        yield counts
    finally:
        handle.remove()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_k_block_shared_prefix_prefills_only_the_other_blocks(checkpoints, k) -> None:
    """SDAR (blocks of 4 = one page): the first request's prompt is 6 blocks and 2 tokens; the
    second shares its first k blocks, then differs: it prefills 6 − k blocks."""
    on, off = engine_pair(checkpoints["SDARForCausalLM"])
    b = on.engine.block_size
    first = tokens(6 * b + 2, 100 + k)
    second = first[: k * b] + tokens(6 * b + 2 - k * b, 200 + k)
    assert second[k * b] != first[k * b]
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    with extend_tokens(on) as counts:
        on.generate(first, params)
    assert counts == [6 * b]
    with extend_tokens(on) as counts:
        out = on.generate(second, params)[0]
    assert counts == [(6 - k) * b]
    assert out.cached_tokens == k * b
    assert out.token_ids == off.generate(second, params)[0].token_ids
    assert_tree_only_then_clear(on)


def test_autoregressive_shared_pages_are_not_prefilled(checkpoints) -> None:
    """Qwen3, pages of 4: a finished 17-token prompt leaves its pages (and those of its
    output); a prompt sharing 13 tokens reuses 3 pages and prefills the rest; the very same
    prompt again prefills only its last token."""
    on, off = engine_pair(checkpoints["Qwen3ForCausalLM"])
    first = tokens(17, 7)
    second = first[:13] + tokens(5, 8)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    on.generate(first, params)
    with extend_tokens(on) as counts:
        out = on.generate(second, params)[0]
    assert counts == [18 - 12] and out.cached_tokens == 12
    assert out.token_ids == off.generate(second, params)[0].token_ids
    with extend_tokens(on) as counts:
        again = on.generate(first, params)[0]
    assert counts == [1] and again.cached_tokens == 16
    assert again.token_ids == off.generate(first, params)[0].token_ids
    # A continuation (prompt + output + more) reuses the generated tokens' pages too.
    follow = first + again.token_ids + tokens(3, 9)
    with extend_tokens(on) as counts:
        cont = on.generate(follow, params)[0]
    assert cont.cached_tokens == 20 and counts == [len(follow) - 20]
    assert cont.token_ids == off.generate(follow, params)[0].token_ids
    assert_tree_only_then_clear(on)


def test_memory_pressure_evicts_and_loses_nothing(checkpoints) -> None:
    """A pool of 24 pages, 3 running requests of 6 pages each: 6 pages at most for the tree,
    far fewer than the 5 distinct 3-block prefixes need. Every request finishes with the
    tokens of a cache-off engine with a pool for all; the accounting holds at every step."""
    path = checkpoints["SDARForCausalLM"]
    kw = {"page_size": PAGE, "max_running_requests": 3}
    small = LLM(path, num_kv_pages=24, **kw)
    roomy = LLM(path, enable_prefix_cache=False, **kw)
    prefixes = [tokens(12, 300 + i) for i in range(5)]
    prompts = [prefixes[i % 5] + tokens(2, 400 + i) for i in range(15)]
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, seed=i,
                             temperature=0.7 if i % 2 else 0.0) for i in range(15)]
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    e = small.engine
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got = run_staggered(e, reqs, after_step=e.check_memory)
    assert [r.finish_reason for r in reqs] == [FinishReason.LENGTH] * 15
    assert got == want
    cache = e.prefix_cache
    assert cache.num_evicted_pages > 0  # the tree was evicted for admissions
    assert sum(r.cached_tokens for r in reqs) > 0  # and still served hits
    assert_tree_only_then_clear(small)


def test_abort_in_a_shared_prefix_prefill_leaks_nothing(checkpoints) -> None:
    """The second request matches 2 blocks and prefills 4 more, one block per step
    (``max_prefill_tokens`` 4): aborted after two chunks, it leaves only tree pages; the
    same prompt afterwards gives the cache-off tokens."""
    on, off = engine_pair(checkpoints["SDARForCausalLM"], max_prefill_tokens=4)
    e = on.engine
    first = tokens(22, 500)
    second = first[:8] + tokens(16, 501)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    on.generate(first, params)
    req = e.make_request(second, params)
    e.add_request(req)
    e.step()
    e.step()
    assert req.cached_tokens == 8 and req.prefilled_len == 16 and req.needs_prefill
    e.abort(req.rid)
    assert req.finish_reason is FinishReason.ABORT and not req.kv_pages
    e.check_memory()
    assert on.generate(second, params)[0].token_ids == off.generate(second, params)[0].token_ids
    assert_tree_only_then_clear(on)


def test_full_attention_models_run_without_the_cache(tmp_path) -> None:
    path = make_tiny_checkpoint("LLaDAModelLM", tmp_path / "llada", seed=0)
    e = LLM(str(path), page_size=PAGE, max_running_requests=2).engine
    assert e.prefix_cache is None and not e.prefix_cache_enabled
    assert "whole sequence" in e.prefix_cache_reason
    off = LLM(str(path), page_size=PAGE, max_running_requests=2, enable_prefix_cache=False)
    assert off.engine.prefix_cache_reason == "--disable-prefix-cache"


def test_the_tree_counts_locks_and_evicts_lru_leaves_first() -> None:
    pool = TokenToKVPool(9, 2, 1, 1, 4, torch.float32)  # 8 usable pages of 2 tokens
    cache = PrefixCache(pool, 2)
    a, b = pool.alloc_pages(3), pool.alloc_pages(2)
    node_a, took, _ = cache.insert([1, 2, 3, 4, 5, 6], a)
    assert took == set(a) and cache.num_pages == 3 and cache.evictable_pages == 3
    node_b, took_b, _ = cache.insert([1, 2, 3, 4, 9, 9], [a[0], a[1], *b[1:]])
    assert took_b == {b[1]}  # the first two chunks were in the tree already
    pool.free_pages([b[0]])  # its page duplicated a cached chunk
    assert cache.match([1, 2, 3, 4, 5, 6, 7], 7) is node_a
    assert cache.match([1, 2, 3, 4, 5, 6, 7], 5).end == 4  # cut at the limit
    assert cache.match([7, 7], 2) is cache.root
    cache.lock(node_b)
    assert cache.evictable_pages == 1  # node_a's last chunk only
    cache.evict(num_pages=pool.num_free_pages + 8)  # asks for more than there is
    assert sorted(cache.held()[0]) == sorted([a[0], a[1], b[1]])  # node_b's path is kept
    assert cache.num_evicted_pages == 1
    cache.unlock(node_b)
    assert cache.evictable_pages == 3
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(node_b)
    node_b.refs = node_b.parent.refs = node_b.parent.parent.refs = 0  # undo the bad unlock
    c = pool.alloc_pages(1)
    node_c, _, _ = cache.insert([1, 2, 3, 3], [a[0], c[0]])  # a sibling of node_b's parent
    cache.match([1, 2, 3, 4, 9, 9], 6)  # node_b's path touched: node_c is the oldest leaf
    free = pool.num_free_pages
    cache.evict(num_pages=free + 1)
    assert pool.num_free_pages == free + 1 and cache.match([1, 2, 3, 3], 4).end == 2
    assert cache.match([1, 2, 3, 4, 9, 9], 6) is node_b
    cache.clear()
    assert cache.num_nodes == 0 and pool.num_free_pages == pool.num_usable_pages
