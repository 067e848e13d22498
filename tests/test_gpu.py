"""GPU tests (marker ``gpu``; skipped without CUDA): FlashInfer equals SDPA for every mode,
the fused layer kernels equal the reference ops, and CUDA-graph engine output equals eager
output token for token (with overlapped scheduling, the CUDA default, against the plain loop,
except where the schedule changes the batches: block diffusion's merged commits)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.models.attention import AttentionLayer
from dllm.runner.attention.sdpa import SDPABackend
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    StepKind,
)
from dllm.runner.memory import ReqToTokenPool, TokenToKVPool
from dllm.testing import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs flashinfer (the 'gpu' extra)"),
]

H, HKV, D, P = 8, 2, 128, 16
LAYER = AttentionLayer(0, H, HKV, D, D**-0.5)


def batch(mode, prefix, ext, seq, mask, block_size, req_pool, kv_pool, backend):
    dev = torch.device("cuda")
    rows = list(range(1, len(prefix) + 1))
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    pos = [p + i for p, n in zip(prefix, ext, strict=True) for i in range(n)]
    tok_rows = [r for r, n in zip(rows, ext, strict=True) for _ in range(n)]
    loc = req_pool.req_to_token[t(tok_rows), t(pos)]
    return ForwardBatch(
        mode=mode, batch_size=len(rows), input_ids=t([0] * len(pos)), positions=t(pos),
        req_pool_indices=t(rows), prefix_lens=t(prefix), extend_lens=t(ext), seq_lens=t(seq),
        out_cache_loc=loc, prefix_lens_cpu=prefix, extend_lens_cpu=ext, seq_lens_cpu=seq,
        attention_mask=mask, block_size=block_size, logits_mode=LogitsMode.ALL,
        req_to_token=req_pool.req_to_token, kv_pool=kv_pool, attn_backend=backend)


CASES = {  # mode, prefix lens, extend lens, seq lens, mask, block size
    "dllm_extend": (ForwardMode.DLLM_EXTEND, [32, 0, 96], [32, 32, 32], [64, 32, 128],
                    AttentionMask.BLOCK_CAUSAL, 32),
    "extend_causal": (ForwardMode.EXTEND, [0, 17, 40], [23, 5, 64], [23, 22, 104],
                      AttentionMask.CAUSAL, 1),
    "extend_block_causal": (ForwardMode.EXTEND, [0, 8, 32], [24, 16, 8], [24, 24, 40],
                            AttentionMask.BLOCK_CAUSAL, 8),
    "extend_full": (ForwardMode.EXTEND, [0, 0], [37, 64], [37, 64], AttentionMask.FULL, 1),
    "dual_cache": (ForwardMode.EXTEND, [16, 32], [8, 8], [64, 48], AttentionMask.FULL, 1),
    "decode": (ForwardMode.DECODE, [10, 63, 200], [1, 1, 1], [11, 64, 201],
               AttentionMask.CAUSAL, 1),
}


@pytest.mark.parametrize("case", [*sorted(CASES), "dllm_extend_packed", "dllm_extend_triton",
                                  "decode_triton"])
def test_flashinfer_equals_sdpa(case):
    from dllm.runner.attention.flashinfer import FlashInferBackend

    # ``dllm_extend`` and ``decode`` run the Triton kernel where Triton is installed; the
    # FlashInfer forms are forced by hiding it. ``dllm_extend_packed``: the decode form a
    # batch that fills the GPU takes (rows × KV heads >= SMs), forced here on three rows by
    # counting one SM.
    packed = case.endswith("_packed")
    use_triton = case.endswith("_triton")
    mode, prefix, ext, seq, mask, bsz = CASES[case.removesuffix("_packed").removesuffix(
        "_triton")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    req_pool = ReqToTokenPool(4, 256, dev)
    kv_pool = TokenToKVPool(64, P, 1, HKV, D, torch.bfloat16, dev)
    for r in range(1, 4):  # scattered pages, as after churn
        pages = kv_pool.alloc_pages(16)[::-1]
        req_pool.req_to_token[r] = kv_pool.slots_for(pages, 0, 256).to(dev)
    # Cached keys of every row (the prefix and, for the dual cache, the suffix).
    for b in range(1, 4):
        slots = req_pool.req_to_token[b]
        kv_pool.set_kv(0, slots, torch.randn(256, HKV, D, device=dev),
                       torch.randn(256, HKV, D, device=dev))
    n = sum(ext)
    q = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16)
    outs = []
    fi = FlashInferBackend(dev, P)
    if use_triton:
        assert fi.triton_extend is not None, "needs triton"
    else:
        fi.triton_extend = None
    if packed:
        fi.num_sms = 1
    for backend in (SDPABackend(), fi):
        fb = batch(mode, prefix, ext, seq, mask, bsz, req_pool, kv_pool, backend)
        backend.prepare(fb)
        outs.append(backend.forward(q, k, v, LAYER, fb).float())
    assert (outs[0] - outs[1]).abs().max().item() < 2e-2
    # the form the case is about ran
    assert fi._planned[1] == (bsz if packed or use_triton else 1)
    assert (fi._planned[0] is None) == use_triton


@pytest.fixture(scope="module")
def sdar_gpu(tmp_path_factory):
    return str(make_tiny_checkpoint("SDARForCausalLM", tmp_path_factory.mktemp("sdar"), seed=0,
                                    hidden_size=256, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=128))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 200, (1 + 3 * i,), generator=g).tolist() for i in range(n)]


# Graph and eager engines run the same schedule (overlapped or not): which commits merge into
# the next block's first step depends on it (under the overlap schedule a block whose resolution
# the host has not read yet commits in a forward of its own, unless its algorithm's fixed
# schedule makes it certain), and a merged commit runs its commit half in another batch than a
# separate commit forward does: in bfloat16 another batch is another rounding (the attention
# kernel's KV splits follow the row count), so the two schedules agree token for token only in
# exact arithmetic (``tests/test_merged_commit.py``, CPU, float32). The graph is what these
# tests are about.


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("algorithm", ["low_confidence_static", "threshold"])
def test_cuda_graph_equals_eager_block_diffusion(sdar_gpu, algorithm, overlap):
    """The default capture sizes (1, 2, 4, ..., 32): 11 live requests replay the graph of 12
    rows, or of 16 with merged commits (two rows each: the commit half and the next block);
    graph replays equal eager steps token for token, merged commits included."""
    from dllm.runner.cuda_graph import CudaGraphRunner

    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=16, algorithm=algorithm, overlap_schedule=overlap,
              algorithm_config={"threshold": 0.5} if algorithm == "threshold" else {})
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.7 * (i % 2),
                             seed=i) for i in range(11)]
    graph = LLM(sdar_gpu, **kw)
    runner = graph.engine.runner.runners[0]
    assert isinstance(runner, CudaGraphRunner) and runner.capture  # in front of the eager one
    assert runner.sizes[-1] == 32  # rows: two a request for a merged commit
    assert graph.engine.merged_commit  # the default on CUDA for an attention-only model
    eager = LLM(sdar_gpu, disable_cuda_graph=True, **kw)
    assert not eager.engine.runner.runners[0].capture  # the same padded batches, no graph
    outs = graph.generate(prompts(11), params)
    counts = graph.engine.runner.forward_counts
    # every denoise step a replay, merged commits included; prompts run eagerly
    assert counts["cuda_graph", StepKind.DENOISE] > 0
    assert {k for k in counts if k[0] == "eager"} == {("eager", StepKind.PREFILL)}
    got = [o.token_ids for o in outs]
    want = [o.token_ids for o in eager.generate(prompts(11), params)]
    assert got == want
    if not overlap or algorithm == "low_confidence_static":  # fixed schedule: merged anyway
        # Every block but the last one commits; fewer commit forwards than that: merged.
        assert sum(o.num_commit_forwards for o in outs) < sum(o.num_blocks - 1 for o in outs)
    graph.engine.check_memory()


def test_merged_commit_batch_replays_a_graph(sdar_gpu):
    """A denoise batch with a merged commit (two whole-block rows of one request) is one the
    graph runner takes: no step of block diffusion falls back to the eager runner."""
    from dllm.runner.cuda_graph import CudaGraphRunner

    llm = LLM(sdar_gpu, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=4, overlap_schedule=False, algorithm="threshold",
              algorithm_config={"threshold": 0.5})
    e = llm.engine
    req = e.make_request(prompts(3)[2], SamplingParams(max_new_tokens=12, ignore_eos=True))
    e.add_request(req)
    while not (req.denoise.block is not None and req.denoise.block.resolved):
        e.step()
    (batch,) = e.scheduler.schedule()
    assert [row.commit_half for row in batch.rows] == [True, False]
    runner = e.runner.runners[0]
    assert isinstance(runner, CudaGraphRunner) and runner.can_run(batch)
    e.abort(req.rid)
    e.check_memory()


def test_rows_above_the_largest_size_run_eagerly_and_say_so(sdar_gpu, caplog):
    """Capped at 2 rows, a step with two requests' merged commits (3 or 4 rows) falls back to
    the eager runner: counted in ``forward_counts`` and logged once; the other denoise steps
    replay."""
    llm = LLM(sdar_gpu, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=2, cuda_graph_max_bs=2, overlap_schedule=False,
              algorithm="low_confidence_static")
    assert llm.engine.runner.runners[0].sizes == [1, 2]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)  # 3 blocks of 4, one a step
    with caplog.at_level("WARNING", logger="dllm.runner.cuda_graph"):
        outs = llm.generate(prompts(2), [params, params])
    assert all(len(o.token_ids) == 12 for o in outs)
    counts = llm.engine.runner.forward_counts
    assert counts["eager", StepKind.DENOISE] > 0 and counts["cuda_graph", StepKind.DENOISE] > 0
    said = [r.getMessage() for r in caplog.records if "above the largest" in r.getMessage()]
    assert len(said) == 1 and "captured size (2 rows) and runs eagerly" in said[0]
    llm.engine.check_memory()


def test_cuda_graph_in_row_passes_equals_eager_and_one_pass(sdar_gpu, monkeypatch):
    """The unmasking step in passes of two rows (``POST_CHUNK_POSITIONS`` = 8 positions of
    block 4) inside the captured graphs: graph replays equal eager steps, and both equal the
    one-pass step, token for token, greedy and sampled rows in one batch."""
    import dllm.denoise

    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=16, algorithm="low_confidence_static",
              overlap_schedule=False, enable_prefix_cache=False)
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.7 * (i % 2),
                             seed=i) for i in range(11)]
    one_pass = [o.token_ids for o in LLM(sdar_gpu, **kw).generate(prompts(11), params)]
    monkeypatch.setattr(dllm.denoise, "POST_CHUNK_POSITIONS", 8)
    graph = [o.token_ids for o in LLM(sdar_gpu, **kw).generate(prompts(11), params)]
    eager = LLM(sdar_gpu, disable_cuda_graph=True, **kw).generate(prompts(11), params)
    assert graph == [o.token_ids for o in eager]
    assert graph == one_pass


def test_graph_captured_on_first_use_equals_eager(sdar_gpu):
    """Requests overriding the engine's algorithm replay a graph captured when their batch
    first arrives (its capture loads and plans a dummy batch into the same buffers, before
    the live batch is loaded).

    Both engines run the overlapped schedule: with it, a request that has just finished
    still rides one more step (5 rows where the plain loop has 4), and here that step takes
    the live rows across the 16-token line between the skinny GEMMs with the fused residual
    steps and cuBLAS, whose roundings differ; a greedy pick near a tie then flips. The graph
    is what this test is about, so the schedule is held equal."""
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=8, algorithm="low_confidence_static")
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, seed=i, temperature=0.5 * i,
                             dllm={"algorithm": "threshold", "threshold": 0.7})
              for i in range(2)]
    graph = LLM(sdar_gpu, **kw)
    before = len(graph.engine.runner.runners[0].graphs)
    got = [o.token_ids for o in graph.generate(prompts(5), params * 2 + params[:1])]
    assert len(graph.engine.runner.runners[0].graphs) > before
    eager = LLM(sdar_gpu, disable_cuda_graph=True, overlap_schedule=True, **kw)
    assert got == [o.token_ids for o in eager.generate(prompts(5), params * 2 + params[:1])]


def test_cuda_graph_equals_eager_wide_steps(sdar_gpu):
    """128 requests of block 4: the denoise steps run 512 rows (and the prompt chunks more),
    ``wide_gemm.MIN_M``, so o_proj and gate/up are the wide GEMMs with the residual step and
    SiLU in their epilogues (the tiny model's 256 hidden and 128 intermediate columns fit
    their tiles; its MLP is narrower than its hidden size, so down takes the residual kernel
    too and q/k/v's norm reads the stream); graph replays equal eager steps token for token. Both run the overlapped
    schedule (the same batches, see above)."""
    from dllm.runner.kernels import wide_gemm

    n, block = 128, 4
    assert n * block >= wide_gemm.MIN_M
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=n, block_size=block, algorithm="low_confidence_static")
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, seed=i,
                             temperature=0.7 * (i % 2)) for i in range(n)]
    graph = LLM(sdar_gpu, **kw)
    got = [o.token_ids for o in graph.generate(prompts(n), params)]
    eager = LLM(sdar_gpu, disable_cuda_graph=True, overlap_schedule=True, **kw)
    assert got == [o.token_ids for o in eager.generate(prompts(n), params)]
    assert all(len(t) == 8 for t in got)
    graph.engine.check_memory()


def test_cuda_graph_equals_eager_grouped_moe(tmp_path, monkeypatch):
    """A tiny LLaDA2-MoE's experts through the static-shape grouped path (the default), so
    its denoise steps are captured; graph replays equal eager steps token for token."""
    monkeypatch.delenv("DLLM_MOE_GROUPED", raising=False)
    path = str(make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path, seed=0, hidden_size=256,
                                    num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=128))
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=8, algorithm="low_confidence_static")
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, seed=i,
                             temperature=0.7 * (i % 2)) for i in range(7)]
    graph = LLM(path, **kw)
    assert graph.engine.model.supports_cuda_graph
    assert len(graph.engine.runner.runners) == 2  # the graph runner is in front
    got = [o.token_ids for o in graph.generate(prompts(7), params)]
    eager = LLM(path, disable_cuda_graph=True, overlap_schedule=True, **kw)
    assert got == [o.token_ids for o in eager.generate(prompts(7), params)]
    graph.engine.check_memory()


@pytest.fixture(scope="module")
def full_gpu(tmp_path_factory) -> dict[str, str]:
    """Tiny LLaDA and Dream with head_dim 128 (the Triton attention's sizes)."""
    return {
        "llada": str(make_tiny_checkpoint(
            "LLaDAModelLM", tmp_path_factory.mktemp("llada"), seed=1, d_model=256, n_heads=2,
            n_kv_heads=2, mlp_hidden_size=512)),
        "dream": str(make_tiny_checkpoint(
            "DreamModel", tmp_path_factory.mktemp("dream"), seed=1, hidden_size=256,
            num_attention_heads=2, num_key_value_heads=1, intermediate_size=512)),
    }


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("mode", ["exact", "prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cuda_graph_equals_eager_full_attention(full_gpu, family, mode, overlap):
    """Full-attention steps in the window form replay CUDA graphs (the dual cache's window
    captured at start, the others on first use) and equal the same padded steps run eagerly
    token for token: every cache mode, greedy and sampled, CFG twins (LLaDA) and Dream's
    block-start steps, under the overlap schedule and the plain loop."""
    from dllm.runner.cuda_graph import CudaGraphRunner

    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=8, overlap_schedule=overlap)
    steps = {"algorithm": "entropy" if family == "dream" else "low_confidence_static",
             "steps": 16, "block_size": 8, "cache_mode": mode}
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, seed=i,
                             temperature=0.7 * (i % 2),
                             dllm={**steps, **({"cfg_scale": 1.0}
                                              if family == "llada" and i == 2 else {})})
              for i in range(5)]
    batch = [prompts(3)[2]] * 5  # one canvas length: the rows stay in step
    graph = LLM(full_gpu[family], **kw)
    runner = graph.engine.runner.runners[0]
    assert isinstance(runner, CudaGraphRunner) and runner.capture
    got = [o.token_ids for o in graph.generate(batch, params)]
    assert runner.last_replayed is not None  # steps ran as graphs
    # at start: LLaDA's default block (32), none for Dream (its block is the canvas); the
    # requests' windows (blocks of 8, canvases, suffixes) were captured on first use
    assert runner.windows == ((32,) if family == "llada" else ())
    assert any(window not in runner.windows for _, window, _ in runner.graphs)
    eager = LLM(full_gpu[family], disable_cuda_graph=True, **kw)
    assert not eager.engine.runner.runners[0].capture
    assert got == [o.token_ids for o in eager.generate(batch, params)]
    assert all(len(t) == 16 for t in got)
    graph.engine.check_memory()


@pytest.mark.parametrize("mode", ["exact", "prefix"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cuda_graph_equals_eager_wide_attention_tile(full_gpu, family, mode, monkeypatch):
    """The attention plan's wide tile (64-row query chunks, one split: the real models' prefix
    windows and whole canvas), made to apply at the tiny models' sizes: graph replays equal
    eager steps token for token."""
    from dllm.runner.kernels import triton_extend as te

    monkeypatch.setattr(te, "WIDE_MIN_PROGRAMS", 1)
    planned = []
    real_plan = te.plan

    def recorded(*args):
        planned.append(real_plan(*args))
        return planned[-1]

    monkeypatch.setattr(te, "plan", recorded)
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=4)
    steps = {"algorithm": "entropy" if family == "dream" else "low_confidence_static",
             "steps": 64, "block_size": 16, "cache_mode": mode}
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True, seed=i,
                             temperature=0.7 * (i % 2), dllm=steps) for i in range(3)]
    batch = [prompts(3)[2]] * 3
    graph = LLM(full_gpu[family], **kw)
    got = [o.token_ids for o in graph.generate(batch, params)]
    assert graph.engine.runner.runners[0].last_replayed is not None
    assert (1, te.WIDE_TILE) in planned  # the wide tile ran (the canvas: 71 tokens)
    if mode == "prefix":  # and the split plan for the windows under 64 query rows
        assert any(p != (1, te.WIDE_TILE) for p in planned)
    planned.clear()
    eager = LLM(full_gpu[family], disable_cuda_graph=True, **kw)
    assert got == [o.token_ids for o in eager.generate(batch, params)]
    assert (1, te.WIDE_TILE) in planned
    graph.engine.check_memory()


