"""Tensor parallelism over the hybrid Mamba2 models on CPU over Gloo (issue 22): the mixers
split by heads over 2 and 3 ranks give the single-process logits (every hybrid family, the
Granite-H MoE layout also expert parallel) and the single-process tokens through the engine
(Granite-H autoregressive and by block diffusion, several unmasking algorithms, batched and
staggered), each rank's state pool holds its own heads' state, and no slot leaks.

Sizes: 6 Mamba2 heads in 2 B/C groups (tp 2 splits the groups; tp 3 gives the middle rank
heads of both groups, so it holds both and its state slots are bigger than its neighbours'),
6 attention and KV heads, MLP and expert sizes divisible by 2 and 3, 6 experts. The logits of
every family at both sizes come from one spawn of 3 ranks (tp 3 over all of them, tp 2 over a
group of the first two); the engines' worker ranks run with one thread each, as two cores
need."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dllm import LLM, SamplingParams
from dllm.models.loader import load_model
from dllm.models.mamba2 import Mamba2Dims, Mamba2Mixer, shard_dims
from dllm.models.parallel import TensorParallel, record_collectives, set_tensor_parallel
from dllm.request import FinishReason
from dllm.runner.forward_batch import AttentionMask
from dllm.runner.memory import MambaStatePool
from dllm.testing.factory import make_tiny_hybrid_checkpoint
from dllm.testing.harness import forward_full, run_staggered
from tests.engines import Engines
from tests.test_engine import ALGORITHMS

ATTN = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6)
GRANITE = dict(ATTN, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2,
               shared_intermediate_size=96)
NEMOTRON = dict(ATTN, head_dim=8, mamba_num_heads=6, mamba_head_dim=16, intermediate_size=96,
                moe_intermediate_size=48, moe_shared_expert_intermediate_size=96)
# name -> (layout, config overrides, attention mask of its full forward, expert-parallel sizes)
MODELS = {
    "granite-h-micro": ("granite-h-micro", GRANITE, AttentionMask.CAUSAL),
    "granite-h-bd": ("granite-h-bd", GRANITE, AttentionMask.BLOCK_CAUSAL),
    "granite-h-tiny": ("granite-h-tiny", dict(GRANITE, num_local_experts=6,
                                              intermediate_size=48), AttentionMask.CAUSAL),
    "bamba": ("bamba", dict(GRANITE, intermediate_size=96), AttentionMask.CAUSAL),
    # Per-group gated norm: 2 groups (tp 3 splits a norm group over two ranks) and 3 groups
    # (tp 2: rank 0 holds two heads of group 0 and one of group 1).
    "nemotron-h": ("nemotron-h", dict(NEMOTRON, n_groups=2), AttentionMask.CAUSAL),
    "nemotron-h-3-groups": ("nemotron-h", dict(NEMOTRON, n_groups=3), AttentionMask.CAUSAL),
    "mamba2": ("mamba2", dict(hidden_size=48, num_heads=6, head_dim=16, n_groups=2),
               AttentionMask.CAUSAL),
}
IDS = list(range(5, 28))  # 23 tokens: three SSM chunks of 8
EXPERT_PARALLEL = "granite-h-tiny"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_hybrid")
    return {name: str(make_tiny_hybrid_checkpoint(layout, root / name, seed=1, **over))
            for name, (layout, over, _) in MODELS.items()}


# ---- the split arithmetic ---------------------------------------------------------------
def _split(heads: int, groups: int, size: int, norm_group: int | None = None):
    dims = Mamba2Dims(48, heads, 16, groups, 16, 4, 8, 1e-5, norm_group or heads * 16)
    return [(s.head_start, s.group_start, d.num_heads, d.n_groups, d.group_heads,
             s.norm_across) for d, s in (shard_dims(dims, r, size) for r in range(size))]


def test_heads_and_groups_per_rank():
    # tp divides the groups: each rank holds its own.
    assert _split(6, 2, 2) == [(0, 0, 3, 1, None, True), (3, 1, 3, 1, None, True)]
    # It does not: the middle rank's heads read both groups, so it holds both.
    assert _split(6, 2, 3) == [(0, 0, 2, 1, None, True), (2, 0, 2, 2, None, True),
                               (4, 1, 2, 1, None, True)]
    # Uneven heads per group on a rank.
    assert _split(6, 3, 2) == [(0, 0, 3, 2, (2, 1), True), (3, 1, 3, 2, (1, 2), True)]
    # Nemotron-H's per-group norm (16 · heads/groups channels a group): whole on each rank
    # where tp divides the groups, across ranks where it does not.
    assert [s[-1] for s in _split(6, 6, 3, 16)] == [False] * 3
    assert [s[-1] for s in _split(6, 2, 3, 48)] == [True] * 3
    assert [s[-1] for s in _split(6, 2, 2, 48)] == [False] * 2
    assert shard_dims(Mamba2Dims(48, 6, 16, 2, 16, 4, 8, 1e-5, 96), 0, 1)[0].num_heads == 6


def test_what_is_not_split_is_refused(ckpts):
    """Clear errors at build time: heads the size does not divide (naming both), and expert
    parallelism over Nemotron-H's experts."""
    try:
        set_tensor_parallel(TensorParallel(0, 4))
        with pytest.raises(ValueError, match=r"Mamba2 mixers' heads \(6\) are not divisible "
                                             r"by the tensor-parallel size 4"):
            Mamba2Mixer(Mamba2Dims(48, 6, 16, 2, 16, 4, 8, 1e-5, 96))
        set_tensor_parallel(TensorParallel(0, 5))
        with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 5"):
            load_model(ckpts["granite-h-micro"])
        # Nemotron-H's per-expert MoE modules: tensor parallel only.
        set_tensor_parallel(TensorParallel(0, 2, ep=2))
        with pytest.raises(ValueError, match="expert parallelism over Nemotron-H MoE layers "
                                             "is not built"):
            load_model(ckpts["nemotron-h"])
    finally:
        set_tensor_parallel(TensorParallel())


