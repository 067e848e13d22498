"""GPU tests of the Triton paged attention for ``DLLM_EXTEND`` and ``DECODE``
(runner/kernels/triton_extend.py) against the SDPA backend: every output element written,
padding rows zero, runs deterministic, a row's bits independent of its batch, and the launch
captured in a CUDA graph equal to the eager launch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dllm.models.attention import AttentionLayer
from dllm.runner.attention.sdpa import SDPABackend
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode, LogitsMode
from dllm.runner.memory import ReqToTokenPool, TokenToKVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                       reason="needs a CUDA device and triton"),
]

P = 16  # page size
CONTEXT = 512  # req_to_token width


def make_pools(num_rows: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """Request rows 1..num_rows over scattered pages (as after churn), every slot of the pool
    holding random K/V; row 0 is the padding row (page 0)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    pages_per_row = CONTEXT // P
    req_pool = ReqToTokenPool(num_rows, CONTEXT, dev)
    kv_pool = TokenToKVPool(num_rows * pages_per_row + 1, P, 1, hkv, d, dtype, dev)
    pages = (torch.randperm(num_rows * pages_per_row, generator=g) + 1).tolist()
    for r in range(1, num_rows + 1):
        mine = pages[(r - 1) * pages_per_row : r * pages_per_row]
        req_pool.req_to_token[r] = kv_pool.slots_for(mine, 0, CONTEXT).to(dev)
    k_buf, v_buf = kv_pool.get_kv(0)
    k_buf.copy_(torch.randn(k_buf.shape, generator=g).to(dtype))
    v_buf.copy_(torch.randn(v_buf.shape, generator=g).to(dtype))
    return req_pool, kv_pool


def sdpa_reference(q, mode, seq_lens, block, req_rows, req_pool, kv_pool, layer):
    """The SDPA backend on the same batch (rows with seq_len 0 left out): every query of a
    row sees keys [0, seq_len), i.e. the FULL mask (DLLM_EXTEND) or CAUSAL at the last
    position (DECODE). The block's own K/V are rewritten with the values already cached."""
    dev = q.device
    live = [i for i, s in enumerate(seq_lens) if s > 0]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    seq = [seq_lens[i] for i in live]
    rows = [req_rows[i] for i in live]
    prefix = [s - block for s in seq]
    pos = [p + j for p in prefix for j in range(block)]
    tok_rows = [r for r in rows for _ in range(block)]
    loc = req_pool.req_to_token[t(tok_rows), t(pos)]
    k_buf, v_buf = kv_pool.get_kv(0)
    fb = ForwardBatch(
        mode=mode, batch_size=len(rows), input_ids=t([0] * len(pos)), positions=t(pos),
        req_pool_indices=t(rows), prefix_lens=t(prefix), extend_lens=t([block] * len(rows)),
        seq_lens=t(seq), out_cache_loc=loc, prefix_lens_cpu=prefix,
        extend_lens_cpu=[block] * len(rows), seq_lens_cpu=seq,
        attention_mask=AttentionMask.FULL if block > 1 else AttentionMask.CAUSAL,
        block_size=block, logits_mode=LogitsMode.ALL, req_to_token=req_pool.req_to_token,
        kv_pool=kv_pool)
    q_live = torch.cat([q[i * block : (i + 1) * block] for i in live])
    out = SDPABackend().forward(q_live, k_buf[loc].clone(), v_buf[loc].clone(), layer, fb)
    return live, out


# block size, query heads, KV heads, head dim, seq_lens (0: a padding row), dtype
CASES = {
    "sdar_b4_g4": (4, 32, 8, 128, [4, 37, 0, 333, 130], torch.bfloat16),
    "b4_g1": (4, 8, 8, 128, [4, 61, 200], torch.bfloat16),
    "llada2_b32_g4": (32, 16, 4, 128, [32, 45, 0, 300], torch.bfloat16),
    "b32_g1": (32, 4, 4, 128, [32, 77, 161], torch.bfloat16),
    "b32_g8_two_m_tiles": (32, 32, 4, 128, [32, 99], torch.bfloat16),
    "b4_g4_d64_fp16": (4, 16, 4, 64, [4, 21, 260], torch.float16),
    "b4_g4_d256": (4, 16, 4, 256, [4, 50, 129], torch.bfloat16),
    # a Dream-shaped prefix window: 672 query rows a KV head (10.5 tiles of 64)
    "window_b96_g7": (96, 28, 4, 128, [96, 0, 384, 200], torch.bfloat16),
}