@pytest.mark.parametrize("mode", ["exact", "dual"])
def test_cuda_graph_greedy_filtered_dream(full_gpu, mode):
    """An all-greedy Dream batch in which one row sets top-p replays the GREEDY_FILTERED graph
    (Dream filters greedy rows too), equal to the eager steps token for token."""
    from dllm.denoise import GREEDY_FILTERED

    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              max_running_requests=8)
    steps = {"algorithm": "entropy", "steps": 16, "block_size": 8, "cache_mode": mode}
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, seed=i, temperature=0.0,
                             top_p=0.5 if i == 1 else 1.0, dllm=steps) for i in range(3)]
    batch = [prompts(3)[2]] * 3
    graph = LLM(full_gpu["dream"], **kw)
    runner = graph.engine.runner.runners[0]
    got = [o.token_ids for o in graph.generate(batch, params)]
    assert any(key[1] == GREEDY_FILTERED for _, _, key in runner.graphs)
    eager = LLM(full_gpu["dream"], disable_cuda_graph=True, **kw)
    assert got == [o.token_ids for o in eager.generate(batch, params)]
    graph.engine.check_memory()


def test_cuda_graph_equals_eager_decode(tmp_path):
    path = str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, seed=0, hidden_size=256,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=128))
    kw = dict(device="cuda", dtype="bfloat16", max_running_requests=8)  # sizes 1, 2, 4, 8
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got = [o.token_ids for o in LLM(path, **kw).generate(prompts(7), params)]
    want = [o.token_ids for o in LLM(path, disable_cuda_graph=True, overlap_schedule=False,
                                     **kw).generate(prompts(7), params)]
    assert got == want


