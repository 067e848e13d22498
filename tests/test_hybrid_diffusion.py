"""Block diffusion over a hybrid Mamba2 + attention model (issue 20, phase 3), on the tiny
``GraniteMoeHybridForBlockDiffusion`` checkpoint (Granite-H micro's layout: Mamba, attention,
Mamba, Mamba; a ``<|MASK|>`` token; blocks of 4).

The oracle is ``tests/naive_reference.py::naive_block_diffusion``: one request at a time, the
whole sequence recomputed at every denoise step with the model's stateless full forward
(block-causal attention, the SSM causal from zeros over the whole sequence), no KV cache, no
state pool, no batching; that full forward is itself held to ``tests/naive_hybrid.py`` (the
published math, written independently of ``dllm.models``). The engine's output equals it token
for token for every algorithm of ``tests/test_engine.py``, alone, batched and staggered, with
and without the overlap schedule; a denoise step leaves each committed state slot
bit-identical; no state slot, KV page or request slot leaks after finish, abort or error; and a
failed batch ends the requests whose state it was writing, while denoise rows are retried."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.models import registry
from dllm.request import FinishReason
from dllm.runner.forward_batch import AttentionMask, ForwardMode
from dllm.testing.factory import make_tiny_hybrid_checkpoint
from dllm.testing.harness import fail_on_token, forward_full, run_staggered
from tests.naive_reference import naive_block_diffusion
from tests.test_engine import ALGORITHMS

sys.path.insert(0, str(Path(__file__).parent))
from naive_hybrid import block_causal_mask, naive_logits  # noqa: E402

B = 4
PROMPT_LENGTHS = [2, 4, 7, 8, 13]  # shorter than, equal to, longer than a block; many blocks
POISON = 400  # a token id in no prompt below


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return make_tiny_hybrid_checkpoint("granite-h-bd", tmp_path_factory.mktemp("gbd"), seed=0)


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(str(path), page_size=4, max_running_requests=8)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(2000 + 17 * n + salt)
    return torch.randint(10, 300, (n,), generator=g).tolist()


def params_of(algorithm: str, i: int = 0, n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n + i, ignore_eos=True, seed=3 + i,
                          dllm={"algorithm": algorithm, **ALGORITHMS[algorithm]})


def reference(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    e = llm.engine
    algorithm = params.dllm["algorithm"]
    return naive_block_diffusion(
        e.model, prompt, block_size=e.block_size, mask_id=e.mask_token_id, algorithm=algorithm,
        algo_config=ALGORITHMS[algorithm], max_new_tokens=params.max_new_tokens,
        stop_ids=set(), temperature=params.temperature, seed=params.seed or 0)


def test_the_checkpoint_is_a_block_diffusion_hybrid(llm) -> None:
    e = llm.engine
    assert e.info.spec.kind == "block_diffusion" and e.info.spec.recurrent_state
    assert e.block_size == B and e.mask_token_id == e.tokenizer.convert_tokens_to_ids("<|MASK|>")
    assert e.runner.state_pool is not None and e.runner.state_pool.num_layers == 3


def test_the_full_forward_is_the_naive_math(llm, path) -> None:
    """The oracle's full forward (block-causal attention, causal SSM, masks in the last
    block) equals the independent naive forward."""
    m = llm.engine.mask_token_id
    for seq in (prompt_of(13) + [m] * 3, prompt_of(7, salt=1) + [m, 5, m, m, 9]):
        got = forward_full(llm.engine.model, seq, AttentionMask.BLOCK_CAUSAL, B)
        want = naive_logits(path, seq, block_causal_mask(len(seq), B))
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.fixture(scope="module")
def references(llm) -> dict[tuple[str, int], list[int]]:
    """The oracle's output for every algorithm and prompt length (params_of(alg, i))."""
    return {(alg, i): reference(llm, prompt_of(n), params_of(alg, i))
            for alg in ALGORITHMS for i, n in enumerate(PROMPT_LENGTHS)}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_engine_equals_the_naive_recompute(llm, references, algorithm, overlap) -> None:
    """Every prompt length alone, then all five batched, then arriving one per step."""
    e = llm.engine
    e.overlap = overlap
    try:
        prompts = [prompt_of(n) for n in PROMPT_LENGTHS]
        params = [params_of(algorithm, i) for i in range(len(prompts))]
        want = [references[(algorithm, i)] for i in range(len(prompts))]
        alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
        assert alone == want
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        assert run_staggered(e, reqs) == want
        e.drain()
        e.check_memory()
    finally:
        e.overlap = False


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_denoise_step_leaves_the_committed_state_bit_identical(llm, overlap) -> None:
    """Every ``DLLM_EXTEND`` forward of a staggered batch: a row that is a denoise step (write
    slot 0, or a gated row whose gate came out 0) leaves its committed slot exactly as it
    was; a commit forward (and only it) changes it."""
    e = llm.engine
    pool = e.runner.state_pool
    forward = e.runner.forward
    seen = {"denoise": 0, "commit": 0, "gated": 0}

    def state(slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for t in pool.conv + pool.ssm]

    def checked(batch, post=None):
        if batch.mode is not ForwardMode.DLLM_EXTEND:
            return forward(batch, post)
        before = [state(s) for s in batch.state_read_slots]
        out = forward(batch, post)
        gate = (batch.state_write_gate.tolist() if batch.state_write_gate is not None
                else [1] * batch.batch_size)
        for i, (slot, write) in enumerate(zip(batch.state_read_slots, batch.state_write_slots,
                                              strict=True)):
            seen["gated"] += batch.state_write_gate is not None and write != 0
            same = all(torch.equal(a, b) for a, b in zip(before[i], state(slot), strict=True))
            if write == 0 or gate[i] == 0:
                seen["denoise"] += 1
                assert same, "a denoise step changed the committed state"
            else:
                seen["commit"] += 1
                assert not same, "a commit forward left the state as it was"
        return out

    e.overlap = overlap
    e.runner.forward = checked
    try:
        algos = sorted(ALGORITHMS)
        reqs = [e.make_request(prompt_of(n, salt=4), params_of(algos[i % len(algos)], i))
                for i, n in enumerate(PROMPT_LENGTHS)]
        run_staggered(e, reqs)
        e.drain()
    finally:
        e.runner.forward = forward
        e.overlap = False
    assert seen["denoise"] > 0 and seen["commit"] > 0
    assert (seen["gated"] > 0) == overlap  # the overlapped path decided on the device
    e.check_memory()