# ---- logits -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_logits(rank: int, port: int, ckpts: dict[str, str], out: str) -> None:
    """tp 3 over the three ranks, then tp 2 over ranks 0 and 1 (a group of their own)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    for world, group in ((3, None), (2, pair)):
        if rank >= world:
            continue
        for name, path in ckpts.items():
            for ep in (1, world) if name == EXPERT_PARALLEL else (1,):
                set_tensor_parallel(TensorParallel(rank, world, group, ep=ep))
                model, _, _ = load_model(path)
                spec = model.state_spec()
                with torch.no_grad(), record_collectives() as log:
                    logits = forward_full(model, IDS, MODELS[name][2], block_size=4)
                if rank == 0:
                    torch.save(logits, Path(out) / f"{name}-{world}-{ep}.pt")
                sums = [shape for op, shape in log if op == "all_reduce_sum"]
                torch.save((spec.num_layers, spec.dims.conv_dim, spec.dims.num_heads, sums),
                           Path(out) / f"state-{name}-{world}-{ep}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_logits(ckpts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("logits")
    # Forked, not spawned: the ranks start with this process's imports (a spawned rank
    # imports torch and this module again, most of the cost on a loaded machine); each runs
    # one thread and starts no thread pool inherited from here.
    mp.start_processes(_rank_logits, args=(_free_port(), ckpts, str(out)), nprocs=3,
                       start_method="fork")
    return out


LOGIT_CASES = [(name, world, ep) for name in MODELS for world in (2, 3)
               for ep in ((1, world) if name == EXPERT_PARALLEL else (1,))]


@pytest.mark.parametrize(("name", "world", "ep"), LOGIT_CASES,
                         ids=[f"{n}-tp{w}-ep{e}" for n, w, e in LOGIT_CASES])
def test_logits_equal_single_process(ckpts, tp_logits, name, world, ep):
    set_tensor_parallel(TensorParallel())
    model, _, _ = load_model(ckpts[name])
    with torch.no_grad():
        want = forward_full(model, IDS, MODELS[name][2], block_size=4)
    got = torch.load(tp_logits / f"{name}-{world}-{ep}.pt")
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_each_rank_holds_its_heads_state_and_the_norm_exchanges_a_scalar(tp_logits):
    """Granite-H micro (3 Mamba layers, 6 heads, 2 groups of 16 states): a rank's conv state
    has its heads' x channels and its groups' B and C, the SSM state its heads. Its
    full-width gated norm sends one number per token and layer; everything else the forward
    all-reduces is a hidden-size row per token (embedding, 3 mixers, 1 attention, 4 MLPs)."""
    def state(world, rank):
        return torch.load(tp_logits / f"state-granite-h-micro-{world}-1-{rank}.pt")

    # conv channels: 16 per head + 2 · 16 per group held.
    assert [state(2, r)[:3] for r in range(2)] == [(3, 48 + 32, 3)] * 2
    assert [state(3, r)[:3] for r in range(3)] == [(3, 32 + 32, 2), (3, 32 + 64, 2),
                                                   (3, 32 + 32, 2)]
    for world in (2, 3):
        sums = state(world, 0)[3]
        assert sorted(sums) == sorted([(23, 1)] * 3 + [(23, 48)] * 9)


# ---- the engine ---------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 33))]


@pytest.fixture(scope="module")
def engines(ckpts):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = Engines(ckpts, one_thread_ranks=True)
    yield made
    made.release()
    torch.set_num_threads(threads)


def _tokens(llm: LLM, params) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params)
    llm.engine.check_memory()
    return [o.token_ids for o in outs]


def _staggered(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    e = llm.engine
    out = run_staggered(e, [e.make_request(p, sp) for p, sp in zip(PROMPTS, params,
                                                                   strict=True)])
    e.drain()
    e.check_memory()
    return out


def _state_slot_bytes(rank: int, tp: int) -> int:
    """One state slot of Granite-H micro's 3 Mamba layers on ``rank`` (fp32)."""
    dims, _ = shard_dims(Mamba2Dims.from_config(
        {**GRANITE, "architectures": ["GraniteMoeHybridForCausalLM"], "mamba_d_state": 16,
         "mamba_d_conv": 4, "mamba_chunk_size": 8, "rms_norm_eps": 1e-5}), rank, tp)
    return MambaStatePool.bytes_per_slot(3, dims.conv_state_shape(1)[1:],
                                         dims.ssm_state_shape(1)[1:], torch.float32)


