"""Full-attention diffusion (LLaDA, LLaDA-MoE, Dream) against the naive reference: every
algorithm, greedy and sampled, the three cache modes, CFG, stops, batching and memory."""

from __future__ import annotations

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.request import FinishReason
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import fail_on_token, forbid_host_sync, run_staggered
from tests.naive_reference import naive_full_diffusion

ARCHS = {"llada": "LLaDAModelLM", "llada_moe": "LLaDAMoEModelLM", "dream": "DreamModel"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine the thread
    hand-offs cost 100x the arithmetic."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, LLM]:
    # Seed 1: checkpoints whose outputs vary from position to position.
    return {name: LLM(str(make_tiny_checkpoint(arch, tmp_path_factory.mktemp(name), seed=1)),
                      max_running_requests=8, page_size=4)
            for name, arch in ARCHS.items()}


def prompt_of(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(2000 + 17 * n + salt)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def reference(llm: LLM, prompt: list[int], params: SamplingParams, per_block: dict, *,
              algorithm: str | None = None, block_size: int = 4) -> list[int]:
    """The naive generator with the request's settings; ``per_block`` holds the algorithm
    keys per block (the engine maps ``dllm.steps``, a total, itself)."""
    e = llm.engine
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= set(e.info.eos_token_ids)
    return naive_full_diffusion(
        e.model, prompt, gen_length=params.max_new_tokens, block_size=block_size,
        mask_id=e.mask_token_id, algorithm=algorithm or e.algorithm_name,
        algo_config={**e.algorithm_config, **per_block}, stop_ids=stop,
        logits_shift=e.info.spec.logits_shift, cfg_scale=params.dllm.get("cfg_scale", 0.0),
        cache_mode=params.dllm.get("cache_mode", "exact"), temperature=params.temperature,
        top_k=params.top_k, top_p=params.top_p, seed=params.seed or 0,
    )


# (family, algorithm, request dllm, per-block keys for the reference, block size); 8 tokens.
CASES = [
    ("llada", "low_confidence_static", {"steps": 4, "block_size": 4}, {"steps_per_block": 2}, 4),
    ("llada", "low_confidence_static", {"steps": 4, "block_size": 4, "remasking": "random"},
     {"steps_per_block": 2, "remasking": "random"}, 4),
    ("llada", "low_confidence_static", {"steps": 4}, {"steps_per_block": 4}, 8),  # default block
    ("llada", "threshold", {"threshold": 0.5, "block_size": 4}, {"threshold": 0.5}, 4),
    ("llada", "factor", {"factor": 1.0, "block_size": 4}, {"factor": 1.0}, 4),
    ("llada_moe", "low_confidence_static", {"steps": 8, "block_size": 4},
     {"steps_per_block": 4}, 4),
    ("llada_moe", "threshold", {"threshold": 0.5, "block_size": 4}, {"threshold": 0.5}, 4),
    ("dream", "origin", {"steps": 4}, {"steps": 4}, 8),  # Dream's default: the whole canvas
    ("dream", "maskgit_plus", {"steps": 4, "alg_temp": 0.5}, {"steps": 4, "alg_temp": 0.5}, 8),
    ("dream", "topk_margin", {"steps": 6}, {"steps": 6}, 8),
    ("dream", "entropy", {"steps": 4, "block_size": 4}, {"steps": 2}, 4),
]


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize(("family", "algorithm", "dllm", "per_block", "block"), CASES)
def test_engine_equals_naive_reference(engines, family, algorithm, dllm, per_block, block, n):
    llm = engines[family]
    prompt = prompt_of(n)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, seed=3,
                            dllm={"algorithm": algorithm, **dllm})
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == reference(llm, prompt, params, per_block, algorithm=algorithm,
                                      block_size=block)
    assert out.finish_reason == "length" and out.num_blocks == 8 // block
    llm.engine.check_memory()


@pytest.mark.parametrize(("family", "algorithm", "dllm", "per_block"), [
    ("llada", "low_confidence_static", {"steps": 4}, {"steps_per_block": 2}),  # float64 Gumbel
    ("llada", "threshold", {"threshold": 0.5}, {"threshold": 0.5}),
    ("llada_moe", "low_confidence_static", {"steps": 4}, {"steps_per_block": 2}),
    ("dream", "entropy", {"steps": 4, "alg_temp": 0.3}, {"steps": 2, "alg_temp": 0.3}),
    ("dream", "origin", {"steps": 4}, {"steps": 2}),
])
def test_sampling_equals_naive_reference(engines, family, algorithm, dllm, per_block):
    llm = engines[family]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_k=50,
                            top_p=0.9, seed=11,
                            dllm={"algorithm": algorithm, "block_size": 4, **dllm})
    greedy_params = SamplingParams(max_new_tokens=8, ignore_eos=True, dllm=params.dllm)
    drawn = 0
    for salt in range(4):
        prompt = prompt_of(5, salt)
        out = llm.generate(prompt, params)[0]
        assert out.token_ids == reference(llm, prompt, params, per_block, algorithm=algorithm)
        drawn += out.token_ids != llm.generate(prompt, greedy_params)[0].token_ids
    assert drawn  # the draw matters (a tiny model may be sure of every token of one prompt)
    llm.engine.check_memory()