def test_no_slot_leaks_after_finish_abort_and_error(path) -> None:
    """Four requests with room for two: one finishes, one is aborted mid-block, one fails in
    its forward (a poison token inside its first denoise block), one waits and is aborted
    before admission; every state slot, KV page and request slot is free at the end."""
    # One state slot per request (no prefix cache, whose track slots and snapshots add more).
    # Separate commits: with merged ones, ``keep``'s row in the step that meets the poison is
    # its merged commit, which writes state, so the failed batch would end it as well
    # (``test_a_failed_state_writing_batch_ends_its_writers``); here it must survive.
    llm = LLM(str(path), page_size=4, max_running_requests=2, enable_prefix_cache=False,
              merged_commit=False)
    e = llm.engine
    p = params_of("low_confidence_static", n=12)
    keep_prompt = prompt_of(6, salt=7)
    alone = llm.generate(keep_prompt, p)[0].token_ids
    keep, drop = e.make_request(keep_prompt, p), e.make_request(prompt_of(9, salt=8), p)
    fail = e.make_request(prompt_of(5, salt=9)[:4] + [POISON], p)
    waiting = e.make_request(prompt_of(3, salt=10), p)
    with fail_on_token(e.model, POISON):
        for r in (keep, drop, fail, waiting):
            e.add_request(r)
        for _ in range(3):
            e.step()
        assert e.runner.state_pool.num_free == 0
        assert drop.denoise.block is not None  # mid-block
        e.abort(drop.rid)
        e.abort(waiting.rid)
        e.check_memory()
        while not (keep.finished and fail.finished):
            e.step()
    assert e.output_of(keep).token_ids == alone
    assert drop.finish_reason is FinishReason.ABORT is waiting.finish_reason
    assert fail.finish_reason is FinishReason.ERROR and "injected failure" in fail.error
    e.check_memory()
    assert e.runner.state_pool.num_free == e.runner.state_pool.num_slots == 2
    e.clear_prefix_cache()  # the prefix cache's pages, freed
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_failed_state_writing_batch_ends_its_writers(path, overlap) -> None:
    """A fault inside the forward (raised in layer 2, after Mamba layer 0 wrote its state),
    hit by one request's tokens. (a) Its first denoise block holds the poison: the batch's
    other denoise rows write no state and are retried alone, unaffected. (b) Its prompt's
    first block holds it: its prefill chunk, shared with another request's, writes state, so
    both end with an error saying so, while a request already denoising is unaffected. Memory
    is returned."""
    llm = LLM(str(path), page_size=4, max_running_requests=8, overlap_schedule=overlap)
    e = llm.engine
    p = params_of("threshold", n=8)
    good = [prompt_of(6, salt=11), prompt_of(10, salt=12)]
    alone = [LLM(str(path), page_size=4).generate(q, p)[0].token_ids for q in good]
    inside = e.model.model.layers[2]
    # (a) the poison in the denoise block only: retried, the innocent row completes.
    bad = e.make_request(good[0][:4] + [POISON], p)
    reqs = [e.make_request(good[0], p), bad]
    with fail_on_token(e.model, POISON, inside=inside):
        outs = e.run_to_completion(reqs)
    assert outs[0].token_ids == alone[0]
    assert bad.finish_reason is FinishReason.ERROR and "injected failure" in bad.error
    assert "recurrent state" not in bad.error  # a denoise row: retried, failed again alone
    e.check_memory()
    # (b) the poison in a full prompt block: the prefill chunk writes state.
    early = e.make_request(good[1], p)
    e.add_request(early)
    for _ in range(3):
        e.step()  # prefilled and denoising
    victim, poisoned = e.make_request(good[0], p), e.make_request([POISON] + good[0], p)
    with fail_on_token(e.model, POISON, inside=inside):
        e.add_request(victim)
        e.add_request(poisoned)
        while not all(r.finished for r in (early, victim, poisoned)):
            e.step()
        e.drain()
    assert e.output_of(early).token_ids == alone[1]
    for r in (victim, poisoned):
        assert r.finish_reason is FinishReason.ERROR
        assert "injected failure" in r.error and "recurrent state" in r.error
    e.check_memory()
    assert e.runner.state_pool.num_free == e.runner.state_pool.num_slots


