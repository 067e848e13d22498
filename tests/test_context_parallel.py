"""Context-parallel prefill on CPU over Gloo: an ``EXTEND`` split over 2 or 3 ranks (zigzag)
gives the single-process logits and writes the single-process K/V into every rank's cache, for
block-causal (SDAR), causal (Qwen3) and full attention (LLaDA); engines of 2 and 3 ranks give
the single-process tokens, greedy and sampled (and for a Granite-H hybrid, whose prefills run
unsplit).

One ``torch.multiprocessing`` spawn per group size (2, then 3) runs everything of that size:
the model-level prefills, then an ``Engine`` replica per family on every rank (rank 0 drives
it; the others run the calls it mirrors, as ``dllm.distributed`` workers do). One engine is
also started the user's way (``LLM(..., context_parallel_size=2)``). The spawned ranks import
this module, so it keeps the engine (and transformers) out of its imports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dllm import SamplingParams
from dllm.config import EngineConfig
from dllm.distributed import RankGroup
from dllm.models.loader import load_model
from dllm.runner.attention.sdpa import SDPABackend
from dllm.runner.context_parallel import ContextParallel, zigzag_ranges
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode, LogitsMode
from dllm.runner.memory import ReqToTokenPool, TokenToKVPool
from dllm.testing import make_tiny_checkpoint

MASKS = {"SDARForCausalLM": AttentionMask.BLOCK_CAUSAL, "Qwen3ForCausalLM": AttentionMask.CAUSAL,
         "LLaDAModelLM": AttentionMask.FULL}
BLOCK = 4
# Rows of one prefill: lengths not divisible by 4 or 6 chunks, and shorter than them (1, 2, 5).
ROWS = [23, 5, 1, 2, 14]
# Then a second prefill over the first's cache (a chunked prompt): rows 0 and 4 go on with 9
# and 3 more tokens on top of their cached 23 and 14 (neither a whole number of blocks).
MORE = {0: 9, 4: 3}
PAGE = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp")
    return {arch: str(make_tiny_checkpoint(arch, root / arch, seed=1)) for arch in PARAMS}


# ---- the split --------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4])
def test_zigzag_covers_each_token_once_and_balances_causal_work(size):
    for n in range(0, 60):
        parts = [zigzag_ranges(n, size, r) for r in range(size)]
        tokens = sorted(t for ranges in parts for lo, hi in ranges for t in range(lo, hi))
        assert tokens == list(range(n))
        counts = [sum(hi - lo for lo, hi in ranges) for ranges in parts]
        assert max(counts) - min(counts) <= 2
        # Causal work of a token: the keys it sees (its index + 1). The ranks differ by at
        # most two tokens' worth (each sees at most n keys); a contiguous split of the same
        # counts differs by about n² / size.
        work = [sum(t + 1 for lo, hi in ranges for t in range(lo, hi)) for ranges in parts]
        assert max(work) - min(work) <= 2 * n
        if n >= 8 * size:
            cuts = [r * n // size for r in range(size + 1)]
            contiguous = [sum(range(cuts[r] + 1, cuts[r + 1] + 1)) for r in range(size)]
            assert max(contiguous) - min(contiguous) > 2 * n
    assert [zigzag_ranges(12, 3, r) for r in range(3)] == [((0, 2), (10, 12)),
                                                          ((2, 4), (8, 10)), ((4, 6), (6, 8))]


def test_context_parallel_refuses_tensor_parallel():
    with pytest.raises(ValueError, match="context and tensor parallelism are not combined"):
        EngineConfig(tensor_parallel_size=2, context_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size must be a positive integer"):
        EngineConfig(context_parallel_size=0)
    assert EngineConfig(context_parallel_size=3).world_size == 3


# ---- logits and caches ----------------------------------------------------------------------
class Cache:
    """A paged KV cache of ``len(ROWS)`` requests, each with its own slots (pages handed out
    in a shuffled order, so slots are not the token indices)."""

    def __init__(self, model: torch.nn.Module):
        spec = model.kv_cache_spec()
        self.max_len = 40
        pages_per = self.max_len // PAGE
        self.req_pool = ReqToTokenPool(len(ROWS), self.max_len)
        self.kv_pool = TokenToKVPool(len(ROWS) * pages_per + 1, PAGE, spec.num_layers,
                                     spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
        pages = self.kv_pool.alloc_pages(len(ROWS) * pages_per)
        order = torch.randperm(len(pages), generator=torch.Generator().manual_seed(0)).tolist()
        for i in range(len(ROWS)):
            row = self.req_pool.alloc()
            mine = [pages[order[j]] for j in range(i * pages_per, (i + 1) * pages_per)]
            self.req_pool.req_to_token[row, :] = self.kv_pool.slots_for(mine, 0, self.max_len)

    def batch(self, rows: list[tuple[int, int, int]], mask: AttentionMask) -> ForwardBatch:
        """``rows``: (request, prefix, new tokens); token ids from the request and position."""
        ids, pos, loc = [], [], []
        for req, prefix, n in rows:
            ids += [(7 * req + 3 * p) % 200 + 5 for p in range(prefix, prefix + n)]
            pos += list(range(prefix, prefix + n))
            loc.append(self.req_pool.req_to_token[req, prefix : prefix + n])
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        prefix_lens = [p for _, p, _ in rows]
        extend_lens = [n for _, _, n in rows]
        seq_lens = [p + n for _, p, n in rows]
        return ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=t(ids), positions=t(pos),
            req_pool_indices=t([r for r, _, _ in rows]), prefix_lens=t(prefix_lens),
            extend_lens=t(extend_lens), seq_lens=t(seq_lens), out_cache_loc=torch.cat(loc),
            prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens, seq_lens_cpu=seq_lens,
            attention_mask=mask, block_size=BLOCK, logits_mode=LogitsMode.ALL,
            req_to_token=self.req_pool.req_to_token, kv_pool=self.kv_pool,
            attn_backend=SDPABackend())

    def keys_values(self, lengths: dict[int, int]) -> list[torch.Tensor]:
        """Every layer's K and V of each request's first ``lengths[req]`` tokens."""
        out = []
        for layer in range(self.kv_pool.num_layers):
            k, v = self.kv_pool.get_kv(layer)
            for req, n in sorted(lengths.items()):
                slots = self.req_pool.req_to_token[req, :n]
                out += [k[slots].clone(), v[slots].clone()]
        return out


@torch.no_grad()
def prefill_twice(model: torch.nn.Module, mask: AttentionMask,
                  cp: ContextParallel | None) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                       list[int]]:
    """Logits of the two prefills, the caches after them, and the query tokens the model's
    forwards were given (``cp`` None: the single-process forward)."""
    cache = Cache(model)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    logits = []
    try:
        for rows in ([(i, 0, n) for i, n in enumerate(ROWS)],
                     [(i, ROWS[i], n) for i, n in MORE.items()]):
            fb = cache.batch(rows, mask)
            if cp is None:
                fb.attn_backend.prepare(fb)
                hidden = model(fb.input_ids, fb.positions, fb)
            else:
                hidden = cp.forward(model, fb)
            logits.append(model.compute_logits(hidden))
    finally:
        hook.remove()
    lengths = {i: n + MORE.get(i, 0) for i, n in enumerate(ROWS)}
    return logits, cache.keys_values(lengths), seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- engines --------------------------------------------------------------------------------
ENGINE_ARGS = dict(max_running_requests=4, page_size=4, max_prefill_tokens=12)
# 23 and 10 tokens: several prefill chunks (12 tokens each at most); 3 and 1: shorter than the
# 4 or 6 chunks of the split.
PROMPTS = [list(range(5, 28)), list(range(40, 50)), [60, 61, 62], [70]]
# Each family greedy, then sampled (the second run of SDAR and Qwen3 reads the prompts' cached
# prefixes); LLaDA recomputes the whole canvas every step (exact), or refreshes a dual cache.
PARAMS = {
    "SDARForCausalLM": [dict(max_new_tokens=8, ignore_eos=True),
                        dict(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=3)],
    "Qwen3ForCausalLM": [dict(max_new_tokens=8),
                         dict(max_new_tokens=8, temperature=0.8, top_k=20, seed=5)],
    "LLaDAModelLM": [dict(max_new_tokens=8, ignore_eos=True, dllm={"steps": 4, "block_size": 4}),
                     dict(max_new_tokens=8, ignore_eos=True, temperature=0.7, seed=2,
                          dllm={"steps": 4, "block_size": 4, "cache_mode": "dual"})],
    # A hybrid: its prefills run unsplit (the Mamba2 layers' state), the same on every rank.
    "GraniteMoeHybridForCausalLM": [dict(max_new_tokens=8),
                                    dict(max_new_tokens=8, temperature=0.8, seed=4)],
}


def _generate(engine, params: dict) -> list[list[int]]:
    """``LLM.generate``'s loop over an ``Engine``: every prompt at once, to the end."""
    reqs = [engine.make_request(p, SamplingParams(**params)) for p in PROMPTS]
    for req in reqs:
        engine.add_request(req)
    while any(not r.finished for r in reqs):
        engine.step()
    engine.drain()
    engine.check_memory()
    return [engine.output_of(r).token_ids for r in reqs]


