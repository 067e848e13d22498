"""Unmasking over vocabulary-split logits (dllm.algorithms.vocab_parallel) on 2 and 3 Gloo
ranks: every algorithm, greedy and sampled (temperature, seed, top-k, top-p), gives the
single-process tokens, done flags, transfer counts and states on the same logits, with ties
across shard boundaries going to the lowest vocabulary id; the sampler's confidences and
entropies agree to float32 rounding; and every collective the ranks run carries a few numbers
per position, never the logits.

One ``torch.multiprocessing`` spawn per group size runs every case; each rank computes the
single-process answer on the whole logits and its own answer on its columns."""

from __future__ import annotations

import pickle
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dllm.algorithms import ALGORITHMS, get_algorithm
from dllm.algorithms.base import DenoiseInput, SamplingTensors
from dllm.algorithms.dream import dream_probs, dream_propose
from dllm.algorithms.sampling import sample_tokens
from dllm.algorithms.vocab_parallel import token_logprob
from dllm.models.parallel import ShardedLogits, TensorParallel, record_collectives

V = 251  # divisible by neither 2 nor 3: the last shard has padding columns
BS, B = 3, 8
MASKS = (7, 200)  # a mask id in the first shard and one in a later one
TIED = [3, 150, 230]  # ids sharing the maximum at one position (several shards)

SAMPLINGS = {  # rows: greedy, temperature, temperature + top-k, temperature + top-p
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=[0.8, 1.0, 1.3]),
    "mixed": dict(temperature=[0.0, 0.8, 1.2], top_k=[0, 7, 0], top_p=[1.0, 1.0, 0.5]),
    "top_k_p": dict(temperature=[1.1, 0.7, 0.9], top_k=[40, 5, 0], top_p=[0.6, 1.0, 0.8]),
}
# The filters (top-k / top-p) are the sampler's, whatever the algorithm: every algorithm runs
# greedy and sampled, these (and the sampler and Dream cases) filtered too.
FILTERED = {"low_confidence_static", "entropy_bounded", "joint_threshold", "maskgit_plus"}
CONFIGS = {  # valid for a block of 8; every algorithm of the registry
    "low_confidence_static": [{"steps_per_block": 4}, {"steps_per_block": 4, "gumbel_fp64": True},
                              {"steps_per_block": 4, "rank_unfiltered": True},
                              {"steps_per_block": 4, "remasking": "random"}],
    "low_confidence_dynamic": [{"threshold": 0.3, "steps_per_block": 4},
                               {"threshold": 0.3, "rank_unfiltered": True}],
    "sequential": [{"steps_per_block": 4}],
    "threshold": [{"threshold": 0.3}],
    "joint_threshold": [{"threshold": 0.3, "edit_threshold": 0.2}],
    "entropy_bounded": [{"eb_gamma": 2.0}],
    "origin": [{"steps": 4}],
    "maskgit_plus": [{"steps": 4}, {"steps": 4, "alg_temp": 0.5}],
    "topk_margin": [{"steps": 4}],
    "entropy": [{"steps": 4}],
    "confidence_threshold": [{"steps": 4, "threshold": 0.2}],
    "factor": [{"factor": 2.0}],
    "hierarchical": [{"threshold": 0.3, "sub_block_size": 4}],
}
assert set(CONFIGS) == set(ALGORITHMS)
CASES = [(name, i, s, MASKS[j % 2]) for name, configs in CONFIGS.items()
         for i in range(len(configs)) for j, s in enumerate(SAMPLINGS)
         if s in ("greedy", "sampled") or (name in FILTERED and i == 0)]
SAMPLE_CASES = [  # sample_tokens' own options: exclude_id, LLaDA's fp64 draw, unfiltered ranks
    dict(), dict(exclude_id=200), dict(exclude_id=2), dict(gumbel_fp64=True),
    dict(unfiltered_confidence=True), dict(gumbel_fp64=True, unfiltered_confidence=True)]


