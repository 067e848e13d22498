"""The block-diffusion engine against the naive reference, batching, memory and stops."""

from __future__ import annotations

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.request import FinishReason
from dllm.runner.forward_batch import ForwardMode
from dllm.testing.harness import fail_on_token, forbid_host_sync, run_staggered
from tests.naive_reference import naive_block_diffusion

B = 4  # SDAR's block size

ALGORITHMS = {
    "low_confidence_static": {"steps_per_block": 2},
    "low_confidence_dynamic": {"threshold": 0.5, "steps_per_block": 4},
    "threshold": {"threshold": 0.6},
    "joint_threshold": {"threshold": 0.6, "edit_threshold": 0.5, "max_post_edit_steps": 2},
    "entropy_bounded": {"eb_gamma": 1.0},
}
# Shorter than, equal to, longer than a block; a multiple of blocks; many blocks.
PROMPT_LENGTHS = [2, 4, 7, 8, 13]


@pytest.fixture(scope="module")
def llm(sdar_dir) -> LLM:
    return LLM(sdar_dir, max_running_requests=16, page_size=4)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1000 + 17 * n + salt)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def reference(llm: LLM, prompt: list[int], params: SamplingParams, algorithm: str,
              config: dict) -> list[int]:
    e = llm.engine
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= set(e.info.eos_token_ids)
    return naive_block_diffusion(
        e.model, prompt, block_size=e.block_size, mask_id=e.mask_token_id, algorithm=algorithm,
        algo_config=config, max_new_tokens=params.max_new_tokens, stop_ids=stop,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        seed=params.seed or 0,
    )


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_engine_equals_naive_reference(llm, algorithm, n):
    prompt = prompt_of(n)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, seed=3,
                            dllm={"algorithm": algorithm, **ALGORITHMS[algorithm]})
    out = llm.generate(prompt, params)[0]
    want = reference(llm, prompt, params, algorithm, ALGORITHMS[algorithm])
    assert out.token_ids == want
    assert out.finish_reason == "length"
    assert out.prompt_tokens == n
    llm.engine.check_memory()


@pytest.mark.parametrize("algorithm", ["low_confidence_static", "threshold"])
def test_sampling_equals_naive_reference(llm, algorithm):
    prompt = prompt_of(6)
    params = SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.8, top_k=50,
                            top_p=0.9, seed=11,
                            dllm={"algorithm": algorithm, **ALGORITHMS[algorithm]})
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == reference(llm, prompt, params, algorithm, ALGORITHMS[algorithm])


@pytest.mark.parametrize("n", [3, 5])
def test_stop_token_inside_a_block(llm, n):
    """A stop id met mid-block ends the output right after it, in engine and reference."""
    # The first prompt (salt 5 on) whose free output has a token that first appears strictly
    # inside a block (not at its last position).
    first_block = B - n % B
    for salt in range(5, 25):
        prompt = prompt_of(n, salt=salt)
        free = llm.generate(prompt, SamplingParams(max_new_tokens=12,
                                                   ignore_eos=True))[0].token_ids
        pos = next((i for i in range(len(free)) if (i - first_block) % B not in (B - 1,)
                    and free.index(free[i]) == i and i > 0), None)
        if pos is not None:
            break
    assert pos is not None, "no prompt gave a token first met inside a block"
    stop_id = free[pos]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == free[: pos + 1]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference(llm, prompt, params, llm.engine.algorithm_name,
                                      dict(llm.engine.algorithm_config))
    llm.engine.check_memory()


def test_eos_from_config_ends_inside_block(tmp_path):
    """EOS read from the checkpoint (not from the request) stops generation mid-block."""
    from dllm.testing import make_tiny_checkpoint

    base = LLM(make_tiny_checkpoint("SDARForCausalLM", tmp_path / "a", seed=0))
    prompt = prompt_of(5, salt=9)
    free = base.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    eos = free[4]
    k = free.index(eos)
    llm = LLM(make_tiny_checkpoint("SDARForCausalLM", tmp_path / "b", seed=0,
                                   eos_token_id=eos))
    assert eos in llm.engine.info.eos_token_ids
    out = llm.generate(prompt, SamplingParams(max_new_tokens=12))[0]
    assert out.token_ids == free[: k + 1]
    assert out.finish_reason == "stop"


def test_max_new_tokens_cuts_inside_block(llm):
    prompt = prompt_of(5)
    long = llm.generate(prompt, SamplingParams(max_new_tokens=11, ignore_eos=True))[0]
    short = llm.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert short.token_ids == long.token_ids[:6]
    assert short.finish_reason == "length"


def test_batch_invariance_with_staggered_arrivals(llm):
    """Each request gives the same tokens alone and inside a batch of 8 mixed-length requests
    that arrive at different engine steps."""
    e = llm.engine
    lengths = [1, 3, 4, 6, 8, 9, 13, 17]
    algos = ["low_confidence_dynamic", "threshold", "low_confidence_static", "entropy_bounded"]
    params = [SamplingParams(max_new_tokens=7 + i, ignore_eos=True, seed=i,
                             temperature=0.7 if i % 3 == 0 else 0.0,
                             dllm={"algorithm": algos[i % 4], **ALGORITHMS[algos[i % 4]]})
              for i in range(8)]
    prompts = [prompt_of(n, salt=1) for n in lengths]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert run_staggered(e, reqs) == alone
    e.check_memory()


def test_abort_mid_block_frees_memory(llm):
    e = llm.engine
    # A prompt no other test sends: its first step is its prefill (nothing cached).
    req = e.make_request(prompt_of(6, salt=99), SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                      dllm={"algorithm": "low_confidence_static",
                                                            "steps_per_block": 4}))
    e.add_request(req)
    for _ in range(3):
        e.step()
    assert req.denoise.block is not None and 0 < req.denoise.block.step < 4  # mid-block
    assert e.kv_pool.num_used_pages > 0
    e.abort(req.rid)
    assert req.finish_reason is FinishReason.ABORT
    e.check_memory()
    e.clear_prefix_cache()
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages


def test_error_in_one_request_spares_the_others(llm):
    """A forward that fails for one request's tokens finishes only that request (with an
    error); the batch's other requests complete exactly as they would alone; no leak."""
    e = llm.engine
    poison = 7  # a token id only the bad request contains
    good_prompts = [prompt_of(n, salt=3) for n in (5, 9)]
    assert all(poison not in p for p in good_prompts)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in good_prompts]

    with fail_on_token(e.model, poison):
        reqs = [e.make_request(p, params) for p in [good_prompts[0], [poison] * 6,
                                                     good_prompts[1]]]
        outs = e.run_to_completion(reqs)
    assert outs[1].finish_reason == "error" and "injected failure" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == alone
    e.check_memory()
    e.clear_prefix_cache()  # the prefix cache's pages, freed
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages


def test_many_requests_small_running_limit(sdar_dir):
    llm = LLM(sdar_dir, max_running_requests=16, page_size=4, num_kv_pages=64)
    prompts = [prompt_of(1 + i % 11, salt=i) for i in range(200)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(outs) == 200
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    llm.engine.check_memory()
    llm.engine.clear_prefix_cache()  # the prefix cache's pages, freed
    assert llm.engine.kv_pool.num_free_pages == llm.engine.kv_pool.num_usable_pages


def test_requests_wait_when_memory_is_short(sdar_dir):
    """With room for one request's KV at a time, requests queue and all finish."""
    llm = LLM(sdar_dir, max_running_requests=8, page_size=4, num_kv_pages=5)
    outs = llm.generate([prompt_of(5, salt=i) for i in range(4)],
                        SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8] * 4
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate(prompt_of(5), SamplingParams(max_new_tokens=40))


def test_long_prompt_prefill_is_chunked_not_one_block_per_step(sdar_dir):
    llm = LLM(sdar_dir, max_prefill_tokens=8, page_size=4)
    e = llm.engine
    req = e.make_request(prompt_of(21), SamplingParams(max_new_tokens=4, ignore_eos=True))
    e.add_request(req)
    e.step()
    assert req.prefilled_len == 8  # two blocks in the first prefill forward
    while not req.finished:
        e.step()
    assert e.output_of(req).token_ids == llm.generate(
        prompt_of(21), SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids


def test_prefill_and_denoise_progress_in_the_same_step(llm):
    e = llm.engine
    a = e.make_request(prompt_of(9), SamplingParams(max_new_tokens=20, ignore_eos=True))
    e.add_request(a)
    e.step()
    e.step()
    denoised = a.num_denoise_forwards
    b = e.make_request(prompt_of(12), SamplingParams(max_new_tokens=4, ignore_eos=True))
    e.add_request(b)
    e.step()
    assert b.prefilled_len == 12 and a.num_denoise_forwards + a.num_commit_forwards > denoised
    e.abort(a.rid)
    e.abort(b.rid)
    e.check_memory()


def test_denoise_step_has_no_host_sync(llm):
    """The forward and the algorithm step read nothing back to the host; the one read per
    step is the packed result, done by ``DenoisePost.read`` afterwards."""
    from dllm.denoise import DenoisePost

    e = llm.engine
    reqs = [e.make_request(prompt_of(n), SamplingParams(
        max_new_tokens=8, ignore_eos=True, temperature=0.5 * (n % 2), seed=n,
        dllm={"algorithm": a, **ALGORITHMS[a]}))
        for n, a in zip((3, 6, 9, 12, 5), sorted(ALGORITHMS), strict=True)]
    for r in reqs:
        e.add_request(r)
    while any(r.req_pool_idx is None or r.needs_prefill for r in reqs):  # past prefill
        e.step()
    (batch,) = e.scheduler.schedule()
    # one row a request (two for a merged commit: the commit half, then its next block)
    assert batch.mode is ForwardMode.DLLM_EXTEND and len(set(batch.rids)) == len(reqs)
    post = e.runner.post_for(batch)

    with forbid_host_sync():
        out = e.runner.forward(batch, post)
    result = DenoisePost.read(out)
    assert len(result.tokens) == batch.batch_size
    for r in reqs:
        e.abort(r.rid)
    e.check_memory()


def test_unmasking_in_row_passes_gives_the_same_tokens(sdar_dir, monkeypatch):
    """``DenoisePost`` runs each algorithm's rows in passes of at most
    ``POST_CHUNK_POSITIONS`` positions (bounding its [positions, vocab] temporaries): one row
    a pass, and two, give every request the tokens and log-probabilities of one pass, for
    every algorithm, greedy and sampled, in one batch (the log-probabilities come from the
    trace columns, which pass in the same groups). (No prefix cache: a prompt served from it
    is not recomputed, which may move a log-probability by a rounding.)"""
    import dllm.denoise

    llm = LLM(sdar_dir, max_running_requests=16, page_size=4, enable_prefix_cache=False)

    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, seed=i, logprobs=2,
                             temperature=0.7 * (i % 2),
                             dllm={"algorithm": a, **ALGORITHMS[a]})
              for i, a in enumerate(sorted(ALGORITHMS) * 2)]
    prompts = [prompt_of(3 + 2 * i, salt=9) for i in range(len(params))]

    def run() -> list:
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]

    want = run()
    b = llm.engine.block_size
    for positions in (1, 2 * b):
        monkeypatch.setattr(dllm.denoise, "POST_CHUNK_POSITIONS", positions)
        assert run() == want
    llm.engine.check_memory()


def test_num_forward_passes_and_token_ids(llm):
    out = llm.generate(prompt_of(8), SamplingParams(
        max_new_tokens=8, ignore_eos=True,
        dllm={"algorithm": "low_confidence_static", "steps_per_block": 4}))[0]
    # Prompt = 2 full blocks (one prefill forward); 2 blocks of 4 denoise steps; the first
    # block's commit runs inside the second block's first step (merged), the last ends the
    # request and needs none.
    assert out.num_forward_passes == 1 + 4 + 4
    assert out.num_commit_forwards == 0
    assert out.num_denoise_forwards == 8
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("start", [2, 7, 12])
def test_stop_string_cuts_text_and_tokens(llm, start):
    """A stop string found in a committed block ends the output: text cut before it, token
    ids cut after the token that completed it."""
    prompt = prompt_of(6, salt=4)
    free = llm.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    stop = free.text[start : start + 3]
    at = free.text.find(stop)
    out = llm.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True,
                                              stop=[stop]))[0]
    decode = llm.engine.scheduler.stop_checker.decode
    assert out.finish_reason == "stop"
    assert out.text == free.text[:at]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])
    llm.engine.check_memory()


def test_stop_string_spanning_two_blocks(llm):
    """A stop string whose first characters end one block and whose last characters start
    the next is found when the second block commits; the first block was already streamed
    whole, the output is still cut before the string."""
    decode = llm.engine.scheduler.stop_checker.decode
    for salt in range(30):  # find a prompt whose output has such a string, deterministically
        prompt = prompt_of(6, salt=salt)
        free = llm.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
        ids = free.token_ids
        k = B - 6 % B  # generated tokens in the first block
        cut = len(decode(ids[:k]))
        stop = free.text[cut - 1 : cut + 2]
        if len(stop) == 3 and free.text.find(stop) == cut - 1 and "\ufffd" not in stop:
            break
    else:
        pytest.fail("no prompt gave a block-spanning stop string")
    out = llm.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True,
                                              stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: cut - 1]
    assert len(out.token_ids) > k and out.token_ids == ids[: len(out.token_ids)]


def test_failure_while_applying_one_row_spares_the_rows_applied_before(llm, monkeypatch):
    """A row whose result cannot be applied ends alone; rows applied before it in the same
    step are not applied twice (their output equals their solo run)."""
    e = llm.engine
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    good = [prompt_of(n, salt=6) for n in (5, 7)]
    alone = [llm.generate(p, params)[0].token_ids for p in good]
    checker = e.scheduler.stop_checker
    real_check = checker.check

    def check(req, new_tokens):
        if req.rid == "bad":
            raise RuntimeError("injected failure")
        return real_check(req, new_tokens)

    monkeypatch.setattr(checker, "check", check)
    reqs = [e.make_request(good[0], params), e.make_request(prompt_of(6, salt=7), params,
                                                            rid="bad"),
            e.make_request(good[1], params)]
    outs = e.run_to_completion(reqs)
    assert outs[1].finish_reason == "error" and "injected failure" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == alone
    e.check_memory()


def test_the_stop_string_completed_first_wins(llm):
    """Of two stop strings, the one whose last character comes first ends the output, even
    when the other starts earlier (vLLM's rule)."""
    for salt in range(30):  # a prompt whose output has a clean 8-character window
        prompt = prompt_of(6, salt=salt)
        text = llm.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))[0].text
        found = [at for at in range(len(text) - 8)
                 if "\ufffd" not in text[at : at + 8] and text.find(text[at : at + 8]) == at
                 and text.find(text[at + 2 : at + 4]) == at + 2]
        if found:
            break
    else:
        pytest.fail("no prompt gave a usable window")
    at = found[0]
    long_stop, short_stop = text[at : at + 8], text[at + 2 : at + 4]
    out = llm.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True,
                                              stop=[long_stop, short_stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: at + 2]


def test_llm_accepts_an_engine_config(sdar_dir):
    from dllm import EngineConfig

    config = EngineConfig(model=sdar_dir, max_running_requests=2)
    llm = LLM(config)
    assert llm.engine.config is config
    out = llm.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == LLM(sdar_dir, max_running_requests=2).generate(
        [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids
    with pytest.raises(TypeError, match="not both"):
        LLM(config, page_size=4)


def test_auto_attention_backend_takes_flashinfer_for_half_precision_only():
    """FlashInfer runs float16 / bfloat16 only: ``auto`` takes SDPA for float32 weights and
    off CUDA; asking for FlashInfer elsewhere is a clear error."""
    from dllm.runner.attention import flashinfer_available, make_backend, resolve_backend_name

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_backend_name("auto", cuda, torch.float32) == "sdpa"
    assert resolve_backend_name("auto", cpu, torch.bfloat16) == "sdpa"
    assert resolve_backend_name("auto", cuda, torch.bfloat16) == (
        "flashinfer" if flashinfer_available() else "sdpa")
    assert resolve_backend_name("sdpa", cuda, torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="float16 and bfloat16 only, not float32"):
        make_backend("flashinfer", cuda, 16, torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend("flashinfer", cpu, 16, torch.bfloat16)
