"""Fast-dLLM v2 (block-causal, shifted logits, sub-blocks) against its naive reference: the
first token of every block comes from the previous block's commit pass (or the prompt's
prefill), greedily; the rest is decoded hierarchically."""

from __future__ import annotations

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.runner.forward_batch import AttentionMask
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import forward_full, run_staggered
from tests.naive_reference import naive_fast_dllm_v2

B = 8  # bd_size of the tiny checkpoint (the released model's is 32)

ALGORITHMS = {
    "hierarchical": {"threshold": 0.5, "sub_block_size": 4},
    "threshold": {"threshold": 0.6},
    "low_confidence_static": {"steps_per_block": 3},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads (see test_full_diffusion)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_tiny_checkpoint("Fast_dLLM_QwenForCausalLM", tmp_path_factory.mktemp("v2"),
                                seed=1, bd_size=B)
    return LLM(str(path), max_running_requests=8, page_size=4)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(3000 + 17 * n + salt)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def reference(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    e = llm.engine
    dllm = dict(params.dllm)
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= set(e.info.eos_token_ids)
    return naive_fast_dllm_v2(
        e.model, prompt, block_size=e.block_size, mask_id=e.mask_token_id,
        algorithm=dllm.pop("algorithm", e.algorithm_name),
        algo_config={**e.algorithm_config, **dllm}, max_new_tokens=params.max_new_tokens,
        stop_ids=stop, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        seed=params.seed or 0,
    )


def test_defaults(llm):
    e = llm.engine
    assert (e.block_size, e.algorithm_name, e.info.spec.logits_shift) == (B, "hierarchical", 1)
    assert e.algorithm_config["sub_block_size"] == 8  # the spec's default sub-block


# Shorter than a block, exactly one block (first token from the prefill), mid-block, two.
@pytest.mark.parametrize("n", [3, 8, 11, 16])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_engine_equals_naive_reference(llm, algorithm, n):
    prompt = prompt_of(n)
    params = SamplingParams(max_new_tokens=13, ignore_eos=True, seed=3,
                            dllm={"algorithm": algorithm, **ALGORITHMS[algorithm]})
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == reference(llm, prompt, params)
    assert out.finish_reason == "length" and len(out.token_ids) == 13
    llm.engine.check_memory()


def test_default_sub_blocks_equal_naive_reference(llm):
    prompt = prompt_of(5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert llm.generate(prompt, params)[0].token_ids == reference(llm, prompt, params)


@pytest.mark.parametrize("n", [6, 8])
def test_sampling_equals_naive_reference(llm, n):
    prompt = prompt_of(n)
    params = SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.8, top_k=50,
                            top_p=0.9, seed=11, dllm=ALGORITHMS["hierarchical"])
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == reference(llm, prompt, params)
    greedy = llm.generate(prompt, SamplingParams(max_new_tokens=14, ignore_eos=True,
                                                 dllm=ALGORITHMS["hierarchical"]))[0]
    assert out.token_ids != greedy.token_ids


def test_block_boundary_prompt_reads_its_first_token_from_the_prefill(llm):
    prompt = prompt_of(2 * B)
    out = llm.generate(prompt, SamplingParams(max_new_tokens=B + 1, ignore_eos=True))[0]
    logits = forward_full(llm.engine.model, prompt, AttentionMask.BLOCK_CAUSAL, B)
    assert out.token_ids[0] == int(logits[-1].argmax())
    # One prefill forward; the first block's denoise steps; its commit forward brings the
    # (B + 1)-th token, the first of the next block, and ends the request.
    assert out.num_forward_passes == 1 + out.num_denoise_forwards + 1


def test_commit_forward_brings_the_next_blocks_first_token(llm):
    """Right after a block's commit forward the output holds the next block's first token,
    and that token sits unmasked at position 0 of the block being denoised."""
    e = llm.engine
    prompt = prompt_of(5)
    req = e.make_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    e.add_request(req)
    while req.num_commit_forwards == 0:
        e.step()
    assert len(req.output_ids) == B - 5 + 1
    e.step()
    assert req.denoise.block.start == B and req.denoise.block.tokens[0] == req.output_ids[-1]
    assert req.denoise.block.editable[0] is False and req.denoise.block.num_initial_masks == B - 1
    e.abort(req.rid)
    e.check_memory()


def test_stop_on_a_blocks_first_token(llm):
    """A stop id read by a commit forward ends the request there."""
    prompt = prompt_of(5, salt=1)
    free = llm.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids
    firsts = [i for i in range(len(free)) if (5 + i) % B == 0 and free.index(free[i]) == i]
    assert firsts, "no block-first token appears for the first time; pick another prompt"
    pos = firsts[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=[free[pos]])
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == free[: pos + 1] and out.finish_reason == "stop"
    assert out.token_ids == reference(llm, prompt, params)
    llm.engine.check_memory()


def test_batch_invariance_with_staggered_arrivals(llm):
    e = llm.engine
    lengths = [1, 8, 5, 16, 11, 3]
    params = [SamplingParams(max_new_tokens=9 + i, ignore_eos=True, seed=i,
                             temperature=0.7 if i % 3 == 0 else 0.0,
                             dllm=ALGORITHMS[sorted(ALGORITHMS)[i % 3]])
              for i in range(len(lengths))]
    prompts = [prompt_of(n, salt=2) for n in lengths]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert run_staggered(e, reqs) == alone
    e.check_memory()
    e.clear_prefix_cache()  # the prefix cache's pages, freed
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages
