"""The merged commit (issue 24 item 0): a resolved block's commit forward runs in the same
``DLLM_EXTEND`` row as the next block's first denoise step (2·B query tokens, block-causal).

Held here, on the CPU in float32: the tokens equal the separate-commit path
(``merged_commit=False``) for every block-diffusion family (SDAR, LLaDA2, SDAR-MoE/TraDo, the
Granite-H block-diffusion hybrid; Fast-dLLM v2 keeps its own commit pass) and every unmasking
algorithm, alone, batched and staggered, with the prefix cache on and off and under the
overlap schedule; one forward fewer per committed block where it applies, none where it does
not (token editing, shifted logits); the merged step reads nothing back to the host; the
hybrid's committed state after a merged commit is the separate commit's."""

from __future__ import annotations

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.runner.forward_batch import ForwardMode, LogitsMode, StepKind
from dllm.testing import make_tiny_checkpoint
from dllm.testing.factory import make_tiny_hybrid_checkpoint
from dllm.testing.harness import forbid_host_sync, run_staggered

FAMILIES = ["SDARForCausalLM", "LLaDA2MoeModelLM", "SDARMoeForCausalLM", "granite-h-bd"]
ALGORITHMS = {
    "low_confidence_static": {"steps_per_block": 2},
    "low_confidence_dynamic": {"threshold": 0.5, "steps_per_block": 4},
    "sequential": {},
    "threshold": {"threshold": 0.6},
    "factor": {},
    "entropy_bounded": {"eb_gamma": 1.0},
    "joint_threshold": {"threshold": 0.6, "edit_threshold": 0.5, "max_post_edit_steps": 2},
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("merged")
    out = {}
    for fam in [*FAMILIES, "Fast_dLLM_QwenForCausalLM"]:
        if fam == "granite-h-bd":
            out[fam] = str(make_tiny_hybrid_checkpoint(fam, root / fam, seed=0))
        else:
            out[fam] = str(make_tiny_checkpoint(fam, root / fam, seed=0))
    return out


_ENGINES: dict[tuple, LLM] = {}


def engine(path: str, merged: bool, cache: bool = True, overlap: bool = False) -> LLM:
    """One engine per setting for the module (reused: each run ends with nothing running)."""
    key = (path, merged, cache, overlap)
    if key not in _ENGINES:
        _ENGINES[key] = LLM(path, page_size=4, max_running_requests=8, max_prefill_tokens=16,
                            merged_commit=merged, enable_prefix_cache=cache,
                            overlap_schedule=overlap, state_track_interval=8)
    return _ENGINES[key]


def prompt(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(31 * n + salt)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def workload(algorithm: str, salt: int = 0, b: int = 4
             ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts shorter and longer than a block, one sent twice past its shared prefix (a
    prefix-cache hit on a generated block), each output crossing a block boundary."""
    shared = prompt(9, 99 + salt)
    prompts = [prompt(2, salt), shared + prompt(3, salt), shared, prompt(13, salt + 1)]
    params = [SamplingParams(max_new_tokens=b + 2 + 3 * i, ignore_eos=True, seed=i,
                             temperature=0.8 if i % 2 else 0.0,
                             dllm={"algorithm": algorithm, **ALGORITHMS[algorithm]})
              for i in range(len(prompts))]
    return prompts, params


def run(llm: LLM, prompts, params, how: str) -> list[tuple[list[int], int, int, int]]:
    """Each request's tokens and its (forwards, separate commits, merged commits)."""
    e = llm.engine
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    if how == "alone":
        for r in reqs:
            run_staggered(e, [r])
    elif how == "batched":
        for r in reqs:
            e.add_request(r)
        while any(not r.finished for r in reqs):
            e.step()
    else:
        run_staggered(e, reqs, after_step=e.check_memory)
    e.drain()
    e.check_memory()
    return [(e.output_of(r).token_ids, r.num_forward_passes, r.num_commit_forwards,
             r.num_merged_commits) for r in reqs]


def clear(*llms: LLM) -> None:
    for llm in llms:
        if llm.engine.prefix_cache is not None:
            llm.engine.clear_prefix_cache()


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_the_separate_commit_path(paths, family, cache) -> None:
    merged, separate = engine(paths[family], True, cache), engine(paths[family], False, cache)
    algorithms = list(ALGORITHMS) if family == "SDARForCausalLM" else [
        "low_confidence_static", "threshold", "joint_threshold"]
    for k, algorithm in enumerate(algorithms):
        for how in ("alone", "batched", "staggered") if k < 3 else ("batched", "staggered"):
            prompts, params = workload(algorithm, k, merged.engine.block_size)
            clear(merged, separate)
            got, want = run(merged, prompts, params, how), run(separate, prompts, params, how)
            assert [g[0] for g in got] == [w[0] for w in want], (algorithm, how)
            for (_, fg, cg, mg), (_, fw, cw, mw) in zip(got, want, strict=True):
                assert mw == 0 and cg + mg == cw  # every commit of the old path, once
                assert fg == fw - mg  # and each merged one saved a forward
                if algorithm == "joint_threshold":
                    assert mg == 0  # token editing: a filled block is final only after it
                elif how == "alone":
                    assert cg == 0  # no separate commit forward left
            if how == "batched" and algorithm != "joint_threshold":
                assert sum(g[3] for g in got) > 0


def test_mixed_batches_of_merged_and_plain_rows(paths) -> None:
    """Requests of different algorithms (one of them editing) side by side, staggered: merged
    rows beside plain denoise rows and separate commits in the same batches."""
    merged = engine(paths["SDARForCausalLM"], True)
    separate = engine(paths["SDARForCausalLM"], False)
    names = list(ALGORITHMS)
    prompts = [prompt(3 + 2 * i, 7) for i in range(6)]
    params = [SamplingParams(max_new_tokens=5 + 2 * i, ignore_eos=True, seed=i,
                             temperature=0.5 * (i % 2), dllm={"algorithm": names[i % len(names)],
                                                              **ALGORITHMS[names[i % len(names)]]})
              for i in range(6)]
    clear(merged, separate)
    got, want = run(merged, prompts, params, "staggered"), run(separate, prompts, params,
                                                                "staggered")
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g[3] for g in got) > 0


@pytest.mark.parametrize("family", ["SDARForCausalLM", "granite-h-bd"])
def test_overlap_schedule_gives_the_same_tokens(paths, family) -> None:
    """Under the overlap schedule the host learns that a block resolved a step late, when
    the next forward on it is queued already: that forward is its commit (the separate
    path), unless the algorithm's fixed schedule ends at the step in flight — then the next
    forward is the merged row, built before the result is read. Either way the tokens are
    those of the plain schedule with separate commits."""
    for algorithm in ("low_confidence_static", "sequential", "threshold", "joint_threshold"):
        prompts, params = workload(algorithm)
        want = run(engine(paths[family], False), prompts, params, "staggered")
        for merged in (True, False):
            llm = engine(paths[family], merged, overlap=True)
            clear(llm)
            got = run(llm, prompts, params, "staggered")
            assert [g[0] for g in got] == [w[0] for w in want], (algorithm, merged)
            merges = sum(g[3] for g in got)
            if merged and algorithm in ("low_confidence_static", "sequential"):
                assert merges > 0
            elif not merged or algorithm == "joint_threshold":
                assert merges == 0


def test_one_token_per_step_saves_one_forward_a_block(paths) -> None:
    """SDAR block 4, one token per step: 4 forwards a block instead of 5 (the last block
    ends the request and needs no commit either way); the runner counts the same forwards
    (``ModelRunner.forward_counts``: here all eager, on the CPU), under the overlap schedule
    too."""
    p = prompt(8, 3)  # two full prompt blocks: one prefill forward
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True,
                        dllm={"algorithm": "low_confidence_static", "steps_per_block": 4})
    for overlap in (False, True):
        outs = {}
        for merged in (True, False):
            llm = engine(paths["SDARForCausalLM"], merged, cache=False, overlap=overlap)
            before = llm.engine.runner.forward_counts.copy()
            outs[merged] = llm.generate(p, sp)[0]
            ran = llm.engine.runner.forward_counts - before
            # overlapped too: the forward in flight on the last block is sure to end the
            # request, which takes no row in the next one (``surely_finishes``)
            assert ran == {("eager", StepKind.PREFILL): 1,
                           ("eager", StepKind.DENOISE): outs[merged].num_forward_passes - 1}
        new, old = outs[True], outs[False]
        assert new.token_ids == old.token_ids and len(new.token_ids) == 16
        assert old.num_forward_passes == 1 + 4 * 4 + 3
        assert new.num_forward_passes == 1 + 4 * 4
        assert new.num_denoise_forwards == old.num_denoise_forwards == 16
        assert new.num_commit_forwards == 0 and old.num_commit_forwards == 3


def test_fast_dllm_v2_keeps_its_commit_pass(paths) -> None:
    path = paths["Fast_dLLM_QwenForCausalLM"]
    prompts, params = workload("threshold")
    got = run(engine(path, True), prompts, params, "staggered")
    want = run(engine(path, False), prompts, params, "staggered")
    assert got == want and all(g[3] == 0 for g in got)
    assert not engine(path, True).engine.scheduler.merged_commit


def _resolve_one(llm: LLM, p: list[int], sp: SamplingParams):
    """Step until ``p``'s first denoised block resolved (its commit not launched)."""
    e = llm.engine
    req = e.make_request(p, sp)
    e.add_request(req)
    while not (req.denoise.block is not None and req.denoise.block.resolved):
        e.step()
    return req


def test_merged_step_reads_nothing_back(paths) -> None:
    """The merged commit of an attention-only model: two whole-block rows of the request,
    the resolved block's final tokens (the commit half, its KV) then the next block's masks
    on top of them; of a hybrid: one row of 2·B tokens from the resolved block's start, logits
    of its last B tokens only. Forward and algorithm step with no host read."""
    from dllm.denoise import DenoisePost

    for family in ("SDARForCausalLM", "granite-h-bd"):
        llm = engine(paths[family], True, cache=True)
        clear(llm)
        e = llm.engine
        b = e.block_size
        sp = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7, seed=3,
                            dllm={"algorithm": "threshold", "threshold": 0.6})
        req = _resolve_one(llm, prompt(6, 1), sp)
        done = req.denoise.block
        (batch,) = e.scheduler.schedule()
        assert batch.mode is ForwardMode.DLLM_EXTEND
        assert batch.input_ids[:b] == done.tokens
        assert batch.input_ids[b:] == [e.mask_token_id] * b
        assert req.denoise.block.start == done.start + b
        if family == "granite-h-bd":
            assert batch.logits_mode is LogitsMode.BLOCK
            assert batch.extend_lens == [2 * b] and batch.prefix_lens == [done.start]
            assert batch.state_split == [b] and batch.rows[0].commit is done
        else:
            assert batch.logits_mode is LogitsMode.ALL
            assert batch.extend_lens == [b, b]
            assert batch.prefix_lens == [done.start, done.start + b]
            assert batch.rids == [req.rid, req.rid]
            assert batch.rows[0].commit_half and batch.rows[0].block is done
            assert not batch.rows[1].commit_half and batch.rows[1].block is req.denoise.block
        with forbid_host_sync():
            out = e.runner.forward(batch)
        result = DenoisePost.read(out)
        assert all(len(t) == b for t in result.tokens)
        e.abort(req.rid)
        e.check_memory()


