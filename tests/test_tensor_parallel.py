"""Tensor parallelism on CPU over Gloo: an engine of 2 or 3 ranks (one process each) gives the
single-process tokens for every family and unmasking algorithm, its models give the
single-process logits, and a rank that dies ends the others.

The ranks are spawned once per engine (the engines are module fixtures) and once per group
size for the logits (one ``torch.multiprocessing`` spawn does every family)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dllm import LLM, SamplingParams
from dllm.models.loader import load_model
from dllm.models.moe import StackedExperts
from dllm.models.parallel import TensorParallel, record_collectives, set_tensor_parallel
from dllm.runner.forward_batch import AttentionMask
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import forward_full
from tests.engines import Engines
from tests.test_engine import ALGORITHMS as BLOCK_ALGORITHMS

# Sizes every group of 2 and 3 ranks splits evenly (heads, KV heads, MLP and expert sizes,
# 6 experts: 3 or 2 per rank under expert parallelism).
# Qwen3 has one KV head: replicated on every rank.
SHAPES = {
    "Qwen3ForCausalLM": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=1,
                             head_dim=16, intermediate_size=96),
    "SDARForCausalLM": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6,
                            head_dim=16, intermediate_size=96),
    "LLaDA2MoeModelLM": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6,
                             head_dim=16, intermediate_size=96, moe_intermediate_size=48,
                             num_experts=6, n_group=3, topk_group=2),
    "SDARMoeForCausalLM": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6,
                               head_dim=16, moe_intermediate_size=48, intermediate_size=96,
                               num_experts=6),
    "LLaDAModelLM": dict(d_model=96, n_heads=6, n_kv_heads=6, mlp_hidden_size=96),
}
MASKS = {"Qwen3ForCausalLM": AttentionMask.CAUSAL, "SDARForCausalLM": AttentionMask.BLOCK_CAUSAL,
         "LLaDA2MoeModelLM": AttentionMask.BLOCK_CAUSAL,
         "SDARMoeForCausalLM": AttentionMask.BLOCK_CAUSAL, "LLaDAModelLM": AttentionMask.FULL}
MOE = ("LLaDA2MoeModelLM", "SDARMoeForCausalLM")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {arch: str(make_tiny_checkpoint(arch, root / arch, seed=1, **shape))
            for arch, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def engines(ckpts):
    made = Engines(ckpts)
    yield made
    made.release()


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params)
    llm.engine.check_memory()
    return [o.token_ids for o in outs]


def _same(engines, arch: str, tp: int, params: SamplingParams, ep: int = 1) -> None:
    want = _tokens(engines(arch, 1), params)
    assert _tokens(engines(arch, tp, expert_parallel_size=ep), params) == want


@pytest.mark.parametrize(("tp", "temperature"), [(2, 0.0), (2, 0.8), (3, 0.0), (3, 0.8)])
def test_decode_equals_single_process(engines, tp, temperature):
    _same(engines, "Qwen3ForCausalLM", tp,
          SamplingParams(max_new_tokens=8, temperature=temperature, top_k=20, seed=5))


@pytest.mark.parametrize("algorithm", sorted(BLOCK_ALGORITHMS))
def test_block_diffusion_every_algorithm_tp2(engines, algorithm):
    _same(engines, "SDARForCausalLM", 2, SamplingParams(
        max_new_tokens=8, ignore_eos=True, seed=3,
        dllm={"algorithm": algorithm, **BLOCK_ALGORITHMS[algorithm]}))


def test_traced_requests_are_refused_under_tensor_parallelism(engines):
    """Logprobs and step events read whole-vocabulary logits, which no rank holds: a clear
    error at the request, and the engine serves on."""
    llm = engines("SDARForCausalLM", 2)
    for params in (SamplingParams(logprobs=1), SamplingParams(denoise_steps=True)):
        with pytest.raises(ValueError, match="not recorded under tensor parallelism"):
            llm.engine.make_request(PROMPTS[0], params)
    assert _tokens(llm, SamplingParams(max_new_tokens=4, ignore_eos=True)) == _tokens(
        engines("SDARForCausalLM", 1), SamplingParams(max_new_tokens=4, ignore_eos=True))


def test_full_logits_never_cross_the_ranks(engines):
    """A sampled, top-k-filtered generation at tp 2: the post-steps' exchanges carry at most
    16 numbers per position, and no collective has a shard of the vocabulary (256 columns)
    in its shape (the forward's all-reduces are ``[tokens, hidden 96]``)."""
    llm = engines("SDARForCausalLM", 2)
    model = llm.engine.model
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    width = head.weight.shape[0]  # this rank's rows of the head: half the vocabulary
    with record_collectives() as log:
        llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True, seed=3,
                                             temperature=0.8, top_k=20, top_p=0.9))
    gathers = [shape for op, shape in log if op == "all_gather"]
    assert gathers and all(shape[-1] <= 16 for shape in gathers)
    assert {op for op, _ in log} == {"all_gather", "all_reduce_sum", "all_reduce_max"}
    assert width == 256 == head.vocab_size // 2
    assert all(width not in shape for _, shape in log)


