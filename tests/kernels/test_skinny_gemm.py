"""The Triton skinny GEMM (``dllm.runner.kernels.skinny_gemm``) for 1-64 rows: equals a float64
reference and ``F.linear`` within bf16 rounding, writes every output element, is bit-for-bit
deterministic, and computes each row independently of the other rows of the batch.

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` they also run on the CPU under Triton's
interpreter, in float16 (the interpreter has no bfloat16 arithmetic) and on smaller shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_marks import INTERPRET, MARKS

pytestmark = MARKS

if INTERPRET:
    DEV, DTYPE = "cpu", torch.float16
    # (N, K): N a multiple of the tile, N not (tail columns), a split-K shape, a K that is not
    # a multiple of the K tile, and the default heuristic's split of a wide K.
    SHAPES = [(256, 512), (200, 384), (96, 1024), (130, 400)]
    TOKENS = [1, 3, 16, 17, 32, 40]
else:
    DEV, DTYPE = "cuda", torch.bfloat16
    # qkv, o_proj, down and gate_up of the 8B model; odd N (a partial last tile), a small N,
    # and K = 4096 + 16 (not a multiple of any K tile).
    SHAPES = [(6144, 4096), (4096, 4096), (4096, 12288), (24576, 4096), (6144 + 80, 4096),
              (1000, 2048), (512, 4112)]
    TOKENS = list(range(1, 17)) + [17, 24, 31, 32, 33, 48, 63, 64]


@pytest.fixture(scope="module")
def sg():
    from dllm.runner.kernels import skinny_gemm

    return skinny_gemm


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DTYPE).to(DEV)
    b = torch.randn(n, generator=g).to(DTYPE).to(DEV)
    return w, b


def _tile(m: int) -> int:
    """The row tile ``m`` rows take (written out, not asked of the module under test)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _tile_takes(sg, n: int, k: int, m: int) -> bool:
    """Whether the dispatcher takes an ``[n, k]`` weight at ``m`` rows: every shape up to 16
    rows, past that only those of the row tile's table (the shapes measured to gain there)."""
    return m <= 16 or (n, k) in sg.ROW_TILES[_tile(m)][0][(9, 0)]