def test_full_attention_diffusion_over_a_state_is_refused(path, monkeypatch) -> None:
    name = "GraniteMoeHybridForBlockDiffusion"
    spec = registry.ARCHITECTURES[name]
    monkeypatch.setitem(registry.ARCHITECTURES, name, dataclasses.replace(
        spec, kind="full_diffusion", attention="full"))
    with pytest.raises(NotImplementedError, match="full-attention diffusion over a recurrent"):
        LLM(str(path))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_shifted_logits_variant(path, monkeypatch, overlap) -> None:
    """Fast-dLLM v2's variant over the same network (``logits_shift`` 1, sub-blocks of 2):
    the prefill's last-token logits give the first token of a block-aligned prompt, the
    commit forward (which writes the committed state) gives the next block's first token; the
    output equals Fast-dLLM v2's naive recompute, alone and staggered."""
    from tests.naive_reference import naive_fast_dllm_v2

    name = "GraniteMoeHybridForBlockDiffusion"
    monkeypatch.setitem(registry.ARCHITECTURES, name, dataclasses.replace(
        registry.ARCHITECTURES[name], logits_shift=1, default_sub_block_size=2,
        default_algorithm="hierarchical"))
    llm = LLM(str(path), page_size=4, max_running_requests=8, overlap_schedule=overlap)
    e = llm.engine
    prompts = [prompt_of(n, salt=13) for n in PROMPT_LENGTHS]
    params = [SamplingParams(max_new_tokens=9 + i, ignore_eos=True, seed=i,
                             dllm={"threshold": 0.5}) for i in range(len(prompts))]
    want = [naive_fast_dllm_v2(
        e.model, p, block_size=B, mask_id=e.mask_token_id, algorithm="hierarchical",
        algo_config={**e.algorithm_config, "threshold": 0.5}, max_new_tokens=sp.max_new_tokens,
        stop_ids=set(), seed=sp.seed) for p, sp in zip(prompts, params, strict=True)]
    assert [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)] \
        == want
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert run_staggered(e, reqs) == want
    e.drain()
    e.check_memory()