@pytest.mark.parametrize("layout", ["granite-h-micro", "mamba2"])
def test_cuda_graph_equals_eager_hybrid_decode(tmp_path, layout):
    """Hybrid decode replayed from CUDA graphs (the state slots zero-padded: padding rows
    read and write slot 0) under the overlap schedule equals eager decode of the plain loop
    (issue 20; not yet run on a GPU when written)."""
    from dllm.testing.factory import make_tiny_hybrid_checkpoint

    sizes = ({"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
              "mamba_n_heads": 32}
             if layout.startswith("granite") else {})
    path = str(make_tiny_hybrid_checkpoint(layout, tmp_path, **sizes))
    kw = dict(device="cuda", dtype="bfloat16", max_running_requests=8)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    graph = LLM(path, **kw)
    assert graph.engine.runner.runners[0] is not graph.engine.runner.eager  # graphs captured
    got = [o.token_ids for o in graph.generate(prompts(7), params)]
    want = [o.token_ids for o in LLM(path, disable_cuda_graph=True, overlap_schedule=False,
                                     **kw).generate(prompts(7), params)]
    assert got == want
    graph.engine.check_memory()


@pytest.mark.parametrize("algorithm", ["low_confidence_static", "threshold"])
def test_cuda_graph_equals_eager_hybrid_block_diffusion(tmp_path, algorithm):
    """Block diffusion over a hybrid (the tiny ``GraniteMoeHybridForBlockDiffusion``): the
    denoise steps (``DLLM_EXTEND``: the SSM from the committed slot, writing nothing) and the
    commit forwards replayed from CUDA graphs under the overlap schedule equal eager steps
    of the plain loop token for token (separate commit forwards: the CUDA default over a
    recurrent state, so both schedules run the same batches); no state slot leaks."""
    from dllm.testing.factory import make_tiny_hybrid_checkpoint

    path = str(make_tiny_hybrid_checkpoint(
        "granite-h-bd", tmp_path, hidden_size=256, num_attention_heads=2,
        num_key_value_heads=1, mamba_n_heads=32))
    kw = dict(device="cuda", dtype="bfloat16", max_running_requests=8, algorithm=algorithm,
              algorithm_config={"threshold": 0.5} if algorithm == "threshold" else {})
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.7 * (i % 2),
                             seed=i) for i in range(7)]
    graph = LLM(path, **kw)
    assert graph.engine.model.supports_cuda_graph and not graph.engine.merged_commit
    assert graph.engine.runner.runners[0] is not graph.engine.runner.eager  # graphs captured
    got = [o.token_ids for o in graph.generate(prompts(7), params)]
    eager = LLM(path, disable_cuda_graph=True, overlap_schedule=False, **kw)
    want = [o.token_ids for o in eager.generate(prompts(7), params)]
    assert got == want
    assert all(len(t) == 20 for t in got)
    graph.engine.check_memory()
    eager.engine.check_memory()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                               reason="needs fla-core (the 'gpu' extra)")