def _logits(kind: str) -> torch.Tensor:
    """``[BS, B, V]``: peaked rows (so thresholds bite) with ties at some positions."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(BS, B, V, generator=g) * 2.0
    peak = torch.randint(0, V, (BS, B), generator=g)
    height = torch.rand(BS, B, generator=g) * 14.0
    x.scatter_(-1, peak[..., None], height[..., None] + 6.0)
    if kind == "ties":  # whole-number logits: many equal values, one exact 3-way tie at the top
        x = torch.round(x)
        x[0, 1, TIED] = x[0, 1].max() + 1
        x[2, 5, TIED[1:]] = x[2, 5].max() + 1
    return x


def _shard(x: torch.Tensor, rank: int, world: int) -> ShardedLogits:
    tp = TensorParallel(rank, world)
    start, end, rows = tp.vocab_range(V)
    local = torch.full((*x.shape[:-1], rows), float("-inf"))
    local[..., : end - start] = x[..., start:end]
    return ShardedLogits(local, start, V, tp)


def _sampling(spec: dict, seed: int = 5) -> SamplingTensors:
    def row(key, default, dtype):
        v = spec.get(key, default)
        return torch.as_tensor(v if isinstance(v, list) else [v] * BS, dtype=dtype)

    t, k, p = (row("temperature", 0.0, torch.float32), row("top_k", 0, torch.int64),
               row("top_p", 1.0, torch.float32))
    filters = (k > 0) | (p < 1)  # the host flags the engine sets (``denoise.sampling_flags``)
    return SamplingTensors(t, k, p, torch.tensor([seed, seed + 1, seed + 2]),
                           may_sample=bool((t > 0).any()),
                           may_filter=bool(((t > 0) & filters).any()),
                           may_filter_any=bool(filters.any()))


def _block(mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((BS, B), mask)
    tokens[0, :2] = torch.tensor([11, 12])  # filled: joint_threshold may edit them
    tokens[1, 0] = 13
    editable = torch.ones(BS, B, dtype=torch.bool)
    editable[1, 0] = False  # a prompt position inside the block
    return tokens, editable


def _run(name: str, config: dict, logits, spec: dict, mask: int) -> dict:
    algo = get_algorithm(name)
    tokens, editable = _block(mask)
    x = DenoiseInput(
        logits=logits, tokens=tokens, editable=editable, mask_id=mask,
        step=torch.tensor([0, 1, 3]), num_initial_masks=((tokens == mask) & editable).sum(-1),
        positions=torch.arange(B).expand(BS, B) + torch.tensor([[0], [40], [96]]),
        sampling=_sampling(spec), config=algo.stack_configs([algo.validate(config, B)] * BS,
                                                            "cpu"),
        state=algo.init_state(BS, "cpu"))
    out = algo.step(x)
    return {"tokens": out.tokens, "done": out.done, "num_transferred": out.num_transferred,
            **{f"state.{k}": v for k, v in out.state.items()}}


def _sample(logits, spec: dict, options: dict) -> dict:
    kw = dict(options)
    for flag in ("gumbel_fp64", "unfiltered_confidence"):
        if flag in kw:
            kw[flag] = torch.tensor([True, False, True])
    out = sample_tokens(logits, _sampling(spec, seed=9), torch.arange(B).expand(BS, B),
                        torch.tensor([0, 2, 5]), **kw)
    return {"x0": out.x0, "log_conf": out.log_conf, "entropy": out.entropy()}


def _dream(logits, spec: dict) -> dict:
    s = _sampling(spec, seed=13)
    probs = dream_probs(logits, s)
    return {"x0": dream_propose(probs, s, torch.tensor([1, 2, 3]),
                                torch.arange(B).expand(BS, B))}


def _cases():
    for kind in ("plain", "ties"):
        for name, i, s, mask in CASES:
            config = CONFIGS[name][i]
            yield (kind, "algo", name, i, s, mask), (
                lambda lg, c=config, n=name, sp=SAMPLINGS[s], m=mask: _run(n, c, lg, sp, m))
        for j, options in enumerate(SAMPLE_CASES):
            for s in ("greedy", "sampled", "top_k_p") if j else SAMPLINGS:
                yield (kind, "sample", j, s), (
                    lambda lg, o=options, sp=SAMPLINGS[s]: _sample(lg, sp, o))
        for s in SAMPLINGS:
            yield (kind, "dream", s), (lambda lg, sp=SAMPLINGS[s]: _dream(lg, sp))
        tokens = torch.randint(0, V, (BS, B), generator=torch.Generator().manual_seed(3))
        tokens[0, 1] = TIED[2]
        for exclude in (None, 5, 230):
            yield (kind, "logprob", exclude), (
                lambda lg, t=tokens, e=exclude: {"logprob": token_logprob(lg, t, e)})
        yield (kind, "argmax"), (lambda lg: {"x0": lg.argmax(dim=-1)})


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # ranks share the cores; tiny tensors
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    full = {kind: _logits(kind) for kind in ("plain", "ties")}
    for key, fn in _cases():
        with torch.no_grad():
            want = fn(full[key[0]])
            with record_collectives() as log:
                got = fn(_shard(full[key[0]], rank, world))
        results[key] = (want, got, log)
    if rank == 0:
        with open(Path(out) / f"results-{world}.pkl", "wb") as f:
            pickle.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("vocab_parallel")
    for world in (2, 3):
        mp.spawn(_rank, args=(world, _free_port(), str(out)), nprocs=world)
    return {world: pickle.loads((out / f"results-{world}.pkl").read_bytes())
            for world in (2, 3)}


def _equal(want: dict, got: dict) -> None:
    assert set(want) == set(got)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), (k, want[k], got[k])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["plain", "ties"])
def test_every_algorithm_equals_single_process(results, world, kind):
    """Each case's tokens, done flags, transfer counts and states, exactly."""
    cases = [k for k in results[world] if k[0] == kind and k[1] in ("algo", "dream", "argmax")]
    assert len(cases) == len(CASES) + len(SAMPLINGS) + 1
    moved = 0
    for key in cases:
        want, got, _ = results[world][key]
        _equal(want, got)
        if key[1] == "algo":
            moved += int(want["num_transferred"].sum())
    assert moved > len(CASES) * BS  # the steps commit tokens (the cases are not idle)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["plain", "ties"])