def _serve(engine) -> None:
    """A worker rank: run each call rank 0 mirrors, until it sends ``None``."""
    while (msg := engine.ranks.receive()) is not None:
        call, args = msg
        getattr(engine, call)(*args)


def _rank_main(rank: int, world: int, port: int, ckpts: dict[str, str], out: str) -> None:
    from datetime import timedelta

    from dllm.engine import Engine  # here, not at the top: see the module's docstring

    # A rank out of step would block its collectives: fail in two minutes, not hang.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    cp = ContextParallel(rank, world)
    for arch in MASKS:
        model, _, _ = load_model(ckpts[arch])
        got = prefill_twice(model, MASKS[arch], cp)
        torch.save(got, Path(out) / f"{arch}-cp{world}-rank{rank}.pt")
    for arch, ckpt in ckpts.items():
        config = EngineConfig(model=ckpt, context_parallel_size=world, **ENGINE_ARGS)
        engine = Engine(config, ranks=RankGroup(rank, world))
        if rank > 0:
            _serve(engine)
            continue
        tokens = [_generate(engine, params) for params in PARAMS[arch]]
        torch.save(tokens, Path(out) / f"{arch}-cp{world}-tokens.pt")
        dist.broadcast_object_list([None], src=0)  # the workers' engines are done
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(ckpts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cp-results")
    for world in (2, 3):
        mp.spawn(_rank_main, args=(world, _free_port(), ckpts, str(out)), nprocs=world)
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and (got - want).abs().max().item() <= 1e-5 * max(
        want.abs().max().item(), 1.0)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("arch", sorted(MASKS))
def test_prefill_logits_and_cache_equal_single_process(ckpts, cp_results, arch, size):
    """Both prefills' logits within 1e-5 (fp32) of the single process's, every rank's cache
    holds every token's K/V (to 1e-5), and each rank's model ran on its zigzag share only."""
    model, _, _ = load_model(ckpts[arch])
    want_logits, want_kv, want_seen = prefill_twice(model, MASKS[arch], None)
    assert want_seen == [sum(ROWS), sum(MORE.values())]
    for rank in range(size):
        logits, kv, seen = torch.load(cp_results / f"{arch}-cp{size}-rank{rank}.pt")
        assert all(_close(g, w) for g, w in zip(logits, want_logits, strict=True))
        assert all(_close(g, w) for g, w in zip(kv, want_kv, strict=True))
        share = [sum(hi - lo for n in lengths for lo, hi in zigzag_ranges(n, size, rank))
                 for lengths in (ROWS, list(MORE.values()))]
        assert seen == share and all(s < w for s, w in zip(share, want_seen, strict=True))


@pytest.fixture(scope="module")
def single_tokens(ckpts) -> dict[str, list[list[list[int]]]]:
    from dllm.llm import LLM

    out = {}
    for arch, ckpt in ckpts.items():
        llm = LLM(ckpt, **ENGINE_ARGS)
        out[arch] = [[o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**params))]
                     for params in PARAMS[arch]]
        llm.engine.check_memory()
    return out


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("arch", sorted(PARAMS))
def test_engine_tokens_equal_single_process(cp_results, single_tokens, arch, size):
    got = torch.load(cp_results / f"{arch}-cp{size}-tokens.pt")
    assert got == single_tokens[arch]


def test_llm_with_cp_flag_starts_its_ranks(ckpts, single_tokens):
    """``LLM(..., context_parallel_size=2)``: the launcher starts the second rank; tokens
    equal the single process's, logprobs too (every rank has whole logits: nothing is
    refused), and shutting down ends the worker."""
    from dllm.llm import LLM

    arch = "SDARForCausalLM"
    traced = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
    want = LLM(ckpts[arch], **ENGINE_ARGS).generate(PROMPTS[:2], traced)
    llm = LLM(ckpts[arch], context_parallel_size=2, **ENGINE_ARGS)
    try:
        worker = llm.engine.ranks.workers[0]
        assert llm.engine.runner.context_parallel == ContextParallel(0, 2)
        got = llm.generate(PROMPTS, SamplingParams(**PARAMS[arch][0]))
        assert [o.token_ids for o in got] == single_tokens[arch][0]
        got = llm.generate(PROMPTS[:2], traced)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want, strict=True):
            assert len(g.logprobs) == len(w.logprobs) == 4
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
        llm.engine.check_memory()
    finally:
        llm.engine.shutdown()
    assert worker.wait(timeout=30) == 0