def test_hybrid_committed_state_equals_the_separate_commit(paths) -> None:
    """The state the merged row keeps (after its first block) is the state the separate
    commit forward writes: compared after the first block of the same request, equal within
    float32 rounding (the merged row's mixer runs both blocks in one pass: another summation
    order; 1e-6 absolute was exceeded by 1.07e-6 on one CPU)."""
    states = {}
    for merged in (True, False):
        llm = engine(paths["granite-h-bd"], merged, cache=False)
        e = llm.engine
        sp = SamplingParams(max_new_tokens=12, ignore_eos=True,
                            dllm={"algorithm": "low_confidence_static", "steps_per_block": 2})
        req = _resolve_one(llm, prompt(6, 2), sp)
        first_block_end = req.denoise.block.start + e.block_size
        while req.committed_len == first_block_end and not req.finished:
            e.step()  # the commit (merged: and the next block's first step) applies
            if req.num_merged_commits or req.num_commit_forwards:
                break
        pool = e.runner.state_pool
        states[merged] = [t[req.state_slot].clone() for t in pool.conv + pool.ssm]
        e.abort(req.rid)
        e.check_memory()
    for a, b in zip(states[True], states[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_opt_out_flag_is_on_the_command_line() -> None:
    """No flag: the engine decides by device (merged on the CPU, ``tests/test_engine.py`` counts
    it); ``--disable-merged-commit``: always separate."""
    import argparse

    from dllm.cli_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).merged_commit is None  # by device
    assert engine_config_from_args(p.parse_args(["--disable-merged-commit"])).merged_commit is False


def _sdar_and_llada2_vectors() -> list:
    from tests import test_refvectors_llada2 as llada2
    from tests import test_refvectors_sdar as sdar

    return [(sdar, v) for v in sdar.VECTORS] + [(llada2, v) for v in llada2.VECTORS]


@pytest.mark.parametrize("case", _sdar_and_llada2_vectors(),
                         ids=lambda c: c[1]["name"])
def test_reference_vectors_with_merged_commits(case) -> None:
    """The SDAR and LLaDA2 reference vectors (the official generators' tokens), replayed with
    merged commits (``tests/refvector_replay`` runs them with separate commits, as the
    references do): the same tokens, alone and in one batch; SDAR's forwards are the
    reference's prefill + denoise + store forwards less the final block's store and less
    one per merged commit."""
    from tests.refvector_replay import check_outputs, get_llm

    module, vector = case
    replay = module.replay_of(vector)
    llm = get_llm(vector, {**replay.engine_args, "merged_commit": True})
    assert llm.engine.scheduler.merged_commit
    outs = [llm.generate([p], [sp])[0] for p, sp in zip(replay.prompts, replay.params,
                                                        strict=True)]
    check_outputs(outs, replay, vector["name"])
    check_outputs(llm.generate(replay.prompts, replay.params), replay, vector["name"])
    if module.__name__.endswith("sdar"):
        reqs = [f["prefill"] + f["denoise"] + f["store"] - 1 for f in vector["row_forwards"]]
        merged = [o.num_blocks - 1 - o.num_commit_forwards for o in outs]
        assert [o.num_forward_passes for o in outs] == [
            r - m for r, m in zip(reqs, merged, strict=True)]
        assert all(o.num_commit_forwards == 0 for o in outs)
