"""Step events and log-probabilities (``SamplingParams.denoise_steps`` / ``logprobs``,
``dllm.trace``): the events of a request replay to exactly its output and count its denoise
forwards, in batches with other requests and several algorithms; requests that did not ask
are unchanged; the log-probabilities equal ``log_softmax`` of a naive forward's logits; a
traced step still reads nothing back to the host inside the step."""

from __future__ import annotations

import math

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.denoise import DenoisePost, trace_top
from dllm.runner.forward_batch import AttentionMask, ForwardMode
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import forbid_host_sync, forward_full, run_staggered
from dllm.trace import StepEvent, TokenLogprob, trace_columns

ALGORITHMS = {
    "low_confidence_static": {"steps_per_block": 2},
    "low_confidence_dynamic": {"threshold": 0.5, "steps_per_block": 4},
    "threshold": {"threshold": 0.6},
    "joint_threshold": {"threshold": 0.6, "edit_threshold": 0.3, "max_post_edit_steps": 2},
    "entropy_bounded": {"eb_gamma": 1.0},
}


@pytest.fixture(scope="module")
def llm(sdar_dir) -> LLM:
    return LLM(sdar_dir, max_running_requests=16, page_size=4)


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> LLM:
    path = make_tiny_checkpoint("LLaDAModelLM", tmp_path_factory.mktemp("llada"), seed=1)
    return LLM(str(path), max_running_requests=8, page_size=4)


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> LLM:
    path = make_tiny_checkpoint("Fast_dLLM_QwenForCausalLM", tmp_path_factory.mktemp("v2"),
                                seed=1, bd_size=8)
    return LLM(str(path), max_running_requests=8, page_size=4)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(4000 + 17 * n + salt)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def replay(events: list[StepEvent]) -> list[int]:
    """The output the events write: each committed token at its output index (the last
    write of a position wins: an edit), which must cover a prefix of the output."""
    out: dict[int, int] = {}
    for ev in events:
        for i, t in ev.given:  # fixed before the block's first step (Fast-dLLM v2)
            out[ev.block_offset + i] = t
        for c in ev.committed:
            index = ev.block_offset + c.position
            assert index >= 0, "a step committed a prompt position"
            out[index] = c.token_id
    assert sorted(out) == list(range(len(out))), "the events leave a hole in the output"
    return [out[i] for i in range(len(out))]


def check_events(events: list[StepEvent], out_ids: list[int], forwards: int) -> None:
    assert len(events) == forwards
    assert [ev.forward for ev in events] == list(range(1, forwards + 1))
    assert replay(events)[: len(out_ids)] == out_ids
    for ev in events:  # positions are masked until committed, then never again
        assert not set(ev.masked) & {c.position for c in ev.committed}
        assert not (ev.done and ev.masked)  # (joint_threshold may edit past the last mask)
        assert all(0.0 <= c.confidence <= 1.0 + 1e-6 or c.confidence < 0 for c in ev.committed)
    blocks = [ev.block_index for ev in events]
    assert blocks == sorted(blocks)
    for b in set(blocks):  # steps count up from 0 within a block; only the last is done
        steps = [ev for ev in events if ev.block_index == b]
        assert [ev.step for ev in steps] == list(range(len(steps)))
        assert [ev.done for ev in steps[:-1]] == [False] * (len(steps) - 1)