def test_last_block_may_be_shorter(engines):
    """10 tokens in blocks of 4: blocks of 4, 4 and 2 (the reference would assert)."""
    llm = engines["llada"]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True,
                            dllm={"block_size": 4, "steps": 6})
    out = llm.generate(prompt_of(4), params)[0]
    assert out.num_blocks == 3 and len(out.token_ids) == 10
    assert out.token_ids == reference(llm, prompt_of(4), params, {"steps_per_block": 2})


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("family", sorted(ARCHS))
def test_cached_modes_equal_naive_reference(engines, family, mode):
    """Fast-dLLM caches: refreshed at each block start, approximate in between; the engine
    matches a one-sequence reference of the same cache rule token for token."""
    llm = engines[family]
    prompt = prompt_of(5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=5,
                            dllm={"block_size": 4, "steps": 9, "cache_mode": mode})
    out = llm.generate(prompt, params)[0]
    per_block = {"steps_per_block": 3, "steps": 3}
    assert out.token_ids == reference(llm, prompt, params, per_block)
    assert out.finish_reason == "length" and out.num_denoise_forwards == 9
    llm.engine.check_memory()


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_cached_modes_agree_with_exact_at_block_starts(engines, family):
    """A block's first step is a full forward in every mode. LLaDA (Fast-dLLM's LLaDA
    caches): with one step per block prefix and dual give exactly the exact tokens, on the
    first block and every other. Dream (Fast-dLLM's Dream block cache): that forward fixes the
    block's first position alone, the exact one's token there, and one scheduled step ends
    the block with its other positions still masked (the reference breaks out of the block
    at its step count)."""
    llm = engines[family]
    prompt = prompt_of(6)
    outs = {mode: llm.generate(prompt, SamplingParams(
        max_new_tokens=8, ignore_eos=True, dllm={"block_size": 4, "steps": 2,
                                                 "cache_mode": mode}))[0].token_ids
            for mode in ("exact", "prefix", "dual")}
    if family != "dream":
        assert outs["prefix"] == outs["exact"] and outs["dual"] == outs["exact"]
    else:
        mask = llm.engine.mask_token_id
        for mode in ("prefix", "dual"):
            assert outs[mode][0] == outs["exact"][0]
            assert [t == mask for t in outs[mode]] == [i % 4 != 0 for i in range(8)]
    llm.engine.check_memory()