@needs_fla
@pytest.mark.parametrize("tokens, groups, heads", [(128, 1, 8), (1000, 2, 8), (4100, 4, 32)])
def test_fla_scan_equals_the_reference_scan(tokens, groups, heads):
    """fla-core's ``chunk_simple_gla`` as Mamba2's scan (``dllm.runner.kernels.ssm_scan``) against the
    float32 reference ``ssd_scan``, from random states, over rows longer than a chunk and not
    a multiple of one: equal within TF32 rounding (fla's dots), outputs and final states."""
    import torch.nn.functional as F

    from dllm.models.mamba2 import ssd_scan
    from dllm.runner.kernels.ssm_scan import fla_available, fla_ssd_scan

    assert fla_available()
    g = torch.Generator("cuda").manual_seed(tokens)
    rows, p, n = 2, 64, 32

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    x, b, c = rand(rows, tokens, heads, p), rand(rows, tokens, groups, n), rand(rows, tokens,
                                                                                 groups, n)
    dt = F.softplus(rand(rows, tokens, heads) - 2.0)  # discretized: positive, mostly small
    a = -torch.exp(rand(heads).clamp(-2, 1))
    d, h0 = rand(heads), rand(rows, heads, p, n)
    y, h = fla_ssd_scan(x, dt, a, b, c, d, h0)
    y_ref, h_ref = ssd_scan(x, dt, a, b, c, d, h0, 256)
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    assert _rel(y, y_ref) < 5e-3 and _rel(h, h_ref) < 5e-3, (_rel(y, y_ref), _rel(h, h_ref))