def traced_run(llm: LLM, cases: list[tuple[list[int], SamplingParams]]) -> list:
    """Requests in a staggered batch (one arrives per engine step); their requests."""
    e = llm.engine
    reqs = [e.make_request(p, sp) for p, sp in cases]
    run_staggered(e, reqs)
    e.drain()
    e.check_memory()
    return reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_events_replay_to_output_in_mixed_batches(llm, overlap):
    """Every algorithm, traced and untraced requests side by side: each traced request's
    events replay to its output and count its denoise forwards, and every output (traced or
    not) is the one it has alone without any trace."""
    e = llm.engine
    e.overlap = overlap
    try:
        cases = []
        for i, (name, cfg) in enumerate(sorted(ALGORITHMS.items())):
            for traced in (True, False):
                cases.append((prompt_of(3 + 2 * i + traced), SamplingParams(
                    max_new_tokens=9 + i, ignore_eos=True, seed=7 + i,
                    temperature=0.7 if i % 2 else 0.0, top_k=20 if i % 2 else 0,
                    dllm={"algorithm": name, **cfg}, denoise_steps=traced,
                    logprobs=2 if traced and i % 2 else (0 if traced else None))))
        reqs = traced_run(llm, cases)
    finally:
        e.overlap = False
    for req, (prompt, sp) in zip(reqs, cases, strict=True):
        out = e.output_of(req)
        plain = SamplingParams(**{**sp.__dict__, "denoise_steps": False, "logprobs": None})
        alone = llm.generate(prompt, plain)[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text
        assert len(out.token_ids) == sp.max_new_tokens
        if not sp.traced:
            assert req.trace is None and out.logprobs is None
            continue
        check_events(req.trace.take_events(), out.token_ids, out.num_denoise_forwards)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert all(len(lp.top) == sp.logprobs for lp in out.logprobs)


def test_joint_threshold_edits_are_events(llm):
    """LLaDA2.1's token editing: an edited position is committed again (``edit``), and the
    replay still ends at the output (the last write of a position wins)."""
    cfg = {"algorithm": "joint_threshold", "threshold": 0.5, "edit_threshold": 0.0,
           "max_post_edit_steps": 3}
    edits = 0
    for n in range(2, 9):
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True, dllm=cfg, denoise_steps=True,
                            logprobs=0)
        (req,) = traced_run(llm, [(prompt_of(n, salt=1), sp)])
        out = llm.engine.output_of(req)
        events = req.trace.take_events()
        check_events(events, out.token_ids, out.num_denoise_forwards)
        edits += sum(c.edit for ev in events for c in ev.committed)
    assert edits > 0, "no prompt made joint_threshold edit a token: the test shows nothing"


def test_logprobs_equal_naive_forward(llm):
    """Each event's log-probability is ``log_softmax`` of the logits of a whole-sequence
    forward (no cache, explicit block-causal mask) over the block as it was before the step,
    at the committed token; the output's log-probabilities are those of the step that last
    wrote each token; the top alternatives are that forward's top-k, best first."""
    e = llm.engine
    b, mask = e.block_size, e.mask_token_id
    prompt = prompt_of(6, salt=2)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True, denoise_steps=True, logprobs=3,
                        dllm={"algorithm": "low_confidence_static", "steps_per_block": 2})
    others = [(prompt_of(5, salt=9), SamplingParams(max_new_tokens=8, ignore_eos=True))]
    req, _ = traced_run(llm, [(prompt, sp), *others])
    out = e.output_of(req)
    seq = list(prompt)
    block: list[int] | None = None
    last: dict[int, tuple[float, tuple]] = {}
    checked = 0
    for ev in req.trace.take_events():
        start = len(prompt) + ev.block_offset
        if ev.step == 0:
            known = seq[start:]
            block = known + [mask] * (b - len(known))
        logits = forward_full(e.model, seq[:start] + block, AttentionMask.BLOCK_CAUSAL, b)
        logp = torch.log_softmax(logits[start:start + b].double(), dim=-1)
        for c in ev.committed:
            assert math.isclose(c.logprob, logp[c.position, c.token_id].item(), abs_tol=2e-5)
            top = logp[c.position].topk(3)
            last[start + c.position - len(prompt)] = (c.logprob, tuple(top.indices.tolist()))
            block[c.position] = c.token_id
            checked += 1
        if ev.done:
            seq = seq[:start] + block
    assert checked >= len(out.token_ids)
    for i, lp in enumerate(out.logprobs):
        want, top_ids = last[i]
        assert lp.token_id == out.token_ids[i] and lp.logprob == want
        assert tuple(t for t, _ in lp.top) == top_ids
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0][1] >= lp.logprob


def test_full_attention_model_events_and_logprobs(llada):
    """LLaDA (full attention, blocks from the prompt end): the same contract."""
    e = llada.engine
    cases = [(prompt_of(n), SamplingParams(max_new_tokens=8, ignore_eos=True, seed=n,
                                           denoise_steps=n != 4, logprobs=1 if n != 4 else None,
                                           dllm={"steps": 4}))
             for n in (3, 4, 6)]
    reqs = traced_run(llada, cases)
    for req, (prompt, sp) in zip(reqs, cases, strict=True):
        out = e.output_of(req)
        plain = SamplingParams(**{**sp.__dict__, "denoise_steps": False, "logprobs": None})
        assert out.token_ids == llada.generate(prompt, plain)[0].token_ids
        if sp.traced:
            events = req.trace.take_events()
            check_events(events, out.token_ids, out.num_denoise_forwards)
            assert events[0].block_offset == 0
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
            assert all(lp.logprob is not None and lp.logprob <= 0 for lp in out.logprobs)