@pytest.mark.parametrize("tp", [2, 3])
def test_autoregressive_tokens_equal_single_process(engines, tp):
    """Greedy, batched; at tp 3 also seeded sampling with staggered arrivals, under a memory
    budget whose half fits 11 state slots of rank 0's size but 10 of the middle rank's (it
    holds both B/C groups): every rank's pool takes 10, and the prompts still run."""
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    sampled = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_k=40,
                              seed=7 + i) for i in range(3)]
    single = engines("granite-h-micro", 1)
    want = _tokens(single, greedy)
    kw = {}
    if tp == 3:
        want_sampled = _staggered(single, sampled)
        small, big = _state_slot_bytes(0, 3), _state_slot_bytes(1, 3)
        assert small < big == _state_slot_bytes(2, 3) + 32 * 3 * 4 * 3
        half = 10 * big + big // 2
        assert (half // small, half // big) == (11, 10)
        kw = {"kv_cache_memory_gb": 2 * half / 2**30}
    llm = engines("granite-h-micro", tp, **kw)
    pool = llm.engine.runner.state_pool
    per_request = llm.engine.runner.config.state_slots_per_request
    assert 10 < 4 * per_request  # the budget binds at tp 3
    assert pool.num_slots == (10 if tp == 3 else 4 * per_request)
    assert tuple(pool.conv[0].shape[1:]) == ({2: 80, 3: 64}[tp], 3)  # rank 0's channels
    assert tuple(pool.ssm[0].shape[1:]) == (6 // tp, 16, 16)
    assert _tokens(llm, greedy) == want
    if tp == 3:
        assert _staggered(llm, sampled) == want_sampled
    assert pool.num_free == pool.num_slots


# Every unmasking algorithm of tests/test_engine.py (joint_threshold may still edit a block
# with no mask left, in denoise steps, which write no state).
BD_ALGORITHMS = {2: sorted(ALGORITHMS), 3: sorted(ALGORITHMS)}


def _bd_params(algorithm: str, i: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=8 + i, ignore_eos=True, seed=3 + i,
                          dllm={"algorithm": algorithm, **ALGORITHMS[algorithm]})


@pytest.mark.parametrize("tp", [2, 3])
def test_block_diffusion_tokens_equal_single_process(engines, tp):
    """Batched (``BD_ALGORITHMS``; configs of ``tests/test_engine.py``); at tp 3 also
    staggered, with low_confidence_static."""
    single = engines("granite-h-bd", 1)
    want = {a: _tokens(single, _bd_params(a)) for a in BD_ALGORITHMS[tp]}
    staggered = [_bd_params("low_confidence_static", i) for i in range(3)]
    want_staggered = _staggered(single, staggered) if tp == 3 else None
    llm = engines("granite-h-bd", tp)
    assert {a: _tokens(llm, _bd_params(a)) for a in BD_ALGORITHMS[tp]} == want
    if tp == 3:
        assert _staggered(llm, staggered) == want_staggered


def test_abort_mid_block_returns_every_slot(engines):
    """tp 3: one request aborted in the middle of its denoise block, one waiting aborted, one
    finishing with the single-process tokens; every state slot, page and request slot is
    free after."""
    params = _bd_params("low_confidence_static", 0)
    want = engines("granite-h-bd", 1).generate(PROMPTS[0], params)[0].token_ids
    e = engines("granite-h-bd", 3).engine
    keep, drop = e.make_request(PROMPTS[0], params), e.make_request(PROMPTS[2], params)
    for r in (keep, drop):
        e.add_request(r)
    for _ in range(3):
        e.step()
    assert keep.state_slot is not None and drop.state_slot is not None
    assert not drop.finished
    e.abort(drop.rid)
    while not keep.finished:
        e.step()
    e.drain()
    assert e.output_of(keep).token_ids == want
    assert drop.finish_reason is FinishReason.ABORT and drop.state_slot is None
    e.check_memory()
    assert e.runner.state_pool.num_free == e.runner.state_pool.num_slots