@needs_fla
def test_fla_scan_serves_long_hybrid_prefills(tmp_path, monkeypatch):
    """The runner installs fla's scan on a hybrid's mixers (float32: the reference ops without
    FlashInfer, which runs half precision only, and fla's scan), each mixer's long
    rows go through it within TF32 rounding of the reference ops, short rows (the captured
    steps) keep the reference bitwise, and greedy generation after a 600-token prompt equals
    the engine with ``DLLM_FLA_SCAN=0``."""
    from dllm.models.mamba2 import Mamba2Mixer
    from dllm.models.ops import TORCH_OPS

    path = str(make_tiny_hybrid_checkpoint_gpu(tmp_path))
    kw = dict(device="cuda", dtype="float32", max_running_requests=4)
    llm = LLM(path, **kw)
    mixers = [m for m in llm.engine.model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(m.ops.fla_scan for m in mixers)
    m = mixers[0]
    d = m.dims
    g = torch.Generator("cuda").manual_seed(0)
    conv = torch.randn(1, d.conv_dim, d.conv_kernel - 1, device="cuda", generator=g)
    ssm = torch.randn(1, d.num_heads, d.head_dim, d.d_state, device="cuda", generator=g)
    ops = m.ops
    for n, exact in ((600, False), (16, True)):
        hidden = torch.randn(n, d.hidden_size, device="cuda", generator=g)
        with torch.no_grad():
            got = m(hidden, conv, ssm, [n])
            m.ops = TORCH_OPS
            want = m(hidden, conv, ssm, [n])
            m.ops = ops
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y) if exact else _rel(x, y) < 5e-3
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    long_prompts = [[(7 * i + j) % 200 + 3 for j in range(600)] for i in range(2)]
    got = [o.token_ids for o in llm.generate(long_prompts, params)]
    monkeypatch.setenv("DLLM_FLA_SCAN", "0")
    ref = LLM(path, **kw)
    assert not any(mm.ops.fla_scan for mm in ref.engine.model.modules()
                   if isinstance(mm, Mamba2Mixer))
    assert got == [o.token_ids for o in ref.generate(long_prompts, params)]


