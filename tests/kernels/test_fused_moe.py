"""The fused MoE kernels (``dllm.runner.kernels.fused_moe``): the alignment lays the pairs
out in expert tiles exactly as specified (sentinel padding, another rank's pairs left out);
the fused experts equal ``StackedExperts.forward_loop`` and a float32 reference within the
dtype's rounding, for one token, experts without pairs, every pair on one expert and
expert-parallel ids; padding rows and another rank's pairs are never written; results are
bit-for-bit deterministic and a token's output does not depend on its place in the batch; on
the GPU the whole path, routing (``moe_route``) included, replays in a CUDA graph.

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` they also run on the CPU under Triton's
interpreter, in float16 (the interpreter has no bfloat16 arithmetic) and on small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.moe import StackedExperts
from tests.triton_marks import INTERPRET, MARKS

pytestmark = MARKS

if INTERPRET:
    DEV, DTYPE = "cpu", torch.float16
    # (T, E, K, H, I, routing)
    EXPERTS = [(1, 8, 2, 64, 32, "random"), (9, 8, 2, 64, 32, "ep"),
               (24, 16, 2, 64, 64, "skewed"), (20, 4, 1, 64, 32, "one")]
    # (T, K, E, routing) for the alignment: one chunk of pairs (64) and several (the
    # interpreter's sort is slow: few chunks).
    ALIGN = [(1, 8, 256, "random"), (37, 3, 8, "ep"), (50, 4, 16, "skewed"), (64, 1, 4, "one")]
else:
    DEV, DTYPE = "cuda", torch.bfloat16
    # LLaDA2.0-mini at batch 1, 32 and 128 of block 32; SDAR-30B-A3B's and LLaDA-MoE's expert
    # shapes; the tiny test checkpoint's.
    EXPERTS = [(32, 256, 8, 2048, 512, "random"), (1, 256, 8, 2048, 512, "random"),
               (1024, 256, 8, 2048, 512, "random"), (4096, 256, 8, 2048, 512, "skewed"),
               (1024, 256, 8, 2048, 512, "ep"), (512, 256, 8, 2048, 512, "one"),
               (256, 128, 8, 2048, 768, "random"), (64, 64, 8, 2048, 1024, "random"),
               (100, 8, 2, 256, 32, "ep")]
    # ... and a long prefill's 320K pairs: 79 chunks of 4096, past ``MAX_CHUNKS``.
    ALIGN = [(1, 8, 256, "random"), (37, 3, 8, "ep"), (750, 4, 16, "skewed"),
             (64, 1, 4, "one"), (4096, 8, 256, "random"), (1024, 8, 256, "ep"),
             (40000, 8, 256, "skewed")]


@pytest.fixture(scope="module")
def fm():
    from dllm.runner.kernels import fused_moe

    return fused_moe


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Normal values made on the device (the real shapes' experts are 800M elements)."""
    return torch.randn(*shape, generator=_gen(seed, DEV), device=DEV) * scale


