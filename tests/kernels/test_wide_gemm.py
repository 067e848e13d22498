"""The wide GEMMs (``dllm.runner.kernels.wide_gemm``) for many rows: the residual-step producer and
the gate/up + SiLU consumer equal a float64 reference within bf16 rounding, keep the
skinny GEMM's ``PreNormed`` contract, are bit-for-bit deterministic, compute each row
independently of the others, and replay in a CUDA graph.

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` they also run on the CPU under
Triton's interpreter, in float16 (the interpreter has no bfloat16 arithmetic) and on smaller
shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_marks import INTERPRET, MARKS

pytestmark = MARKS

if INTERPRET:
    DEV, DTYPE = "cpu", torch.float16
    HID, INTER = 128, 256  # K tiles: 2; gate/up: 2 column tiles a half
    TOKENS = [512, 600]  # a multiple of the row tile, and a partial last row tile
else:
    DEV, DTYPE = "cuda", torch.bfloat16
    HID, INTER = 4096, 12288  # the 8B shapes
    TOKENS = [512, 600, 1000, 4096]
EPS = 1e-6


@pytest.fixture(scope="module")
def wg():
    from dllm.runner.kernels import wide_gemm

    return wide_gemm


def _rand(*shape, seed, scale=1.0):
    """Normal values made on the device (the 8B shapes' weights are 100M elements)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(DTYPE)


def _layer(seed: int):
    """o_proj-like ``[HID, HID]``, gate/up ``[2 * INTER, HID]``, down ``[HID, INTER]`` and
    a norm weight around 1."""
    return (_rand(HID, HID, seed=seed, scale=HID**-0.5),
            _rand(2 * INTER, HID, seed=seed + 1, scale=HID**-0.5),
            _rand(HID, INTER, seed=seed + 2, scale=INTER**-0.5),
            (1 + _rand(HID, seed=seed + 3, scale=0.2)).contiguous())


def _ulps(got: torch.Tensor, want: torch.Tensor, *terms: torch.Tensor) -> float:
    """Largest difference in units of the dtype's rounding at the magnitude of the
    reference and of the rounded ``terms`` it was summed from."""
    size = want.abs() + sum((t.double().abs() for t in terms), torch.zeros_like(want))
    step = torch.finfo(got.dtype).eps * size.clamp_min(1e-3)
    return ((got.double() - want) / step).abs().max().item()


@pytest.mark.parametrize("m", TOKENS)
def test_residual_step_matches_reference(wg, m):
    wo, _, _, nw = _layer(0)
    x, r = _rand(m, HID, seed=10 + m), _rand(m, HID, seed=20 + m)
    assert wg.supports_residual(x, wo, None, r, nw)
    s, scaled, sum_sq = wg.linear_residual(x, wo, r, nw)
    # y and s rounded where the reference rounds them: within one rounding of each.
    y = (x.double() @ wo.double().T).to(DTYPE)
    want_s = y.double() + r.double()
    assert s.dtype == DTYPE and s.shape == (m, HID)
    assert _ulps(s, want_s, y) <= 1.0
    assert _ulps(scaled, s.double() * nw.double()) <= 1.0
    assert sum_sq.shape == (HID // wg.BLOCK_N, m) and sum_sq.dtype == torch.float32
    ss = (s.double() ** 2).sum(1)
    assert torch.allclose(sum_sq.double().sum(0), ss, rtol=1e-5)


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("normed", [False, True])
def test_gate_up_silu_matches_reference(wg, m, normed):
    wo, wgu, _, nw = _layer(1)
    x, r = _rand(m, HID, seed=30 + m), _rand(m, HID, seed=40 + m)
    x[0], r[0] = 0, 0  # a stream row of zeros: finite only with eps inside the root
    if normed:  # from the producer: the norm finished in the gate/up epilogue
        s, scaled, sum_sq = wg.linear_residual(x, wo, r, nw)
        h = s.double() * torch.rsqrt((s.double() ** 2).mean(1, keepdim=True) + EPS)
        h = h * nw.double()
        assert wg.supports_gate_up(scaled, wgu, None, sum_sq)
        got = wg.gate_up_silu(scaled, wgu, sum_sq, EPS)
    else:
        h = x.double()
        assert wg.supports_gate_up(x, wgu)
        got = wg.gate_up_silu(x, wgu)
    g, u = (h @ wgu.double().T).chunk(2, dim=-1)
    want = F.silu(g) * u
    assert got.dtype == DTYPE and got.shape == (m, INTER)
    assert torch.isfinite(got).all()
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 4e-3, rel


def test_deterministic_and_row_independent(wg):
    """Same inputs, same bits; and the first rows of a batch get the same bits as the batch
    of only them (different M, hence a different grid and a different last row tile)."""
    wo, wgu, _, nw = _layer(2)
    big, small = TOKENS[1], TOKENS[0]
    x, r = _rand(big, HID, seed=50), _rand(big, HID, seed=51)
    out = [wg.linear_residual(x, wo, r, nw) for _ in range(2)]
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)
    s, scaled, sum_sq = out[0]
    s2, scaled2, sum_sq2 = wg.linear_residual(x[:small].contiguous(), wo,
                                              r[:small].contiguous(), nw)
    assert torch.equal(s[:small], s2) and torch.equal(scaled[:small], scaled2)
    assert torch.equal(sum_sq[:, :small], sum_sq2)
    act = wg.gate_up_silu(scaled, wgu, sum_sq, EPS)
    assert torch.equal(act, wg.gate_up_silu(scaled, wgu, sum_sq, EPS))
    act2 = wg.gate_up_silu(scaled2, wgu, sum_sq2, EPS)
    assert torch.equal(act[:small], act2)


def test_supports(wg):
    wo, wgu, _, nw = _layer(3)
    m = wg.MIN_M
    x, r = _rand(m, HID, seed=60), _rand(m, HID, seed=61)
    assert wg.supports(x, wo) and wg.supports_residual(x, wo, None, r, nw)
    assert not wg.supports(x[: m - 1], wo)  # fewer rows than MIN_M
    assert not wg.supports(x, wo, torch.zeros(HID, device=DEV, dtype=DTYPE))  # a bias
    assert not wg.supports(x.float(), wo.float())
    assert not wg.supports(x[:, : HID - 16], wo[:, : HID - 16].contiguous())  # K % 64
    assert not wg.supports_residual(x, wo[: HID - 64].contiguous(), None, r[:, : HID - 64],
                                    nw[: HID - 64])  # N % 128
    assert not wg.supports_residual(x, wo, None, r.t().contiguous().t(), nw)
    assert not wg.supports_gate_up(x, wgu[: 2 * INTER - 128].contiguous())  # halves % 128
    sum_sq = torch.zeros(HID // wg.BLOCK_N, m - 1, device=DEV)
    assert not wg.supports_gate_up(x, wgu, None, sum_sq)  # partials of other rows


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
def test_in_cuda_graph(wg):
    """The o_proj → gate/up → down chain captured once and replayed on new inputs equals the
    eager chain bit for bit (the descriptors and partials are the graph's own buffers)."""
    wo, wgu, wd, nw = _layer(4)
    m = 512
    x, r = _rand(m, HID, seed=70), _rand(m, HID, seed=71)

    def chain():
        s, scaled, sum_sq = wg.linear_residual(x, wo, r, nw)
        act = wg.gate_up_silu(scaled, wgu, sum_sq, EPS)
        return wg.linear_residual(act, wd, s, nw)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for seed in (72, 73):
        x.copy_(_rand(m, HID, seed=seed))
        r.copy_(_rand(m, HID, seed=seed + 10))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, chain(), strict=True):
            assert torch.equal(a, b)