@pytest.mark.parametrize("mode", ["exact", "dual"])
def test_cfg_changes_output_and_matches_reference(engines, mode):
    llm = engines["llada"]
    dllm = {"block_size": 4, "steps": 4, "cache_mode": mode}
    plain_params = SamplingParams(max_new_tokens=8, ignore_eos=True, dllm=dllm)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, dllm={**dllm, "cfg_scale": 1.5})
    changed = 0
    for salt in range(4):
        prompt = prompt_of(5, salt)
        out = llm.generate(prompt, params)[0]
        assert out.token_ids == reference(llm, prompt, params, {"steps_per_block": 2})
        changed += out.token_ids != llm.generate(prompt, plain_params)[0].token_ids
    assert changed  # guidance changes the output
    llm.engine.check_memory()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_batch_invariance_with_staggered_arrivals(engines, family):
    """Each request gives the same tokens alone and in a batch of mixed prompt lengths,
    block sizes, algorithms, cache modes, temperatures and CFG, arriving one per step."""
    llm = engines[family]
    e = llm.engine
    algos = (["low_confidence_static", "threshold"] if family == "llada"
             else ["entropy", "maskgit_plus"])
    params = [SamplingParams(
        max_new_tokens=8, ignore_eos=True, seed=i, temperature=0.7 if i % 3 == 0 else 0.0,
        dllm={"algorithm": algos[i % 2], "block_size": (4, 8, 2)[i % 3],
              "cache_mode": ("exact", "exact", "prefix", "dual")[i % 4],
              **({"cfg_scale": 0.5} if i == 4 else {})})
        for i in range(6)]
    prompts = [prompt_of(n, salt=1) for n in (1, 3, 5, 9, 4, 7)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert run_staggered(e, reqs) == alone
    e.check_memory()
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages


def test_token_budget_takes_turns(tmp_path):
    """With room for one canvas per forward, requests alternate and all finish as alone."""
    path = make_tiny_checkpoint("LLaDAModelLM", tmp_path, seed=1)
    llm = LLM(str(path), max_running_requests=4, page_size=4, max_prefill_tokens=12)
    prompts = [prompt_of(3, salt=i) for i in range(3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, dllm={"block_size": 4})
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate(p, params)[0].token_ids for p in prompts]
    llm.engine.check_memory()


def test_stop_ends_the_request_with_its_block(engines):
    """A stop id inside the second block ends the output right after it; no later block is
    decoded; the reference (which keeps filling the canvas) gives the same output."""
    llm = engines["llada_moe"]
    dllm = {"block_size": 4, "steps": 12}
    # The first prompt whose output has a token first met in the second block, not at its end.
    for salt in range(2, 22):
        prompt = prompt_of(4, salt=salt)
        free = llm.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                   dllm=dllm))[0].token_ids
        pos = next((i for i in range(4, 7) if free.index(free[i]) == i), None)
        if pos is not None:
            break
    assert pos is not None, "no prompt gave a token first met inside the second block"
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[free[pos]],
                            dllm=dllm)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == free[: pos + 1] and out.finish_reason == "stop"
    assert out.num_blocks == 2 and out.num_denoise_forwards == 8
    assert out.token_ids == reference(llm, prompt, params, {"steps_per_block": 4})
    llm.engine.check_memory()


def test_abort_cfg_request_mid_block_frees_both_sequences(engines):
    e = engines["llada"].engine
    req = e.make_request(prompt_of(6), SamplingParams(
        max_new_tokens=8, ignore_eos=True, dllm={"block_size": 8, "steps": 4,
                                                 "cfg_scale": 1.0}))
    e.add_request(req)
    e.step()
    assert req.full.cfg_pool_idx is not None and req.full.block is not None and req.full.block.step == 1
    assert e.req_pool.num_free == e.req_pool.max_reqs - 2
    assert len(req.kv_pages) == 2 * e.kv_pool.pages_for(14)
    e.abort(req.rid)
    assert req.finish_reason is FinishReason.ABORT
    e.check_memory()
    assert e.req_pool.num_free == e.req_pool.max_reqs
    assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages


def test_error_in_one_request_spares_the_others(engines):
    """A failing request ends alone; the retry runs each request (a CFG request with its
    twin) on its own, so every other output is as alone."""
    llm = engines["llada"]
    e = llm.engine
    poison = 7
    good = [prompt_of(5, salt=3), prompt_of(4, salt=4)]
    assert all(poison not in p for p in good)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, dllm={"block_size": 4}),
              SamplingParams(max_new_tokens=8, ignore_eos=True,
                             dllm={"block_size": 4, "cfg_scale": 1.0})]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(good, params, strict=True)]

    with fail_on_token(e.model, poison):
        reqs = [e.make_request(good[0], params[0]), e.make_request([poison] * 5, params[0]),
                e.make_request(good[1], params[1])]
        outs = e.run_to_completion(reqs)
    assert outs[1].finish_reason == "error" and "injected failure" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == alone
    e.check_memory()


def test_settings_are_validated(engines, sdar_dir):
    e = engines["llada"].engine
    with pytest.raises(ValueError, match="cache_mode"):
        SamplingParams(dllm={"cache_mode": "suffix"})
    with pytest.raises(ValueError, match="cfg_scale"):
        SamplingParams(dllm={"cfg_scale": -1.0})
    with pytest.raises(ValueError, match="block_size"):
        SamplingParams(dllm={"block_size": 0})
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        e.make_request([5, 6], SamplingParams(max_new_tokens=12, dllm={"block_size": 4,
                                                                       "steps": 4}))
    # More steps than masks is LLaDA's zero-token steps, not an error: every step runs.
    out = engines["llada"].generate([5, 6], SamplingParams(
        max_new_tokens=8, ignore_eos=True, dllm={"block_size": 4, "steps": 16}))[0]
    assert out.num_denoise_forwards == 16 and len(out.token_ids) == 8
    sdar = LLM(sdar_dir).engine
    for bad in ({"cfg_scale": 1.0}, {"cache_mode": "dual"}, {"block_size": 8}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            sdar.make_request([5, 6], SamplingParams(dllm=bad))


def test_defaults(engines, tmp_path):
    llada, dream = engines["llada"].engine, engines["dream"].engine
    assert llada.algorithm_name == "low_confidence_static"
    assert llada.algorithm_config["gumbel_fp64"] is True
    assert dream.algorithm_name == "entropy"
    req = llada.make_request([5, 6], SamplingParams(max_new_tokens=100))
    assert (req.block_size, req.full.cache_mode, req.full.cfg_scale, req.reserved_len) == (32, "exact",
                                                                                 0.0, 102)
    assert llada.make_request([5], SamplingParams(max_new_tokens=8)).block_size == 8
    assert dream.make_request([5], SamplingParams(max_new_tokens=100)).block_size == 100
    one = LLM(str(make_tiny_checkpoint("LLaDAModelLM", tmp_path, seed=1)),
              max_running_requests=1, algorithm_config={"cache_mode": "prefix"}).engine
    assert one.make_request([5], SamplingParams()).full.cache_mode == "prefix"
    with pytest.raises(ValueError, match="two request slots"):
        one.add_request(one.make_request([5], SamplingParams(dllm={"cfg_scale": 1.0})))


def test_step_has_no_host_sync(engines):
    """Forward and post-step (block logits, CFG, algorithm) read nothing back to the host;
    ``DenoisePost.read`` afterwards is the one read of the step."""
    from dllm.denoise import DenoisePost
    from dllm.runner.forward_batch import ForwardMode

    e = engines["llada"].engine
    # threshold 1.0: one token per step, so no request can finish in the first step
    reqs = [e.make_request(prompt_of(n), SamplingParams(
        max_new_tokens=8, ignore_eos=True, temperature=0.5 * (n % 2), seed=n,
        dllm={"algorithm": a, "block_size": b, "cache_mode": m, "cfg_scale": c, **k}))
        for n, a, b, m, c, k in [(3, "low_confidence_static", 4, "exact", 0.0, {}),
                                 (6, "threshold", 8, "prefix", 1.0, {"threshold": 1.0}),
                                 (5, "factor", 2, "dual", 0.0, {})]]
    for r in reqs:
        e.add_request(r)
    e.step()  # past every block's first (full) forward
    (batch,) = e.scheduler.schedule()
    assert batch.mode is ForwardMode.EXTEND and batch.batch_size == 4  # + one CFG twin
    post = e.runner.post_for(batch)

    with forbid_host_sync():
        out = e.runner.forward(batch, post)
    # A result row per forward row: the CFG twin's is computed and ignored by the host.
    assert len(DenoisePost.read(out).tokens) == 4
    for r in reqs:
        e.abort(r.rid)
    e.check_memory()


def test_cfg_request_whose_forward_always_fails_ends_with_an_error(engines):
    """The retry keeps a CFG request's two rows together; when they fail on their own the
    request ends with an error instead of waiting forever."""
    e = engines["llada"].engine
    req = e.make_request(prompt_of(5, salt=8), SamplingParams(
        max_new_tokens=8, ignore_eos=True, dllm={"block_size": 4, "cfg_scale": 1.0}))

    with fail_on_token(e.model, None):
        e.add_request(req)
        for _ in range(5):
            e.step()
            if req.finished:
                break
    assert req.finish_reason is FinishReason.ERROR and "injected failure" in req.error
    e.check_memory()


# ---- the window form and the overlap schedule ------------------------------------------------

MIXED = [  # (algorithm, settings, temperature): fixed schedules and a threshold rule
    ("low_confidence_static", {"steps": 4}, 0.0),
    ("threshold", {"threshold": 0.5}, 0.0),
    ("low_confidence_static", {"steps": 8, "remasking": "random"}, 0.7),
]
DREAM_MIXED = [("entropy", {"steps": 4}, 0.0), ("maskgit_plus", {"steps": 8}, 0.7),
               ("confidence_threshold", {"steps": 4, "threshold": 0.5}, 0.0)]


def mixed_params(family: str, n: int) -> list[SamplingParams]:
    table = DREAM_MIXED if family == "dream" else MIXED
    out = []
    for i in range(n):
        algorithm, keys, temperature = table[i % len(table)]
        out.append(SamplingParams(
            max_new_tokens=8, ignore_eos=True, seed=i, temperature=temperature,
            dllm={"algorithm": algorithm, "block_size": 4, **keys,
                  "cache_mode": ("exact", "prefix", "dual")[i % 3],
                  **({"cfg_scale": 1.0} if family == "llada" and i % 4 == 3 else {})}))
    return out


class Recorder:
    """Every batch the engine's runner is handed (a real engine, its forward wrapped)."""

    def __init__(self, engine):
        self.batches = []
        self.engine = engine
        self.forward = engine.runner.forward

    def __enter__(self):
        def recording(batch, post=None):
            self.batches.append(batch)
            return self.forward(batch, post)

        self.engine.runner.forward = recording
        return self

    def __exit__(self, *exc):
        self.engine.runner.forward = self.forward


def outcome(reqs) -> list[tuple]:
    return [(r.output_ids, r.num_forward_passes, r.num_denoise_forwards, r.num_blocks_committed,
             r.finish_reason) for r in reqs]


@pytest.fixture(scope="module")
def overlap_pairs(tmp_path_factory) -> dict[str, tuple[LLM, LLM]]:
    out = {}
    for name in ("llada", "dream"):
        path = str(make_tiny_checkpoint(ARCHS[name], tmp_path_factory.mktemp(f"ov-{name}"),
                                        seed=1))
        out[name] = tuple(LLM(path, max_running_requests=8, page_size=4, overlap_schedule=o)
                          for o in (True, False))
    return out


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_overlap_equals_plain(overlap_pairs, family):
    """Under the overlap schedule (each step queued before the last one is read) every
    request gives the tokens, forward counts and endings of the plain loop: alone, the cache
    modes, fixed schedules (the next block starts while the step ending a block is in
    flight, its tokens carried) and threshold rules (the request waits for the result), CFG
    and Dream's block-start steps, with requests arriving one per step."""
    overlapped, plain = overlap_pairs[family]
    prompts = [prompt_of(n, salt=5) for n in (3, 6, 1, 8, 4, 5)]
    params = mixed_params(family, len(prompts))
    results = []
    for llm in (overlapped, plain):
        e = llm.engine
        reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        with Recorder(e) as rec:
            run_staggered(e, reqs)
            e.drain()
        e.check_memory()
        assert e.kv_pool.num_free_pages == e.kv_pool.num_usable_pages
        results.append((outcome(reqs), rec.batches))
    (got, batches), (want, plain_batches) = results
    assert got == want
    assert not any(b.carry is not None for b in plain_batches)
    carried = [b for b in batches if b.carry is not None]
    assert carried, "no step continued from a result in flight"
    # Steps of a block started before the last one was read: its tokens carried into the
    # canvas at the finished block's offset (exact, and every block-start refresh).
    assert any(any(b.row_inputs["carry_at"]) for b in carried)


def test_window_form_equals_ragged_rows(overlap_pairs):
    """Uniform steps run as ``DLLM_EXTEND`` windows (the shape a CUDA graph captures);
    with the window form off every step is a ragged ``EXTEND``: the same tokens."""
    from dllm.runner.forward_batch import ForwardMode

    llm = overlap_pairs["llada"][1]
    e = llm.engine
    prompts = [prompt_of(5, salt=s) for s in range(4)]  # one canvas length: steps in step
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, seed=i,
                             dllm={"block_size": 4, "steps": 4,
                                   "cache_mode": ("exact", "prefix", "dual", "dual")[i],
                                   **({"cfg_scale": 1.5} if i == 3 else {})})
              for i in range(4)]
    outs = {}
    for max_window in (e.scheduler.max_window, 0):
        e.scheduler.max_window = max_window
        try:
            with Recorder(e) as rec:
                outs[max_window] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            e.scheduler.max_window = 2048
        modes = {b.mode for b in rec.batches}
        assert modes == ({ForwardMode.EXTEND} if max_window == 0
                         else {ForwardMode.EXTEND, ForwardMode.DLLM_EXTEND})
    assert outs[2048] == outs[0]
    e.check_memory()


