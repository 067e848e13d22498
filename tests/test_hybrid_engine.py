"""The engine serves the hybrid Mamba2 + attention models autoregressively over its state pool
(issue 20, phase 2): greedy output equals transformers 4.57's ``generate`` token for token
(Nemotron-H: the naive reference's greedy output), alone, batched, with staggered arrivals and
with chunked prefill; prefill logits, chunked or not, and the logits of each decode step equal
the full no-cache forward (≤ 1e-5 relative, as phase 1 measured); no state slot, KV page or
request slot leaks after finish, abort and error. The vectors are
``tests/data/refvectors/hybrid_*.json`` (``scripts/refvectors/hybrid.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm import LLM, SamplingParams
from dllm.models.loader import load_model
from dllm.request import FinishReason
from dllm.runner.forward_batch import AttentionMask, ForwardMode, LogitsMode, ScheduledBatch
from dllm.testing.factory import make_tiny_hybrid_checkpoint
from dllm.testing.harness import fail_on_token, forbid_host_sync, run_staggered
from tests.refvector_replay import check_factory_weights

sys.path.insert(0, str(Path(__file__).parent))
from test_mamba2_mixer import close, decode_b64  # noqa: E402

DATA = Path(__file__).parent / "data" / "refvectors"
VECTORS = ["granite_h_micro", "granite_h_micro_rope", "granite_h_tiny", "bamba", "mamba2",
           "nemotron_h"]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


def checkpoint_of(name: str, root: Path) -> tuple[dict, Path]:
    record = json.loads((DATA / f"hybrid_{name}.json").read_text())
    ck = record["checkpoint"]
    path = make_tiny_hybrid_checkpoint(ck["layout"], root / name, seed=ck["seed"],
                                       **ck["overrides"])
    check_factory_weights(path, ck, ck["layout"])
    return record, path


@pytest.fixture(scope="module", params=VECTORS)
def hybrid(request, tmp_path_factory):
    record, path = checkpoint_of(request.param, tmp_path_factory.mktemp("hybrid"))
    return record, path, LLM(str(path), page_size=4, max_running_requests=8)


def test_greedy_equals_the_vectors_alone_and_batched(hybrid) -> None:
    record, _, llm = hybrid
    want = record["outputs"]
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in record["prompts"]]
    outs = llm.generate(record["prompts"], GREEDY)
    assert alone == want
    assert [o.token_ids for o in outs] == want
    assert [o.num_forward_passes for o in outs] == [16] * 3  # one prefill, 15 decodes
    llm.engine.check_memory()
    pool = llm.engine.runner.state_pool
    # per request: committed, a track slot, one for the prefix cache's snapshots
    assert pool.num_slots == 8 * 3
    assert pool.num_free + len(llm.engine.prefix_cache.held()[1]) == pool.num_slots


def test_staggered_arrivals_and_chunked_prefill(hybrid) -> None:
    """Requests join one per step while others decode, their prompts (5, 13 and 29 tokens)
    prefilled 6 tokens a step: chunks cross the Mamba chunk (8) and the conv window."""
    record, path, _ = hybrid
    llm = LLM(str(path), page_size=4, max_running_requests=8, max_prefill_tokens=6)
    e = llm.engine
    reqs = [e.make_request(p, GREEDY) for p in record["prompts"][::-1]]
    assert run_staggered(e, reqs) == record["outputs"][::-1]
    assert reqs[0].num_forward_passes == 5 + 15  # 29 tokens in 5 chunks, then 15 decodes
    outs = llm.generate(record["prompts"], GREEDY)  # all at once, chunked
    assert [o.token_ids for o in outs] == record["outputs"]
    e.check_memory()


def _extend(e, reqs, spans, mode: ForwardMode, logits: LogitsMode) -> torch.Tensor:
    """One forward of rows ``reqs[i].prompt_ids[start:end]`` (``spans[i]``), each reading and
    writing its committed state slot; the logits the batch asks for."""
    batch = ScheduledBatch(mode, attention_mask=AttentionMask.CAUSAL, logits_mode=logits)
    for req, (start, end) in zip(reqs, spans, strict=True):
        batch.add_row(req.rid, req.req_pool_idx, req.prompt_ids[start:end], start)
        batch.add_state(req.state_slot, req.state_slot)
    return e.runner.forward(batch, post=None)[1]


def logits_through_the_runner(e, sequences: list[list[int]], chunk: int | None,
                              split: int = 20) -> list[torch.Tensor]:
    """Each sequence's first ``split`` tokens as ``EXTEND`` rows (in chunks of ``chunk``,
    each continuing the committed state), then one ``DECODE`` row per further token (the
    state updated in place); the sequences side by side in each forward. Returns each
    sequence's logits ``[T, V]``."""
    reqs = [e.make_request(t, SamplingParams(max_new_tokens=1, ignore_eos=True))
            for t in sequences]
    for req in reqs:
        e.add_request(req)
    e.scheduler.admit()
    got: list[list[torch.Tensor]] = [[] for _ in reqs]
    step = chunk or split
    for s in range(0, split, step):
        out = _extend(e, reqs, [(s, min(split, s + step))] * len(reqs), ForwardMode.EXTEND,
                      LogitsMode.ALL)
        for i, rows in enumerate(out.split(min(split, s + step) - s)):
            got[i].append(rows)
    for t in range(split, max(len(q) for q in sequences)):
        live = [i for i, q in enumerate(sequences) if t < len(q)]
        out = _extend(e, [reqs[i] for i in live], [(t, t + 1)] * len(live), ForwardMode.DECODE,
                      LogitsMode.LAST)
        for i, row in zip(live, out, strict=True):
            got[i].append(row[None])
    for req in reqs:
        e.abort(req.rid)
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_prefill_and_decode_logits_equal_the_full_forward(hybrid, chunk, batched) -> None:
    """The sequence of each logits vector (a prompt and its 16 generated tokens; 21 and 45
    tokens) through the engine's runner, alone or both in each forward: every row's logits,
    prefill (whole or in chunks of 7) and decode, equal transformers' full forward."""
    record, _, llm = hybrid
    e = llm.engine
    entries = record["logits"]
    wants = [decode_b64(x["float32_b64"], x["shape"]) for x in entries]
    seqs = [x["tokens"] for x in entries]
    gots = (logits_through_the_runner(e, seqs, chunk) if batched
            else [logits_through_the_runner(e, [q], chunk)[0] for q in seqs])
    worst = max(close(g, w) for g, w in zip(gots, wants, strict=True))
    assert worst <= 1e-5
    e.check_memory()