def run_case(name, seed=0):
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    block, h, hkv, d, seq_lens, dtype = CASES[name]
    dev = torch.device("cuda")
    rows = len(seq_lens)
    req_pool, kv_pool = make_pools(rows, hkv, d, dtype, seed)
    # Rows in shuffled table order; padding rows point at the padding row 0.
    order = (torch.randperm(rows, generator=torch.Generator().manual_seed(seed + 1)) + 1).tolist()
    req_rows = [r if s > 0 else 0 for r, s in zip(order, seq_lens, strict=True)]
    g = torch.Generator(device=dev).manual_seed(seed + 2)
    q = torch.randn(rows * block, h, d, generator=g, device=dev).to(dtype)
    args = (kv_pool.get_kv(0)[0], kv_pool.get_kv(0)[1], req_pool.req_to_token,
            torch.tensor(req_rows, dtype=torch.int64, device=dev),
            torch.tensor(seq_lens, dtype=torch.int64, device=dev), block, d**-0.5)
    out = torch.full_like(q, float("nan"))
    dllm_extend_attention(q, *args, out=out)
    return q, args, out, req_rows, req_pool, kv_pool


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_extend_equals_sdpa(name):
    block, h, hkv, d, seq_lens, _ = CASES[name]
    q, args, out, req_rows, req_pool, kv_pool = run_case(name)
    assert not out.isnan().any()  # every element written
    layer = AttentionLayer(0, h, hkv, d, d**-0.5)
    live, ref = sdpa_reference(q, ForwardMode.DLLM_EXTEND, seq_lens, block, req_rows,
                               req_pool, kv_pool, layer)
    got = torch.cat([out[i * block : (i + 1) * block] for i in live])
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    for i, s in enumerate(seq_lens):  # padding rows: zeros
        if s == 0:
            assert (out[i * block : (i + 1) * block] == 0).all()


def assert_deterministic_and_row_independent(q, args, out, config=None):
    """``out`` (a launch with ``config``) again bit for bit, and each row alone too."""
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    again = torch.full_like(q, float("nan"))
    dllm_extend_attention(q, *args, out=again, config=config)
    assert torch.equal(out, again)
    k_buf, v_buf, table, req_rows, seq_lens, block, scale = args
    for i in range(req_rows.shape[0]):  # each row alone: the same bits
        sl = slice(i * block, (i + 1) * block)
        alone = dllm_extend_attention(q[sl], k_buf, v_buf, table, req_rows[i : i + 1],
                                      seq_lens[i : i + 1], block, scale, config=config)
        assert torch.equal(alone, out[sl])


@pytest.mark.parametrize("name", ["sdar_b4_g4", "llada2_b32_g4"])
def test_triton_extend_deterministic_and_row_independent(name):
    q, args, out, *_ = run_case(name)
    assert_deterministic_and_row_independent(q, args, out)


def test_triton_extend_strided_q():
    """q as a slice of a fused qkv projection (row stride > H·D) gives the same bits."""
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    block, h, hkv, d, *_ = CASES["sdar_b4_g4"]
    q, args, out, *_ = run_case("sdar_b4_g4")
    qkv = torch.randn(q.shape[0], (h + 2 * hkv) * d, device=q.device, dtype=q.dtype)
    qkv[:, : h * d] = q.reshape(q.shape[0], -1)
    strided = qkv[:, : h * d].view(q.shape[0], h, d)
    assert torch.equal(dllm_extend_attention(strided, *args), out)