@pytest.mark.parametrize("algorithm", sorted(BLOCK_ALGORITHMS))
def test_block_diffusion_tp3(engines, algorithm):
    _same(engines, "SDARForCausalLM", 3, SamplingParams(
        max_new_tokens=8, ignore_eos=True, temperature=0.7, seed=3,
        dllm={"algorithm": algorithm, **BLOCK_ALGORITHMS[algorithm]}))


@pytest.mark.parametrize("tp", [2, 3])
def test_llada2_moe(engines, tp):
    _same(engines, "LLaDA2MoeModelLM", tp, SamplingParams(max_new_tokens=8, ignore_eos=True))


@pytest.mark.parametrize(("arch", "tp"), [("LLaDA2MoeModelLM", 2), ("LLaDA2MoeModelLM", 3),
                                        ("SDARMoeForCausalLM", 2)])
def test_expert_parallel(engines, arch, tp):
    """``ep = tp``: each rank holds 6 / tp whole experts; greedy and sampled tokens equal the
    single process's."""
    model = engines(arch, tp, expert_parallel_size=tp).engine.model
    experts = next(m for m in model.modules() if isinstance(m, StackedExperts))
    assert (experts.local_experts, experts.gate_proj.shape[1]) == (6 // tp, 48)
    for temperature in (0.0, 0.9):
        _same(engines, arch, tp, SamplingParams(max_new_tokens=8, ignore_eos=True, seed=4,
                                                temperature=temperature), ep=tp)


@pytest.mark.parametrize("dllm", [
    {"steps": 4, "block_size": 4},
    {"algorithm": "threshold", "threshold": 0.5, "block_size": 4},
    {"steps": 4, "block_size": 4, "cache_mode": "dual"},
    {"steps": 4, "block_size": 4, "cfg_scale": 1.0},
], ids=["static", "threshold", "dual", "cfg"])
def test_full_attention_tp2(engines, dllm):
    _same(engines, "LLaDAModelLM", 2, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                     dllm=dllm))


def test_dream_tp2(engines, tmp_path):
    """Dream (full attention, shifted logits) end to end: the engines above are not kept."""
    engines.release()
    d = str(make_tiny_checkpoint("DreamModel", tmp_path / "dream", seed=1, hidden_size=96,
                                 num_attention_heads=6, num_key_value_heads=6,
                                 intermediate_size=96))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = _tokens(LLM(d, max_running_requests=4, page_size=4), params)
    llm = LLM(d, max_running_requests=4, page_size=4, tensor_parallel_size=2)
    try:
        assert _tokens(llm, params) == want
    finally:
        llm.engine.shutdown()


def test_full_attention_tp3(engines):
    _same(engines, "LLaDAModelLM", 3, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                     dllm={"steps": 4, "block_size": 4}))


# ---- logits -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_logits(rank: int, world: int, port: int, ckpts: dict[str, str], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    ids = list(range(5, 28))  # 23 tokens
    runs = [(arch, 1) for arch in ckpts] + [(arch, world) for arch in MOE]
    for arch, ep in runs:
        set_tensor_parallel(TensorParallel(rank, world, ep=ep))
        model, _, _ = load_model(ckpts[arch])
        with torch.no_grad():
            logits = forward_full(model, ids, MASKS[arch], block_size=4)
        if rank == 0:
            torch.save(logits, Path(out) / f"{arch}-{world}-ep{ep}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_logits(ckpts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("logits")
    for world in (2, 3):
        mp.spawn(_rank_logits, args=(world, _free_port(), ckpts, str(out)), nprocs=world)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("arch", "ep"), [(a, 1) for a in sorted(SHAPES)]
                         + [(a, "world") for a in MOE])