def test_a_step_makes_no_host_sync(tmp_path) -> None:
    """Prefill and decode forwards of the dense hybrid (the MoE layouts' exact expert loop
    reads the hit experts, like every model's eager MoE path) never read the device."""
    record, path = checkpoint_of("granite_h_micro", tmp_path)
    e = LLM(str(path), page_size=4, max_running_requests=4).engine
    req = e.make_request(record["prompts"][1], GREEDY)
    e.add_request(req)
    e.scheduler.admit()
    with forbid_host_sync():
        _extend(e, [req], [(0, req.prompt_len)], ForwardMode.EXTEND, LogitsMode.LAST)
        _extend(e, [req], [(req.prompt_len - 1, req.prompt_len)], ForwardMode.DECODE,
                LogitsMode.LAST)
    e.abort(req.rid)
    e.check_memory()


def test_nemotron_h_hub_checkpoint_loads_by_its_names(tmp_path) -> None:
    """The hub's ``backbone.*`` names and ``hybrid_override_pattern`` (M - * E): q/k/v land in
    their rows of the packed projection, each expert in its own module."""
    _, path = checkpoint_of("nemotron_h", tmp_path)
    model, spec, config = load_model(path)
    w = load_file(str(path / "model.safetensors"))
    layers = model.backbone.layers
    assert [b.kind for b in layers] == list(config["hybrid_override_pattern"])
    attn = layers[3].mixer
    assert torch.equal(attn.qkv_proj.weight, torch.cat([
        w[f"backbone.layers.3.mixer.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(layers[6].mixer.experts[3].down_proj.weight,
                       w["backbone.layers.6.mixer.experts.3.down_proj.weight"])
    assert torch.equal(layers[0].mixer.A_log, w["backbone.layers.0.mixer.A_log"])
    assert spec.recurrent_state and not model.supports_cuda_graph  # the MoE expert loop


def test_no_slot_leaks_after_finish_abort_and_error(tmp_path) -> None:
    """Three requests; one is aborted mid-decode, one fails in its forward (an injected
    failure on a token only its prompt has), one waits and is aborted before admission;
    the others finish with the vectors' tokens, and every state slot, KV page and request
    slot is free again."""
    record, path = checkpoint_of("granite_h_micro", tmp_path)
    # One state slot per request (no prefix cache, whose track slots and snapshots add more).
    e = LLM(str(path), page_size=4, max_running_requests=2, enable_prefix_cache=False).engine
    prompts = record["prompts"]
    bad = [int(prompts[2][0])] * 3 + [400]  # 400 is in no other prompt or output
    assert all(400 not in p + o for p, o in zip(prompts, record["outputs"], strict=True))
    keep, drop, fail = (e.make_request(prompts[0], GREEDY), e.make_request(prompts[1], GREEDY),
                        e.make_request(bad, GREEDY))
    waiting = e.make_request(prompts[2], GREEDY)
    with fail_on_token(e.model, 400):
        for r in (keep, drop, fail, waiting):
            e.add_request(r)
        for _ in range(3):
            e.step()
        assert e.runner.state_pool.num_free == 0  # two running: both slots held
        e.abort(drop.rid)
        e.abort(waiting.rid)
        e.check_memory()
        while not (keep.finished and fail.finished):
            e.step()
    assert e.output_of(keep).token_ids == record["outputs"][0]
    assert drop.finish_reason is FinishReason.ABORT and waiting.finish_reason is FinishReason.ABORT
    assert fail.finish_reason is FinishReason.ERROR and "injected failure" in fail.error
    e.check_memory()
    assert e.runner.state_pool.num_free == e.runner.state_pool.num_slots == 2
    assert all(r.state_slot is None for r in (keep, drop, fail, waiting))


def test_state_slots_come_out_of_the_memory_budget(tmp_path) -> None:
    """A budget that fits two state slots in its half: two requests run at a time (the
    others wait for a slot), the KV pool takes the rest, and the output is unchanged."""
    record, path = checkpoint_of("bamba", tmp_path)
    probe = LLM(str(path), page_size=4, max_running_requests=8).engine.runner.state_pool
    per_slot = probe.memory_bytes() / (probe.num_slots + 1)
    budget = 4.5 * per_slot
    llm = LLM(str(path), page_size=4, max_running_requests=8,
              kv_cache_memory_gb=budget / 2**30)
    e = llm.engine
    pool = e.runner.state_pool
    assert pool.num_slots == 2
    kv_bytes = e.kv_pool.memory_bytes()
    assert pool.memory_bytes() + kv_bytes <= budget + e.kv_pool.page_size * 2 * 2 * 2 * 16 * 4
    outs = llm.generate(record["prompts"], GREEDY)
    assert [o.token_ids for o in outs] == record["outputs"]
    e.check_memory()


def test_a_denoise_forward_reads_the_committed_state_and_writes_nothing(tmp_path) -> None:
    """The runner half of block diffusion over a hybrid (the scheduler half is not built):
    after two prompt blocks (block-causal ``EXTEND``, state written to the committed slot), a
    ``DLLM_EXTEND`` forward of the next block — noisy, then final — writes its state to slot
    0 and leaves the committed slot bit-identical, and its logits equal the naive full
    recompute (block-causal attention, causal SSM); the commit forward (write slot = the
    committed slot) then leaves the state a whole-prefix ``EXTEND`` leaves."""
    from naive_hybrid import block_causal_mask, naive_logits

    record, path = checkpoint_of("granite_h_micro", tmp_path)
    e = LLM(str(path), page_size=4, max_running_requests=2).engine
    ids = record["prompts"][2][:12]
    reqs = [e.make_request(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
            for _ in range(2)]
    for r in reqs:
        e.add_request(r)
    e.scheduler.admit()
    pool = e.runner.state_pool

    def run(mode, req, start, tokens, write):
        batch = ScheduledBatch(mode, attention_mask=AttentionMask.BLOCK_CAUSAL, block_size=4,
                               logits_mode=LogitsMode.ALL)
        batch.add_row(req.rid, req.req_pool_idx, tokens, start)
        batch.add_state(req.state_slot, write)
        return e.runner.forward(batch, post=None)[1]

    def state(slot):
        return [t[slot].clone() for t in pool.conv + pool.ssm]

    req, whole = reqs
    run(ForwardMode.EXTEND, req, 0, ids[:8], req.state_slot)
    committed = state(req.state_slot)
    for block in (ids[8:10] + [300, 301], ids[8:12]):
        logits = run(ForwardMode.DLLM_EXTEND, req, 8, block, 0)
        assert all(torch.equal(a, b) for a, b in zip(state(req.state_slot), committed,
                                                     strict=True))
        want = naive_logits(path, ids[:8] + block, block_causal_mask(12, 4))[8:]
        assert close(logits, want) <= 1e-5
    run(ForwardMode.DLLM_EXTEND, req, 8, ids[8:12], req.state_slot)  # the commit forward
    run(ForwardMode.EXTEND, whole, 0, ids, whole.state_slot)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5)
               for a, b in zip(state(req.state_slot), state(whole.state_slot), strict=True))
    for r in reqs:
        e.abort(r.rid)
    e.check_memory()