def _routing(t: int, e: int, k: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, K]`` ids (distinct per token, as a router's) and float32 weights. ``skewed``:
    only the first quarter of the experts is hit; ``one``: every pair on expert 1 (K = 1);
    ``ep``: a rank holding ``e`` experts of ``2e``, another rank's pairs as ``to_local``
    leaves them (id ``e``, weight 0)."""
    g = _gen(seed)
    if kind == "one":
        ids = torch.ones(t, k, dtype=torch.int64)
    else:
        span = max(k, e // 4) if kind == "skewed" else (2 * e if kind == "ep" else e)
        ids = torch.rand(t, span, generator=g).argsort(dim=1)[:, :k]
    weights = torch.rand(t, k, generator=g) + 0.1
    if kind == "ep":
        other = ids >= e
        ids = torch.where(other, e, ids)
        weights = torch.where(other, 0.0, weights)
    return ids.to(DEV), weights.to(DEV)


def _experts(e: int, h: int, i: int, seed: int) -> StackedExperts:
    with torch.device("meta"):
        ex = StackedExperts(e, h, i)
    for j, (name, shape, fan_in) in enumerate((("gate_proj", (e, i, h), h),
                                               ("up_proj", (e, i, h), h),
                                               ("down_proj", (e, h, i), i))):
        w = _randn(*shape, seed=seed + j, scale=fan_in**-0.5).to(DTYPE)
        setattr(ex, name, nn.Parameter(w, requires_grad=False))
    return ex


def _reference(ex: StackedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum in float32 from the same rounded weights and x, and its magnitude
    ``Σ_k |w_k| · (|down| @ |silu(gate) · up|)``, the scale of the rounding errors."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    mag = torch.zeros_like(out)
    xf = x.float()
    for e in ids.unique().tolist():
        if e >= ex.local_experts:
            continue
        token, slot = torch.where(ids == e)
        act = (F.silu(xf[token] @ ex.gate_proj[e].float().T)
               * (xf[token] @ ex.up_proj[e].float().T))
        w = weights[token, slot, None]
        out.index_add_(0, token, (act @ ex.down_proj[e].float().T) * w)
        mag.index_add_(0, token, (act.abs() @ ex.down_proj[e].float().abs().T) * w.abs())
    return out, mag


def _ulps(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> float:
    """The largest difference in units of the dtype's rounding at the magnitude ``mag``."""
    step = torch.finfo(got.dtype).eps * mag.clamp_min(1e-6)
    return ((got.float() - want.float()) / step).abs().max().item()


@pytest.mark.parametrize("t,e,k,h,i,kind", EXPERTS)
def test_fused_experts_match_loop(fm, t, e, k, h, i, kind):
    ex = _experts(e, h, i, seed=e + h)
    x = _randn(t, h, seed=t).to(DTYPE)
    ids, weights = _routing(t, e, k, kind, seed=t + 1)
    w = (ex.gate_proj, ex.up_proj, ex.down_proj)
    assert fm.supports(x, *w, ids, weights)
    y = fm.fused_experts(x, *w, ids, weights)
    assert y.shape == (t, h) and y.dtype == DTYPE and torch.isfinite(y).all()
    ref, mag = _reference(ex, x, ids, weights)
    # Rounded three times (act, a pair's result, the sum): within 1.5 units of the float32
    # sum; the loop rounds each step in the dtype (gate, up, silu, the product, down, the
    # weight, each of the K additions).
    assert _ulps(y, ref, mag) <= 2.0
    with torch.no_grad():
        loop = ex.forward_loop(x, ids, weights)
    assert _ulps(y, loop, mag) <= 4.0 + k


@pytest.mark.parametrize("cfg", [(16, False, 32, 32, 4, 1, 32, 32, 4, 1),
                                 (32, True, 16, 64, 4, 2, 64, 16, 4, 2)])
def test_explicit_tiles(fm, cfg):
    """Both MMA forms with tiles of their own: several tiles an expert, K steps of 16."""
    t, e, k, h, i = 30, 8, 2, 64, 32
    ex = _experts(e, h, i, seed=3)
    x = _randn(t, h, seed=4).to(DTYPE)
    ids, weights = _routing(t, e, k, "skewed", seed=5)
    y = fm.fused_experts(x, ex.gate_proj, ex.up_proj, ex.down_proj, ids, weights,
                         config=fm.MoeConfig(*cfg))
    ref, mag = _reference(ex, x, ids, weights)
    assert _ulps(y, ref, mag) <= 2.0


def _expected_layout(ids: torch.Tensor, e: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (pair per row, sentinel P in padding) and the expert of each tile, by the spec:
    experts in order, each one's pairs in pair order, padded to whole tiles."""
    flat = ids.flatten().cpu()
    p = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat < e], minlength=e).tolist()
    rows, tiles, first = [], [], 0
    for ex, c in enumerate(counts):
        n = -(-c // block_m)
        rows += [order[first:first + c], torch.full((n * block_m - c,), p)]
        tiles.append(torch.full((n,), ex))
        first += c
    return torch.cat(rows).int(), torch.cat(tiles).int()


@pytest.mark.parametrize("t,k,e,kind", ALIGN)
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_layout(fm, t, k, e, kind, block_m):
    ids, _ = _routing(t, e, k, kind, seed=t)
    layout = fm.align(ids, e, block_m)
    rows, tiles = _expected_layout(ids, e, block_m)
    n = layout.num_tiles.item()
    assert n == len(tiles) <= layout.max_tiles == fm.max_tiles(t * k, e, block_m)
    assert layout.sorted_pairs.shape == (layout.max_tiles * block_m,)
    assert torch.equal(layout.sorted_pairs[: n * block_m].cpu(), rows)
    assert torch.equal(layout.tile_expert[:n].cpu(), tiles)


def test_alignment_of_no_local_pairs(fm):
    ids = torch.full((5, 2), 8, dtype=torch.int64, device=DEV)  # all on another rank
    assert fm.align(ids, 8, 16).num_tiles.item() == 0


def test_padding_and_other_ranks_rows_never_written(fm):
    t, e, k, h, i = 13, 8, 2, 64, 32
    ex = _experts(e, h, i, seed=7)
    x = _randn(t, h, seed=8).to(DTYPE)
    ids, weights = _routing(t, e, k, "ep", seed=9)
    cfg = fm.config_for(t * k, e, h, i)
    layout = fm.align(ids, e, cfg.block_m)
    rows = layout.max_tiles * cfg.block_m
    act = fm.gate_up_silu(x, ex.gate_proj, ex.up_proj, layout, k, cfg,
                          out=torch.full((rows, i), float("nan"), dtype=DTYPE, device=DEV))
    real = layout.sorted_pairs < t * k
    real[layout.num_tiles.item() * cfg.block_m:] = False  # rows past the tiles: unwritten
    assert torch.isfinite(act[real]).all() and torch.isnan(act[~real]).all()
    y = fm.down_weighted(act, ex.down_proj, weights, layout, cfg,
                         out=torch.full((t * k, h), float("nan"), dtype=DTYPE, device=DEV))
    mine = (ids < e).flatten()
    assert (~mine).any() and torch.isfinite(y[mine]).all() and torch.isnan(y[~mine]).all()
    out = fm.sum_pairs(y, ids, e, DTYPE)
    ref, mag = _reference(ex, x, ids, weights)
    assert _ulps(out, ref, mag) <= 2.0


def test_deterministic_and_independent_of_token_order(fm):
    t, e, k, h, i = 16, 8, 2, 64, 32
    ex = _experts(e, h, i, seed=11)
    w = (ex.gate_proj, ex.up_proj, ex.down_proj)
    x = _randn(t, h, seed=12).to(DTYPE)
    ids, weights = _routing(t, e, k, "random", seed=13)
    y1 = fm.fused_experts(x, *w, ids, weights)
    assert torch.equal(y1, fm.fused_experts(x, *w, ids, weights))
    perm = torch.randperm(t, generator=_gen(14)).to(DEV)
    y2 = fm.fused_experts(x[perm], *w, ids[perm], weights[perm])
    assert torch.equal(y2, y1[perm])


def test_supports(fm):
    e, i, h = 8, 32, 64
    g = torch.empty(e, i, h, dtype=DTYPE, device=DEV)
    d = torch.empty(e, h, i, dtype=DTYPE, device=DEV)
    x = torch.empty(4, h, dtype=DTYPE, device=DEV)
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEV)
    w = torch.zeros(4, 2, dtype=torch.float32, device=DEV)
    assert fm.supports(x, g, g, d, ids, w)
    assert not fm.supports(x.float(), g.float(), g.float(), d.float(), ids, w)
    assert not fm.supports(x, g, g, d.transpose(1, 2).contiguous().transpose(1, 2), ids, w)
    assert not fm.supports(x, g, g, d, ids, w.to(DTYPE))
    odd = torch.empty(e, 24, h, dtype=DTYPE, device=DEV)
    assert not fm.supports(x, odd, odd, torch.empty(e, h, 24, dtype=DTYPE, device=DEV), ids, w)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need the GPU")
def test_routing_and_experts_replay_in_a_cuda_graph(fm):
    from dllm.runner.kernels import moe_route

    t, e, k, h, i = 256, 256, 8, 2048, 512
    ex = _experts(e, h, i, seed=21)
    w = (ex.gate_proj, ex.up_proj, ex.down_proj)
    x = _randn(t, h, seed=22).to(DTYPE)
    logits = _randn(t, e, seed=23, scale=2.0)
    bias = _randn(e, seed=24, scale=0.1)

    def step() -> torch.Tensor:
        weights, ids = moe_route.route_sigmoid(logits, k, 8, 4, bias, True, 2.5)
        return fm.fused_experts(x, *w, ids, weights)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (25, 26):
        x.copy_(_randn(t, h, seed=seed).to(DTYPE))
        logits.copy_(_randn(t, e, seed=seed + 10, scale=2.0))
        graph.replay()
        assert torch.equal(out, step())