def test_sampler_tokens_confidences_and_entropy(results, world, kind):
    for key, (want, got, _) in results[world].items():
        if key[:2] != (kind, "sample"):
            continue
        assert torch.equal(got["x0"], want["x0"]), key
        assert torch.allclose(got["log_conf"], want["log_conf"], rtol=1e-5, atol=1e-6), key
        assert torch.allclose(got["entropy"], want["entropy"], rtol=1e-5, atol=1e-5), key


def test_ties_go_to_the_lowest_vocabulary_id(results):
    for world in (2, 3):
        _, got, _ = results[world][("ties", "argmax")]
        assert got["x0"][0, 1] == TIED[0] and got["x0"][2, 5] == TIED[1]
        _, got, _ = results[world][("ties", "sample", 0, "greedy")]
        assert got["x0"][0, 1] == TIED[0] and got["x0"][2, 5] == TIED[1]
    # the tied ids sit on different ranks: 0, 1, 1 of 2 and 0, 1, 2 of 3
    assert [t // TensorParallel(0, 2).vocab_range(V)[2] for t in TIED] == [0, 1, 1]
    assert [t // TensorParallel(0, 3).vocab_range(V)[2] for t in TIED] == [0, 1, 2]


@pytest.mark.parametrize("world", [2, 3])
def test_token_logprob(results, world):
    for key, (want, got, _) in results[world].items():
        if key[1] == "logprob":
            assert torch.allclose(got["logprob"], want["logprob"], rtol=1e-5, atol=1e-5), key


@pytest.mark.parametrize("world", [2, 3])
def test_no_collective_carries_the_logits(results, world):
    """Every collective of every case carries at most 16 numbers per position (statistics);
    the logits of one rank alone are ``BS x B x width`` (``width`` = 126 or 84)."""
    width = TensorParallel(0, world).vocab_range(V)[2]
    counts: dict[str, int] = {}
    for key, (_, _, log) in results[world].items():
        assert log, key  # the split path ran its exchanges
        for op, shape in log:
            counts[op] = counts.get(op, 0) + 1
            numel = torch.Size(shape).numel()
            assert numel <= BS * B * 16 and width not in shape, (key, op, shape)
    assert counts["all_gather"] > 0 and counts["all_reduce_sum"] > 0
    assert 16 * 5 < width  # the bound is far below one shard's logits