def test_triton_extend_cuda_graph():
    """Captured once, replayed after the batch's lengths, rows and queries changed in place:
    equal to an eager launch on the new values."""
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    q, args, out, *_ = run_case("sdar_b4_g4")
    k_buf, v_buf, table, req_rows, seq_lens, block, scale = args
    static_out = torch.empty_like(q)
    dllm_extend_attention(q, *args, out=static_out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dllm_extend_attention(q, *args, out=static_out)
    q.copy_(torch.randn_like(q))
    seq_lens.copy_(torch.tensor([8, 0, 300, 41, 4], device=q.device))
    req_rows.copy_(torch.tensor([3, 0, 1, 5, 2], device=q.device))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, dllm_extend_attention(q, *args))


def test_decode_attention_equals_sdpa():
    from dllm.runner.kernels.triton_extend import decode_attention

    h, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    seq_lens = [1, 17, 0, 300, 64]
    rows = len(seq_lens)
    dev = torch.device("cuda")
    req_pool, kv_pool = make_pools(rows, hkv, d, dtype, seed=3)
    req_rows = [r + 1 if s > 0 else 0 for r, s in enumerate(seq_lens)]
    q = torch.randn(rows, h, d, device=dev).to(dtype)
    out = torch.full_like(q, float("nan"))
    k_buf, v_buf = kv_pool.get_kv(0)
    decode_attention(q, k_buf, v_buf, req_pool.req_to_token,
                     torch.tensor(req_rows, device=dev), torch.tensor(seq_lens, device=dev),
                     d**-0.5, out=out)
    assert not out.isnan().any()
    assert (out[2] == 0).all()
    live, ref = sdpa_reference(q, ForwardMode.DECODE, seq_lens, 1, req_rows, req_pool,
                               kv_pool, AttentionLayer(0, h, hkv, d, d**-0.5))
    assert (out[live].float() - ref.float()).abs().max().item() < 2e-2


def test_supports():
    from dllm.runner.kernels.triton_extend import supports

    cuda = torch.device("cuda")
    assert supports(torch.bfloat16, torch.bfloat16, 32, 8, 128, cuda)
    assert not supports(torch.float32, torch.float32, 32, 8, 128, cuda)
    assert not supports(torch.bfloat16, torch.bfloat16, 32, 8, 96, cuda)
    assert not supports(torch.bfloat16, torch.bfloat16, 30, 8, 128, cuda)
    assert not supports(torch.bfloat16, torch.bfloat16, 32, 8, 128, torch.device("cpu"))


@pytest.mark.parametrize("config", [dict(PREFETCH=1), dict(PREFETCH=2, num_stages=1, BLOCK_N=32),
                                    dict(KV_FIRST=True), dict(BLOCK_N=128, num_warps=8)],
                         ids=["prefetch1", "prefetch2", "kv_first", "n128"])