def _x(m: int, k: int, seed: int, stride: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if stride is None:
        return torch.randn(m, k, generator=g).to(DTYPE).to(DEV)
    # a row-strided view: the first k columns of a wider buffer
    return torch.randn(m, stride, generator=g).to(DTYPE).to(DEV)[:, :k]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=DTYPE, device=DEV)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(sg, n, k, bias):
    w, b = _weights(n, k, seed=n + k)
    b = b if bias else None
    for m in TOKENS:
        x = _x(m, k, seed=m)
        # past 16 rows the dispatcher takes only the shapes measured to gain there
        assert sg.supports(x, w, b) == _tile_takes(sg, n, k, m)
        y = sg.skinny_linear(x, w, b, out=_poisoned(m, n))
        assert y.shape == (m, n) and y.dtype == DTYPE
        assert torch.isfinite(y).all(), f"unwritten or non-finite output at M={m}"
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        assert _rel(y, ref) < 1e-2, (m, _rel(y, ref))
        if not INTERPRET:  # F.linear in bf16 on the CPU is slow and not the point there
            lin = F.linear(x, w, b)
            assert _rel(y, lin.double()) < 1e-2
            # both round a float32 sum to bf16: they differ by at most a few ulps
            torch.testing.assert_close(y, lin, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", SHAPES[:3])
def test_strided_x(sg, n, k):
    w, b = _weights(n, k, seed=1)
    for m in (1, 5, 16):
        x = _x(m, k, seed=m, stride=k + 64)
        assert x.stride(0) == k + 64 and sg.supports(x, w, b)
        y = sg.skinny_linear(x, w, b)
        assert torch.equal(y, sg.skinny_linear(x.contiguous(), w, b))
        ref = x.double() @ w.double().T + b.double()
        assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("n,k", SHAPES)
def test_deterministic_and_row_independent(sg, n, k):
    # A row's result is the same alone (M = 1, the 16-row tile) and in any batch of the same
    # tile; a batch past 16 rows (the 32- or 64-row tile) gives each row the result it has in
    # the smallest batch of that tile (17 or 33 rows).
    w, b = _weights(n, k, seed=2)
    x64 = _x(64, k, seed=3)
    first = {16: [sg.skinny_linear(x64[i:i + 1].clone(), w, b)[0] for i in range(16)],
             32: sg.skinny_linear(x64[:17].clone(), w, b),
             64: sg.skinny_linear(x64[:33].clone(), w, b)}
    for m in TOKENS:
        x = x64[:m].clone()
        y1 = sg.skinny_linear(x, w, b, out=_poisoned(m, n))
        y2 = sg.skinny_linear(x, w, b, out=_poisoned(m, n))
        assert torch.equal(y1, y2), f"two runs differ at M={m}"
        tile = _tile(m)
        same = first[tile]
        for i in range(min(m, len(same))):
            assert torch.equal(y1[i], same[i]), f"row {i} of M={m} differs"
        if tile > 16 and m < tile:  # the rows past the smallest batch: as in the full tile
            assert torch.equal(y1, sg.skinny_linear(x64[:tile].clone(), w, b)[:m])


def test_supports(sg):
    w = torch.empty(256, 512, dtype=DTYPE, device=DEV)
    assert sg.supports(torch.empty(16, 512, dtype=DTYPE, device=DEV), w)
    assert not sg.supports(torch.empty(17, 512, dtype=DTYPE, device=DEV), w)
    o_proj = torch.empty(4096, 4096, dtype=DTYPE, device=DEV)  # in ROWS32
    assert sg.supports(torch.empty(32, 4096, dtype=DTYPE, device=DEV), o_proj)
    assert sg.supports(torch.empty(64, 4096, dtype=DTYPE, device=DEV), o_proj)  # ROWS64
    assert not sg.supports(torch.empty(65, 4096, dtype=DTYPE, device=DEV), o_proj)
    assert not sg.supports(torch.empty(129, 4096, dtype=DTYPE, device=DEV), o_proj)
    assert not sg.supports(torch.empty(33, 512, dtype=DTYPE, device=DEV), w)
    assert not sg.supports(torch.empty(0, 512, dtype=DTYPE, device=DEV), w)
    assert not sg.supports(torch.empty(4, 512, dtype=torch.float32, device=DEV),
                           w.float())
    assert not sg.supports(torch.empty(4, 512, dtype=DTYPE, device=DEV),
                           torch.empty(512, 256, dtype=DTYPE, device=DEV).t())
    assert not sg.supports(torch.empty(4, 520, dtype=DTYPE, device=DEV)[:, :500],
                           torch.empty(256, 500, dtype=DTYPE, device=DEV))
    assert not sg.supports(torch.empty(4, 512, dtype=DTYPE, device=DEV).t().contiguous().t(),
                           w)
    assert sg.config_for(4096, 4096) == sg.config_for(4096, 4096)  # keyed on (N, K) alone
    # the 32-row tile has its own configurations; a shape without one keeps the 16-row tile's
    assert sg.config_for(4096, 4096, rows=17) == sg.ROWS32[(9, 0)][(4096, 4096)]
    assert sg.config_for(4096, 4096, rows=33) == sg.ROWS64[(9, 0)][(4096, 4096)]
    assert [sg._block_m(m) for m in (1, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64,
                                                                           64, 128, 128]
    assert sg.config_for(4096, 4096, rows=16) == sg.CONFIGS[(9, 0)][(4096, 4096)]
    assert sg.config_for(256, 512, rows=32) == sg.config_for(256, 512, rows=1)


def test_graph_capture(sg):
    if INTERPRET:
        pytest.skip("CUDA graphs need CUDA")
    w, b = _weights(4096, 4096, seed=5)
    x = _x(4, 4096, seed=6)
    eager = sg.skinny_linear(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sg.skinny_linear(x, w, b)
    x.copy_(_x(4, 4096, seed=7))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, sg.skinny_linear(x, w, b))
    assert not torch.equal(y, eager)


# Explicit configurations, whatever the table holds: split-K (even and with a ragged last
# split), the non-swapped operand order, and wide tiles.
CONFIG_CASES = [dict(block_n=32, block_k=128, split_k=3), dict(block_n=64, block_k=64, split_k=4),
                dict(block_n=64, block_k=128, split_k=2, swap_ab=False),
                dict(block_n=128, block_k=64, split_k=1, num_warps=8, num_stages=3)]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("n,k", [(200, 384), (130, 400)] if INTERPRET else
                         [(4096, 12288), (6144 + 80, 4096 + 16)])
def test_configs(sg, case, n, k):
    cfg = sg.SkinnyConfig(**case)
    w, b = _weights(n, k, seed=8)
    x16 = _x(16, k, seed=9)
    ref = x16.double() @ w.double().T + b.double()
    y16 = sg.skinny_linear(x16, w, b, config=cfg, out=_poisoned(16, n))
    assert torch.isfinite(y16).all() and _rel(y16, ref) < 1e-2
    assert torch.equal(y16, sg.skinny_linear(x16, w, b, config=cfg))
    for m in (1, 2, 7):
        y = sg.skinny_linear(x16[:m].clone(), w, b, config=cfg, out=_poisoned(m, n))
        assert torch.equal(y, y16[:m]), f"M={m} rows differ from the same rows in M=16"
    x = x16
    for tile, part, seed in ((32, 20, 10), (64, 40, 11)):  # the 32- and 64-row tiles
        x = torch.cat([x, _x(tile // 2, k, seed=seed)])
        y = sg.skinny_linear(x, w, b, config=cfg, out=_poisoned(tile, n))
        ref = x.double() @ w.double().T + b.double()
        assert torch.isfinite(y).all() and _rel(y, ref) < 1e-2
        y_part = sg.skinny_linear(x[:part].clone(), w, b, config=cfg, out=_poisoned(part, n))
        assert torch.equal(y_part, y[:part]), f"rows of M={part} differ from M={tile}"


# --- the residual step split over two projections: skinny_linear_residual (epilogue: add the
# residual, scale by the next norm's weight, partial sums of squares) and skinny_linear with
# sum_sq (epilogue: 1 / rms from the partials) and silu (gate and up rows, silu(gate) * up) ---

# (producer N, producer K, consumer N, consumer K = producer N)
FUSED_SHAPES = ([(256, 512, 384), (208, 400, 96)] if INTERPRET else
                [(4096, 4096, 24576), (4096, 12288, 6144), (4096 + 16, 4096, 1000)])
EPS = 1e-6


def _residual_case(n, k, n2, m, seed):
    g = torch.Generator().manual_seed(seed)
    w1, b1 = _weights(n, k, seed=seed)
    w2, b2 = _weights(n2, n, seed=seed + 1)
    nw = (1 + 0.5 * torch.randn(n, generator=g)).to(DTYPE).to(DEV)
    return w1, b1, w2, b2, nw, _x(m, k, seed=seed + 2), _x(m, n, seed=seed + 3)


@pytest.mark.parametrize("n,k,n2", FUSED_SHAPES)
@pytest.mark.parametrize("silu", [False, True])
def test_residual_step_matches_reference(sg, n, k, n2, silu):
    for m in TOKENS:
        w1, b1, w2, b2, nw, x, r = _residual_case(n, k, n2, m, seed=m)
        assert sg.supports_residual(x, w1, b1, r, nw) == _tile_takes(sg, n, k, m)
        s, scaled, sum_sq = sg.skinny_linear_residual(x, w1, b1, r, nw)
        # the stream and the scaled input, rounded as the reference rounds them
        y = sg.skinny_linear(x, w1, b1)
        assert torch.equal(s, (y.float() + r.float()).to(DTYPE))
        assert torch.equal(scaled, (s.float() * nw.float()).to(DTYPE))
        assert sum_sq.dtype == torch.float32 and sum_sq.shape[1] == _tile(m)
        torch.testing.assert_close(sum_sq.sum(0)[:m], s.float().pow(2).sum(-1), rtol=1e-5,
                                   atol=0)
        assert not sum_sq[:, m:].any(), "token slots past M hold zeros"
        out = sg.skinny_linear(scaled, w2, b2, sum_sq=sum_sq, eps=EPS, silu=silu,
                               out=_poisoned(m, n2 // 2 if silu else n2))
        sd = s.double()
        ref = (sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
               @ w2.double().T + b2.double())
        if silu:
            gate, up = ref.chunk(2, dim=-1)
            ref = F.silu(gate) * up
        assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2, (m, _rel(out, ref))


@pytest.mark.parametrize("n,k", [(384, 256)] if INTERPRET else [(24576, 4096), (37888, 3584)])
@pytest.mark.parametrize("silu", [False, True])
def test_silu_without_norm(sg, silu, n, k):
    w, b = _weights(n, k, seed=12)
    for m in (1, 5, 16, 32, 64):
        x = _x(m, k, seed=m)
        y = sg.skinny_linear(x, w, b, silu=silu)
        ref = x.double() @ w.double().T + b.double()
        if silu:
            gate, up = ref.chunk(2, dim=-1)
            ref = F.silu(gate) * up
        assert _rel(y, ref) < 1e-2


def test_silu_tables(sg):
    """SiLU rides the gate/up epilogue where a tile's table lists the shape: the 16-row
    tile's up to 16 rows, past that the row tile's (whose shapes the kernel takes)."""
    for plain, silu in sg.ROW_TILES.values():
        for cc, table in silu.items():
            assert set(table) <= set(plain[cc])
    assert sg.silu_fused(24576, 4096, m=16) and sg.silu_fused(24576, 4096, m=32)
    assert sg.silu_fused(24576, 4096, m=64) and not sg.silu_fused(24576, 4096, m=65)
    assert not sg.silu_fused(37888, 3584, m=64)  # Dream-7B at 64 rows: a SiLU kernel
    assert not sg.silu_fused(37888, 3584, m=16)  # Dream-7B: past 16 rows only
    assert sg.silu_fused(37888, 3584, m=17)
    assert not sg.silu_fused(6144, 4096, m=32)


@pytest.mark.parametrize("silu", [False, True])
def test_residual_step_row_independent(sg, silu):
    n, k, n2 = FUSED_SHAPES[-1]
    w1, b1, w2, b2, nw, x16, r16 = _residual_case(n, k, n2, 16, seed=30)

    def run(x, r):
        s, scaled, sum_sq = sg.skinny_linear_residual(x, w1, b1, r, nw)
        return s, sg.skinny_linear(scaled, w2, b2, sum_sq=sum_sq, eps=EPS, silu=silu)

    s16, y16 = run(x16, r16)
    again = run(x16, r16)
    assert torch.equal(s16, again[0]) and torch.equal(y16, again[1])
    for m in (1, 3, 8):
        s, y = run(x16[:m].clone(), r16[:m].clone())
        assert torch.equal(s, s16[:m]) and torch.equal(y, y16[:m])
    x32 = torch.cat([x16, _x(16, k, seed=31)])
    r32 = torch.cat([r16, _x(16, n, seed=32)])
    s32, y32 = run(x32, r32)
    s20, y20 = run(x32[:20].clone(), r32[:20].clone())
    assert torch.equal(s20, s32[:20]) and torch.equal(y20, y32[:20])
    x64 = torch.cat([x32, _x(32, k, seed=33)])
    r64 = torch.cat([r32, _x(32, n, seed=34)])
    s64, y64 = run(x64, r64)
    s40, y40 = run(x64[:40].clone(), r64[:40].clone())
    assert torch.equal(s40, s64[:40]) and torch.equal(y40, y64[:40])


def test_residual_step_in_graph(sg):
    if INTERPRET:
        pytest.skip("CUDA graphs need CUDA")
    w1, b1, w2, b2, nw, x, r = _residual_case(4096, 12288, 24576, 4, seed=40)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, scaled, sum_sq = sg.skinny_linear_residual(x, w1, None, r, nw, pdl=True)
        y = sg.skinny_linear(scaled, w2, None, sum_sq=sum_sq, eps=EPS, silu=True, pdl=True)
    x.copy_(_x(4, 12288, seed=41))
    graph.replay()
    torch.cuda.synchronize()
    s2, scaled2, sum_sq2 = sg.skinny_linear_residual(x, w1, None, r, nw)
    assert torch.equal(s, s2)
    assert torch.equal(y, sg.skinny_linear(scaled2, w2, None, sum_sq=sum_sq2, eps=EPS,
                                           silu=True))