def make_tiny_hybrid_checkpoint_gpu(tmp_path):
    from dllm.testing.factory import make_tiny_hybrid_checkpoint

    return make_tiny_hybrid_checkpoint("granite-h-micro", tmp_path, hidden_size=256,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       mamba_n_heads=32)


def test_float32_on_cuda_runs_without_flashinfer(tmp_path):
    """FlashInfer's kernels are half precision only: ``auto`` takes SDPA for float32 weights
    (and generates), asking for FlashInfer then is a clear error."""
    path = str(make_tiny_checkpoint("SDARForCausalLM", tmp_path, seed=0))
    llm = LLM(path, device="cuda", dtype="float32", max_running_requests=2)
    assert llm.engine.runner.backend.name == "sdpa"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    with pytest.raises(ValueError, match="float16 and bfloat16 only, not float32"):
        LLM(path, device="cuda", dtype="float32", attention_backend="flashinfer")


@pytest.mark.parametrize("rotary_factor", [1.0, 0.5])
def test_flashinfer_layer_ops_match_reference(rotary_factor):
    """Each fused kernel against the float32 reference on upcast inputs, next to the bf16
    reference path: both within bf16 rounding (METHOD: ‖out − ref‖/‖ref‖ < 1e-2)."""
    from dllm.models.config import ModelConfig
    from dllm.models.layers import RopeSpec, RotaryEmbedding
    from dllm.models.ops import TORCH_OPS
    from dllm.runner.layer_ops import FlashInferOps

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    t, hid, h, hkv, d = 37, 1024, 8, 2, 128
    rope = RotaryEmbedding(RopeSpec.from_config(
        ModelConfig({"partial_rotary_factor": rotary_factor, "rope_theta": 1e6}), d)).to(dev)
    ops = FlashInferOps(torch.nn.ModuleList([rope]), 4096, dev)

    def check(fast, ref32, ref16):
        assert torch.isfinite(fast.float()).all()
        assert _rel(fast, ref32) < 1e-2 and _rel(ref16, ref32) < 1e-2

    x = torch.randn(t, hid, generator=g, **bf)
    res = torch.randn(t, hid, generator=g, **bf)
    w = (1 + 0.1 * torch.randn(hid, generator=g, **bf))
    check(ops.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x.float(), w.float(), 1e-6),
          TORCH_OPS.rms_norm(x, w, 1e-6))
    ref_n, ref_r = TORCH_OPS.add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
    n, r = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    check(n, ref_n, TORCH_OPS.add_rms_norm(x, res, w, 1e-6)[0])
    check(r, ref_r, x + res)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g, **bf)  # strided q/k slices
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    wd = (1 + 0.1 * torch.randn(d, generator=g, **bf))
    check(ops.head_rms_norm(q, wd, 1e-6), TORCH_OPS.head_rms_norm(q.float(), wd.float(), 1e-6),
          TORCH_OPS.head_rms_norm(q, wd, 1e-6))
    gu = torch.randn(t, 2 * 3072, generator=g, **bf)
    check(ops.silu_and_mul(gu), TORCH_OPS.silu_and_mul(gu.float()), TORCH_OPS.silu_and_mul(gu))
    pos = torch.randint(0, 4096, (t,), generator=g, device=dev)
    fq, fk = ops.rope(rope, pos, q, k, None)
    rq, rk = TORCH_OPS.rope(rope, pos, q.float(), k.float(), None)
    bq, bk = TORCH_OPS.rope(rope, pos, q, k, None)
    check(fq, rq, bq)
    check(fk, rk, bk)
    if rotary_factor < 1:  # channels past rotary_dim pass through unchanged
        rot = int(d * rotary_factor)
        assert torch.equal(fq.view(t, h, d)[..., rot:], q[..., rot:])