def test_shifted_logits_model_next_token_logprob(v2):
    """Fast-dLLM v2: a block's first token is read by the previous block's commit forward;
    its log-probability comes from that forward (the prefill's first token has none)."""
    e = v2.engine
    prompt = prompt_of(5)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True, denoise_steps=True, logprobs=1)
    (req,) = traced_run(v2, [(prompt, sp)])
    out = e.output_of(req)
    plain = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert out.token_ids == v2.generate(prompt, plain)[0].token_ids
    events = req.trace.take_events()
    assert len(events) == out.num_denoise_forwards
    # 20 = 3 + 8 + 8 + 1: the last token is read by block 2's commit forward and the output
    # ends on it; no denoise step of block 3 ever reports it (the README says so).
    assert replay(events) == out.token_ids[:-1]
    assert sum(len(ev.given) for ev in events) == 2  # blocks 1 and 2 start on a given token
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    # Output index 3 starts block 1 (positions 8..15): read by block 0's commit forward.
    assert all(lp.logprob is not None for lp in out.logprobs)
    assert len(out.logprobs[3].top) == 1


def test_traced_step_has_no_host_sync(llm):
    """A batch with a traced request still reads nothing back inside the step: its trace
    columns are part of the one packed result."""
    e = llm.engine
    reqs = [e.make_request(prompt_of(n), SamplingParams(
        max_new_tokens=8, ignore_eos=True, temperature=0.5 * (n % 2), seed=n,
        dllm={"algorithm": a, **ALGORITHMS[a]}, denoise_steps=n == 6,
        logprobs=4 if n == 9 else None))
        for n, a in zip((3, 6, 9, 12, 5), sorted(ALGORITHMS), strict=True)]
    for r in reqs:
        e.add_request(r)
    while any(r.req_pool_idx is None or r.needs_prefill for r in reqs):
        e.step()
    (batch,) = e.scheduler.schedule()
    # one row a request (two for a merged commit: the commit half, then its next block)
    assert batch.mode is ForwardMode.DLLM_EXTEND and len(set(batch.rids)) == len(reqs)
    post = e.runner.post_for(batch)
    assert post.trace == 4 == trace_top([row.req for row in batch.rows])
    with forbid_host_sync():
        out = e.runner.forward(batch, post)
    result = DenoisePost.read(out, post.trace)
    assert len(result.trace) == batch.batch_size and len(result.trace[0].top[0]) == 4
    assert out[0].shape[1] == e.block_size + 3 + trace_columns(e.block_size, 4)
    assert trace_columns(e.block_size, 4) == 2 * e.block_size * 5 + 1 + 2 * 4
    for r in reqs:
        e.abort(r.rid)
    e.check_memory()


def test_untraced_batch_computes_no_trace(llm):
    e = llm.engine
    req = e.make_request(prompt_of(5), SamplingParams(max_new_tokens=4, ignore_eos=True))
    e.add_request(req)
    while req.needs_prefill or req.req_pool_idx is None:
        e.step()
    (batch,) = e.scheduler.schedule()
    post = e.runner.post_for(batch)
    assert post.trace is None and set(batch.row_groups) == {e.algorithm_name}
    packed, _ = e.runner.forward(batch, post)
    assert packed.shape[1] == e.block_size + 3
    e.abort(req.rid)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="denoise_steps"):
        SamplingParams(denoise_steps=1)
    assert TokenLogprob(5, None).top == ()


@pytest.mark.gpu
def test_traced_batches_under_cuda_graphs_equal_eager(tmp_path):
    """On CUDA a traced batch replays a graph of its own (captured on first use): traced and
    untraced outputs, events and log-probabilities equal the eager runner's."""
    path = str(make_tiny_checkpoint("SDARForCausalLM", tmp_path / "sdar", seed=0,
                                    hidden_size=256, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=128))
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=8, algorithm="threshold", algorithm_config={"threshold": 0.5})
    cases = [(prompt_of(1 + 3 * i), SamplingParams(
        max_new_tokens=16, ignore_eos=True, seed=i, temperature=0.6 * (i % 2),
        denoise_steps=i % 3 == 0, logprobs=2 if i % 3 == 0 else None)) for i in range(7)]
    runs = []
    for extra in ({}, {"disable_cuda_graph": True}):
        llm = LLM(path, overlap_schedule=True, **kw, **extra)
        reqs = traced_run(llm, cases)
        runs.append([(llm.engine.output_of(r), r.trace and r.trace.take_events()) for r in reqs])
    for (g, g_events), (e, e_events) in zip(*runs, strict=True):
        assert g.token_ids == e.token_ids
        assert [[(c.position, c.token_id) for c in ev.committed] for ev in g_events or []] == \
            [[(c.position, c.token_id) for c in ev.committed] for ev in e_events or []]
        if g.logprobs is not None:
            assert [lp.token_id for lp in g.logprobs] == g.token_ids
            for a, b in zip(g.logprobs, e.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4