def test_logits_equal_single_process(ckpts, tp_logits, arch, ep, world):
    """Tensor parallel (``ep`` 1) and, for the MoE families, expert parallel (``ep = tp``)."""
    set_tensor_parallel(TensorParallel())
    model, _, _ = load_model(ckpts[arch])
    with torch.no_grad():
        want = forward_full(model, list(range(5, 28)), MASKS[arch], block_size=4)
    got = torch.load(tp_logits / f"{arch}-{world}-ep{world if ep == 'world' else 1}.pt")
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _rank_mixed(rank: int, world: int, port: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    set_tensor_parallel(TensorParallel(rank, world, ep=2))
    model, _, _ = load_model(path)
    experts = next(m for m in model.modules() if isinstance(m, StackedExperts))
    with torch.no_grad():
        logits = forward_full(model, list(range(5, 28)), AttentionMask.BLOCK_CAUSAL, block_size=4)
    if rank == 0:
        torch.save(logits, Path(out) / "logits.pt")
    torch.save((experts.first_expert, experts.local_experts, experts.inter_start,
                experts.gate_proj.shape[1]), Path(out) / f"split-{rank}.pt")
    dist.destroy_process_group()


def test_experts_split_over_sets_and_intermediate(tmp_path):
    """tp 4, ep 2: ranks 0-1 hold experts 0-2, ranks 2-3 experts 3-5, each pair splitting
    their intermediate size (48 → 24 + 24); the logits equal the single process's."""
    path = str(make_tiny_checkpoint(
        "LLaDA2MoeModelLM", tmp_path / "ckpt", seed=2, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, intermediate_size=64, moe_intermediate_size=48,
        num_experts=6, n_group=3, topk_group=2))
    mp.spawn(_rank_mixed, args=(4, _free_port(), path, str(tmp_path)), nprocs=4)
    splits = [torch.load(tmp_path / f"split-{r}.pt") for r in range(4)]
    assert splits == [(0, 3, 0, 24), (0, 3, 24, 24), (3, 3, 0, 24), (3, 3, 24, 24)]
    set_tensor_parallel(TensorParallel())
    model, _, _ = load_model(path)
    with torch.no_grad():
        want = forward_full(model, list(range(5, 28)), AttentionMask.BLOCK_CAUSAL, block_size=4)
    got = torch.load(tmp_path / "logits.pt")
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# ---- a rank that dies ---------------------------------------------------------------------
def test_a_dead_rank_ends_the_engine_and_leaves_no_orphan(ckpts, tmp_path):
    """A worker killed mid-run: rank 0 exits with a one-line error naming the rank within
    seconds. Rank 0 killed: its worker exits by itself."""
    script = textwrap.dedent(f"""
        import sys
        from dllm import LLM, SamplingParams
        llm = LLM({ckpts["Qwen3ForCausalLM"]!r}, tensor_parallel_size=2)
        print(llm.engine.ranks.workers[0].pid, flush=True)
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))
    """)
    for victim in ("worker", "rank0"):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        worker = int(proc.stdout.readline())
        time.sleep(0.5)
        os.kill(worker if victim == "worker" else proc.pid, signal.SIGKILL)
        start = time.monotonic()
        if victim == "worker":
            proc.wait(timeout=10)
            assert proc.returncode == 1
            err = proc.stderr.read().strip().splitlines()
            assert err == ["dllm: tensor-parallel rank 1 exited (code -9); stopping"]
        else:
            proc.wait(timeout=10)
            while _alive(worker) and time.monotonic() - start < 10:
                time.sleep(0.1)
        assert not _alive(worker)
        assert time.monotonic() - start < 10


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


# ---- several hosts, torchrun ----------------------------------------------------------------
def _run_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(body))
    return script


def test_two_nodes_on_one_host(engines, ckpts, tmp_path):
    """``--nnodes 2``: node 1's process hosts rank 1 until rank 0 (node 0) ends; the tokens
    are the single-process ones."""
    path, addr = ckpts["SDARForCausalLM"], f"127.0.0.1:{_free_port()}"
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = _tokens(engines("SDARForCausalLM", 1), params)
    engines.release()  # this process's tensor-parallel engine is the one below
    node1 = subprocess.Popen([sys.executable, str(_run_script(tmp_path, f"""
        from dllm import LLM
        LLM({path!r}, tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr={addr!r})
    """))])
    llm = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    finally:
        llm.engine.shutdown()
    assert node1.wait(timeout=30) == 0


def test_torchrun_starts_the_ranks(engines, ckpts, tmp_path):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = _tokens(engines("SDARForCausalLM", 1), params)
    script = _run_script(tmp_path, f"""
        import json, os
        from dllm import LLM, SamplingParams
        llm = LLM({ckpts["SDARForCausalLM"]!r})
        out = llm.generate({PROMPTS!r}, SamplingParams(max_new_tokens=8, ignore_eos=True))
        print("TOKENS", json.dumps([o.token_ids for o in out]), flush=True)
        llm.engine.shutdown()
    """)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), str(script)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert len(lines) == 1  # rank 0 only
    assert json.loads(lines[0][len("TOKENS "):]) == want