@pytest.mark.parametrize("name", ["sdar_b4_g4", "llada2_b32_g4"])
def test_triton_extend_configs(name, config):
    """The tile variants the benchmark sweeps compute the same function."""
    from dllm.runner.kernels.triton_extend import dllm_extend_attention, reference

    q, args, out, *_ = run_case(name)
    ref = reference(q, *args)
    got = torch.full_like(q, float("nan"))
    dllm_extend_attention(q, *args, out=got, config=config)
    assert not got.isnan().any()
    assert (got.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("name", ["llada2_b32_g4", "b32_g8_two_m_tiles", "window_b96_g7"])
def test_triton_extend_wide_tile(name):
    """The launch plan's wide tile (64-row chunks, one split) computes the same function,
    deterministic and row-independent."""
    from dllm.runner.kernels.triton_extend import WIDE_TILE, dllm_extend_attention, reference

    q, args, *_ = run_case(name)
    got = torch.full_like(q, float("nan"))
    dllm_extend_attention(q, *args, out=got, config=WIDE_TILE)
    assert not got.isnan().any()
    assert (got.float() - reference(q, *args)).abs().max().item() < 2e-2
    assert_deterministic_and_row_independent(q, args, got, WIDE_TILE)


# --- Split-KV (num_splits > 1) -------------------------------------------------------------
# Inputs built without the pools (plain tensors on DEVICE), so the same tests also run on the
# CPU under TRITON_INTERPRET=1 (float32/float16) when called directly; pytest skips this file
# without CUDA.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# block size, query heads, KV heads, head dim, seq_lens (0: a padding row; == B; lengths not a
# multiple of 16; 16 splits > the key chunks of every row)
SPLIT_CASES = {
    "sdar_b4_g4": (4, 32, 8, 128, [4, 37, 0, 333, 130, 250]),
    "llada2_b32_g4": (32, 16, 4, 128, [32, 45, 0, 300]),
    "b32_g8_two_m_tiles": (32, 32, 4, 128, [32, 99, 0]),
    "b4_g4_d64": (4, 16, 4, 64, [4, 21, 260, 0, 7]),
    "b4_g4_d256": (4, 16, 4, 256, [4, 50, 129]),
    "decode_b1_g4": (1, 16, 4, 128, [1, 17, 0, 300, 64]),
    "dream_b32_g7": (32, 28, 4, 128, [32, 250, 0, 384]),  # 224 query rows a KV head
}
SPLIT_CONTEXT = 384  # req_to_token width (all seq_lens fit)


def split_inputs(name, dtype, seed=0, device=DEVICE):
    """Random K/V over scattered slots, rows in shuffled table order, padding rows on row 0.
    Returns (q, args) with args as dllm_extend_attention takes them after q."""
    block, h, hkv, d, seq_lens = SPLIT_CASES[name]
    rows = len(seq_lens)
    g = torch.Generator().manual_seed(seed)
    num_slots = (rows + 1) * SPLIT_CONTEXT + 5
    table = torch.randperm(num_slots, generator=g)[: (rows + 1) * SPLIT_CONTEXT]
    table = table.view(rows + 1, SPLIT_CONTEXT).to(torch.int64)
    order = (torch.randperm(rows, generator=g) + 1).tolist()
    req_rows = [r if s > 0 else 0 for r, s in zip(order, seq_lens, strict=True)]
    k_buf = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(rows * block, h, d, generator=g).to(dtype)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return q.to(device), (k_buf.to(device), v_buf.to(device), table.to(device), t(req_rows),
                          t(seq_lens), block, d**-0.5)


def _dtype(name):
    return getattr(torch, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_splits", [2, 3, 8, 16])
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_triton_extend_split_equals_reference(name, num_splits, dtype):
    from dllm.runner.kernels.triton_extend import dllm_extend_attention, reference

    q, args = split_inputs(name, _dtype(dtype))
    block, seq_lens = args[5], args[4].tolist()
    out = torch.full_like(q, float("nan"))
    assert dllm_extend_attention(q, *args, out=out, num_splits=num_splits) is out
    assert not out.isnan().any()  # every element written
    assert (out.float() - reference(q, *args)).abs().max().item() < 2e-2
    for i, s in enumerate(seq_lens):  # padding rows: zeros
        if s == 0:
            assert (out[i * block : (i + 1) * block] == 0).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_splits", [3, 16])
@pytest.mark.parametrize("name", ["sdar_b4_g4", "llada2_b32_g4", "decode_b1_g4"])
def test_triton_extend_split_deterministic_and_row_independent(name, num_splits, dtype):
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    q, args = split_inputs(name, _dtype(dtype))
    k_buf, v_buf, table, req_rows, seq_lens, block, scale = args
    out = dllm_extend_attention(q, *args, num_splits=num_splits)
    for _ in range(2):
        again = torch.full_like(q, float("nan"))
        dllm_extend_attention(q, *args, out=again, num_splits=num_splits)
        assert torch.equal(out, again)
    for i in range(req_rows.shape[0]):  # each row alone, same num_splits: the same bits
        sl = slice(i * block, (i + 1) * block)
        alone = dllm_extend_attention(q[sl], k_buf, v_buf, table, req_rows[i : i + 1],
                                      seq_lens[i : i + 1], block, scale,
                                      num_splits=num_splits)
        assert torch.equal(alone, out[sl])


@pytest.mark.parametrize("name", ["sdar_b4_g4", "llada2_b32_g4"])
def test_triton_extend_one_split_is_default(name):
    """num_splits=1 is the single launch: the default call's bits."""
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    q, args = split_inputs(name, torch.float16)
    assert torch.equal(dllm_extend_attention(q, *args, num_splits=1),
                       dllm_extend_attention(q, *args))
    with pytest.raises(ValueError):
        dllm_extend_attention(q, *args, num_splits=0)


@pytest.mark.parametrize("config", [dict(PREFETCH=1), dict(PREFETCH=2, num_stages=1, BLOCK_N=32),
                                    dict(KV_FIRST=True), dict(BLOCK_N=128, num_warps=8),
                                    "small_grid"],
                         ids=["prefetch1", "prefetch2", "kv_first", "n128", "small_grid"])
@pytest.mark.parametrize("name", ["sdar_b4_g4", "llada2_b32_g4", "dream_b32_g7"])
def test_triton_extend_split_configs(name, config, dtype="float16"):
    """The tile variants (their next-chunk prefetch strides by the split count) with splits,
    the small-grid tile of the launch plan among them."""
    from dllm.runner.kernels.triton_extend import SMALL_GRID, dllm_extend_attention, reference

    config = SMALL_GRID if config == "small_grid" else config
    q, args = split_inputs(name, _dtype(dtype))
    ref = reference(q, *args)
    for num_splits in (2, 3):
        got = torch.full_like(q, float("nan"))
        dllm_extend_attention(q, *args, out=got, config=config, num_splits=num_splits)
        assert not got.isnan().any()
        assert (got.float() - ref).abs().max().item() < 2e-2


def test_triton_extend_split_cuda_graph():
    """Split launch captured once with short rows, replayed with longer rows (past the
    captured lengths), other rows and queries: equal to an eager launch on the new values."""
    from dllm.runner.kernels.triton_extend import dllm_extend_attention

    q, args = split_inputs("sdar_b4_g4", torch.bfloat16)
    k_buf, v_buf, table, req_rows, seq_lens, block, scale = args
    seq_lens.copy_(torch.tensor([4, 8, 0, 20, 64, 5], device=q.device))
    static_out = torch.empty_like(q)
    dllm_extend_attention(q, *args, out=static_out, num_splits=4)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dllm_extend_attention(q, *args, out=static_out, num_splits=4)
    q.copy_(torch.randn_like(q))
    seq_lens.copy_(torch.tensor([300, 0, 383, 41, 4, 257], device=q.device))
    req_rows.copy_(torch.tensor([3, 0, 1, 5, 2, 6], device=q.device))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, dllm_extend_attention(q, *args, num_splits=4))


@pytest.mark.parametrize("num_splits", [2, 4, 16])
@pytest.mark.parametrize("name", ["sdar_b4_g4", "llada2_b32_g4", "decode_b1_g4",
                                  "b32_g8_two_m_tiles"])
def test_triton_extend_folded_merge_equals_merge_launch(name, num_splits):
    """The merge in the last split program (an atomic counter per row, KV head and chunk of
    M) gives the bits of the separate merge launch, and leaves every counter at 0."""
    from dllm.runner.kernels import triton_extend as te

    q, args = split_inputs(name, torch.bfloat16)
    folded = te.dllm_extend_attention(q, *args, num_splits=num_splits, fold_merge=True)
    launched = te.dllm_extend_attention(q, *args, num_splits=num_splits, fold_merge=False)
    assert torch.equal(folded, launched)
    assert int(te._COUNTERS[q.device].abs().sum()) == 0


def test_triton_extend_folded_merge_graph_replays():
    """Replayed again and again, the folded merge's counters go back to 0 every time: each
    replay equals the eager launch on that replay's inputs."""
    from dllm.runner.kernels import triton_extend as te

    q, args = split_inputs("sdar_b4_g4", torch.bfloat16)
    static_out = torch.empty_like(q)
    te.dllm_extend_attention(q, *args, out=static_out, num_splits=4)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        te.dllm_extend_attention(q, *args, out=static_out, num_splits=4)
    g = torch.Generator(device=q.device).manual_seed(1)
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=g, device=q.device))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, te.dllm_extend_attention(q, *args, num_splits=4,
                                                                fold_merge=False))
    assert int(te._COUNTERS[q.device].abs().sum()) == 0