def test_triton_ops_match_the_reference_ops():
    """``TritonOps``: the layer's q/k norms + RoPE + KV-cache write in one launch, and the
    skinny GEMM for at most 16 tokens, against the plain-PyTorch ops."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from dllm.models.config import ModelConfig
    from dllm.models.decoder import AttentionSpec, SelfAttention
    from dllm.models.layers import RopeSpec
    from dllm.models.ops import TORCH_OPS
    from dllm.runner.layer_ops import TritonOps

    dev = torch.device("cuda")
    torch.manual_seed(0)
    spec = AttentionSpec(hidden_size=1024, num_heads=H, num_kv_heads=HKV, head_dim=D,
                         rope=RopeSpec.from_config(ModelConfig({"rope_theta": 1e6}), D),
                         qk_norm=True)
    attn = SelfAttention(spec, 0)
    for w in (attn.q_norm.weight, attn.k_norm.weight):
        torch.nn.init.normal_(w, 1.0, 0.1)
    attn.to(dev, torch.bfloat16)
    ops = TritonOps(attn, 4096, dev)
    req_pool = ReqToTokenPool(4, 256, dev)
    kv_pool = TokenToKVPool(64, P, 1, HKV, D, torch.bfloat16, dev)
    for r in range(1, 4):
        req_pool.req_to_token[r] = kv_pool.slots_for(kv_pool.alloc_pages(16)[::-1], 0,
                                                     256).to(dev)
    mode, prefix, ext, seq, mask, bsz = CASES["dllm_extend"]
    fb = batch(mode, prefix, ext, seq, mask, bsz, req_pool, kv_pool, SDPABackend())
    x = torch.randn(sum(ext), 1024, device=dev, dtype=torch.bfloat16)
    for m in (1, 4, 16):  # the skinny GEMM; more rows take cuBLAS
        want = F.linear(x[:m].double(), attn.qkv_proj.weight.double())
        assert _rel(ops.linear(x[:m], attn.qkv_proj), want) < 1e-2
    qkv = ops.linear(x, attn.qkv_proj)
    q, k, v = ops.qkv_rope(attn, qkv, fb.positions, fb)
    assert k is None and v is None  # written to the cache by the same launch
    rq, rk, rv = TORCH_OPS.qkv_rope(attn, qkv, fb.positions, fb)
    assert _rel(q, rq) < 1e-2
    k_buf, v_buf = kv_pool.get_kv(0)
    assert _rel(k_buf[fb.out_cache_loc], rk) < 1e-2
    assert torch.equal(v_buf[fb.out_cache_loc], rv)


def test_triton_ops_fused_residual_steps_match_the_reference_ops():
    """``TritonOps`` with the residual steps in the skinny GEMMs: an output projection that
    adds the residual and half-normalises for the next norm (``linear_residual`` →
    ``PreNormed``), a SwiGLU MLP that finishes the norm in its gate/up GEMM with SiLU in the
    epilogue, and a q/k/v-like projection, against the float32 reference ops, at 1-16 rows
    (fused in the skinny GEMM), 37 rows (reference path) and 512 rows (fused in the wide
    GEMMs); and a ``PreNormed`` handed to another norm falls back to the reference norm of
    its stream."""
    pytest.importorskip("triton")
    from dllm.models.layers import RMSNorm, SwiGLUMLP
    from dllm.models.ops import install_ops
    from dllm.runner.fused_layer import PreNormed, ResidualFusion
    from dllm.runner.kernels import wide_gemm
    from dllm.runner.layer_ops import TritonOps

    dev = torch.device("cuda")
    torch.manual_seed(0)
    hid, inter, eps = 1024, 2816, 1e-6
    block = torch.nn.ModuleDict(dict(o=torch.nn.Linear(hid, hid, bias=False),
                                     qkv=torch.nn.Linear(hid, 1536, bias=True),
                                     mlp=SwiGLUMLP(hid, inter), norm=RMSNorm(hid, eps),
                                     other=RMSNorm(hid, eps)))
    for norm in (block.norm, block.other):
        torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    block.to(dev, torch.bfloat16)
    ref = copy.deepcopy(block).float()  # the float32 reference on upcast weights
    install_ops(block, TritonOps(block, 4096, dev))
    install_ops(ref, ResidualFusion())

    def run(b, x, res):
        o = b.mlp.ops

        def step(weight):  # fresh each time: the unfused add + norm works in place
            return o.linear_residual(x, b.o, res.clone(), weight, eps)

        first = step(b.norm.weight)
        act, stream = o.norm_gate_up(*first, b.norm.weight, eps, b.mlp.gate_up_proj)
        out = o.linear(act, b.mlp.down_proj)
        qkv, stream2 = o.norm_linear(*step(b.norm.weight), b.norm.weight, eps, b.qkv)
        # built for b.norm, consumed by b.other: the reference norm of the stream
        other, _ = o.norm_linear(*step(b.norm.weight), b.other.weight, eps, b.qkv)
        return first, out, stream, qkv, stream2, other

    assert wide_gemm.MIN_M <= 512
    for m in (1, 4, 16, 37, 512):
        x = torch.randn(m, hid, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, hid, device=dev, dtype=torch.bfloat16)
        pending, out, stream, qkv, stream2, other = run(block, x, res)
        _, r_out, r_stream, r_qkv, _, r_other = run(ref, x.float(), res.float())
        assert isinstance(pending[0], PreNormed) == (m != 37)
        assert torch.equal(stream, stream2)
        for got, want in ((out, r_out), (stream, r_stream), (qkv, r_qkv), (other, r_other)):
            assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2


@pytest.mark.parametrize("fuse_residual", [True, False])
def test_triton_ops_dream_mlp_at_32_and_64_rows(fuse_residual):
    """Dream-7B's o_proj and MLP at 16, 32 and 64 rows through ``TritonOps``, against the
    float32 reference ops. The gate/up GEMM takes SiLU-and-mul in its epilogue at 17-32 rows
    (``SILU_ROWS32``; at 64 rows a separate kernel follows) whether the norm before it rode
    the o_proj's epilogue (a ``PreNormed``, where the skinny GEMM takes o_proj) or ran as a
    kernel of its own (the residual fusion off)."""
    pytest.importorskip("triton")
    from dllm.models.layers import RMSNorm, SwiGLUMLP
    from dllm.models.ops import install_ops
    from dllm.runner.fused_layer import PreNormed, ResidualFusion
    from dllm.runner.kernels import skinny_gemm
    from dllm.runner.layer_ops import TritonOps

    dev = torch.device("cuda")
    torch.manual_seed(0)
    hid, inter, eps = 3584, 18944, 1e-6
    assert skinny_gemm.silu_fused(2 * inter, hid, dev, 32)
    assert not skinny_gemm.silu_fused(2 * inter, hid, dev, 64)  # a SiLU kernel of its own
    assert not skinny_gemm.silu_fused(2 * inter, hid, dev, 16)
    block = torch.nn.ModuleDict(dict(o=torch.nn.Linear(hid, hid, bias=False),
                                     mlp=SwiGLUMLP(hid, inter), norm=RMSNorm(hid, eps)))
    torch.nn.init.normal_(block.norm.weight, 1.0, 0.2)
    block.to(dev, torch.bfloat16)
    ref = copy.deepcopy(block).float()
    ops = TritonOps(block, 4096, dev)
    ops.fuse_residual = fuse_residual
    install_ops(block, ops)
    install_ops(ref, ResidualFusion())

    def run(b, x, res):
        o = b.mlp.ops
        first = o.linear_residual(x, b.o, res.clone(), b.norm.weight, eps)
        act, stream = o.norm_gate_up(*first, b.norm.weight, eps, b.mlp.gate_up_proj)
        return first, act, stream

    for m in (16, 32, 64):
        x = torch.randn(m, hid, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, hid, device=dev, dtype=torch.bfloat16)
        first, act, stream = run(block, x, res)
        _, r_act, r_stream = run(ref, x.float(), res.float())
        tile = skinny_gemm._block_m(m)
        o_skinny = m <= 16 or (hid, hid) in skinny_gemm.ROW_TILES[tile][0][(9, 0)]
        assert isinstance(first[0], PreNormed) == (fuse_residual and o_skinny)
        for got, want in ((act, r_act), (stream, r_stream)):
            assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2


def test_programmatic_dependent_launch_changes_no_bits():
    """The skinny GEMM and the fused q/k/v kernel launched with programmatic dependent launch
    (each may start before its predecessor ends; the GEMM prefetches weights meanwhile), in
    a chain where each reads the previous one's output, eagerly and in a CUDA graph: the same
    bits as plain launches."""
    pytest.importorskip("triton")
    from dllm.runner.kernels import fused_qkv, skinny_gemm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    hid, h, hkv, d = 1024, 8, 2, 128
    w1 = torch.randn(hid, hid, generator=g, **bf) / 32
    wqkv = torch.randn((h + 2 * hkv) * d, hid, generator=g, **bf) / 32
    wo = torch.randn(hid, h * d, generator=g, **bf) / 32
    table = torch.randn(64, d, generator=g, device=dev)
    qn, kn = (1 + 0.1 * torch.randn(d, generator=g, **bf) for _ in range(2))
    x = torch.randn(4, hid, generator=g, **bf)
    pos = torch.tensor([3, 4, 5, 6], device=dev)
    loc = torch.tensor([17, 18, 19, 40], device=dev)

    def chain(pdl: bool, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # a residual step split over two GEMMs: the first adds x and writes the partial sums
        # the second reads
        stream, scaled, sum_sq = skinny_gemm.skinny_linear_residual(
            x, w1, None, x, qn.repeat(hid // d), pdl=pdl)
        qkv = skinny_gemm.skinny_linear(scaled, wqkv, sum_sq=sum_sq, eps=1e-6, pdl=pdl)
        q = fused_qkv.qk_norm_rope_store(qkv, h, hkv, d, qn, kn, 1e-6, table, pos, *kv, loc,
                                         pdl=pdl)
        return skinny_gemm.skinny_linear(q.view(4, h * d), wo, pdl=pdl) + stream

    def cache():
        return tuple(torch.zeros(64, hkv, d, **bf) for _ in range(2))

    plain_kv, pdl_kv, graph_kv = cache(), cache(), cache()
    want = chain(False, plain_kv)
    assert torch.equal(chain(True, pdl_kv), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(True, graph_kv)
    for kv in graph_kv:
        kv.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    for a, b in zip(plain_kv, graph_kv, strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(plain_kv, pdl_kv, strict=True))


@pytest.mark.parametrize("kind", ["sdar", "granite-h-bd"])
def test_prefix_cache_with_cuda_graphs_equals_no_cache(tmp_path, kind):
    """Issue 21 on the GPU (not yet run on one when written): CUDA graphs and the overlap
    schedule with the prefix cache (the hybrid's commit forwards write their track slot
    inside the captured denoise graph) give the tokens of the same engine without the
    cache, for prompts sharing a 2-chunk prefix that arrive after it is cached."""
    from dllm.testing.factory import make_tiny_hybrid_checkpoint

    if kind == "sdar":
        path = str(make_tiny_checkpoint("SDARForCausalLM", tmp_path, seed=0, hidden_size=256,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=128))
    else:
        path = str(make_tiny_hybrid_checkpoint(kind, tmp_path, hidden_size=256,
                                               num_attention_heads=2, num_key_value_heads=1,
                                               mamba_n_heads=32))
    kw = dict(device="cuda", dtype="bfloat16", max_running_requests=8, page_size=16,
              state_track_interval=16)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(10, 200, (33,), generator=g).tolist()
    ps = [shared + torch.randint(10, 200, (k,), generator=g).tolist() for k in (0, 3, 8, 17)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    on, off = LLM(path, **kw), LLM(path, enable_prefix_cache=False, **kw)
    assert on.engine.runner.runners[0] is not on.engine.runner.eager  # graphs captured
    got = [o.token_ids for o in on.generate(ps[:1], params)]
    outs = on.generate(ps[1:], params)
    got += [o.token_ids for o in outs]
    assert all(o.cached_tokens == 32 for o in outs)
    want = [o.token_ids for o in off.generate(ps[:1], params) + off.generate(ps[1:], params)]
    assert got == want
    on.engine.check_memory()