def test_carried_tokens_land_at_their_offsets():
    """``carry_at`` / ``carry_len``: a row takes ``len`` tokens of its carried row at query
    index ``at``; the rest of the row, and rows without a carry, keep the host's ids."""
    from dllm.runner.forward_batch import ForwardMode, ScheduledBatch
    from dllm.runner.input_registry import InputRegistry

    registry = InputRegistry(4, 64, torch.device("cpu"))
    table = torch.arange(4 * 32, dtype=torch.int64).view(4, 32)
    batch = ScheduledBatch(ForwardMode.EXTEND)
    batch.add_row("a", 1, [1] * 6, 0)
    batch.add_row("b", 2, [2] * 3, 5, 9)
    batch.add_row("c", 3, [3] * 5, 0)
    batch.carry = torch.tensor([[70, 71, 72, 73], [80, 81, 82, 83]])
    batch.row_inputs.update(carry_row=[1, -1, 0], carry_at=[2, 0, 1], carry_len=[3, 0, 4])
    fb = registry.load(batch, table)
    assert fb.input_ids.tolist() == [1, 1, 80, 81, 82, 1, 2, 2, 2, 3, 70, 71, 72, 73]
    assert fb.out_cache_loc.tolist() == [32, 33, 34, 35, 36, 37, 69, 70, 71, 96, 97, 98, 99, 100]
    batch.row_inputs.update(carry_at=[4, 0, 1])  # past the row's end: refused
    with pytest.raises(ValueError, match="inside the row"):
        registry.load(batch, table)
