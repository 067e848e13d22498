"""Fused MoE: the routed SwiGLU experts in five launches, with static shapes and no host read
(CUDA-graph capturable); the routing that picks them is ``moe_route``'s one launch.

The torch path (``StackedExperts.forward_grouped``) pays an argsort, gathers, three
``grouped_mm`` calls, the SiLU, an ``index_copy`` and a float32 sum a layer. Here:

* **Alignment** (``align``): the ``P = T * K`` token-expert pairs in expert order, each
  expert's run padded to a multiple of ``BLOCK_M`` with the sentinel ``P``, so that every
  ``BLOCK_M``-row tile holds one expert's pairs; its expert id per tile and the number of
  valid tiles. Three small launches: per chunk of pairs a histogram of its experts; one
  program turning the ``[chunks, E]`` counts (``MAX_CHUNKS`` chunks up to 128K pairs) into each
  expert's padded start, each (chunk, expert)'s first row, the tile map and the padding
  sentinels; per chunk a sort of its ``(expert, pair)`` keys and a scatter of each pair to
  its row. Within an expert the pairs
  stay in pair order, so the layout is a function of the ids alone. The buffers have static
  sizes, from ``P``, ``E`` and ``BLOCK_M`` only: at most ``min(P, cdiv(P + E * (BLOCK_M -
  1), BLOCK_M))`` tiles. A pair routed to another rank's expert (id ``E``, see
  ``StackedExperts.to_local``) gets no row.
* **gate/up** (``_gate_up_kernel``): one program per (tile, ``BLOCK_N`` columns of the
  intermediate size), launched for the most tiles there can be; a program past the valid
  tiles returns at once. It gathers its rows of x by token, streams that expert's gate and
  up rows (the ``[E, I, H]`` stacks as stored), keeps two float32 accumulators and writes
  ``silu(gate) * up`` rounded once, for the valid rows only.
* **down** (``_down_kernel``): the same grid over ``H``; each row's float32 result times its
  pair's routing weight, rounded once into the pair's own row of a ``[P, H]`` buffer (by
  pair index, so a token's K results are adjacent).
* **sum** (``_sum_kernel``): per token the K pair rows added in float32 in slot order 0..K-1
  (another rank's pairs skipped), rounded once to x's dtype.

**Tiles** (``config_for``): from ``(P, E, H, I)`` only, never from the routing, so the
launches of a batch size are fixed. At a few rows per expert (batch 1: about one) a tile is
16 rows and the product is formed as ``W @ x.T`` (the weight the MMA's large side, as in
``skinny_gemm``): the step reads the reached experts' weights once, and streaming them is
the whole cost. At 8-24 rows an expert, 32-row tiles, still swapped; from ~32 rows an
expert, 64-row tiles (``x @ W.T``; 128-row tiles pad twice as many rows at ~128 rows an
expert and measured slower: gate/up 439 µs against 371 at 4096 tokens) with 256 gate + 256
up columns a program (8 warps) and 128 columns of down. Chosen from
``bench/kernels/moe.py --sweep`` on an H200 (triton 3.6; 24-48 candidates a token count).

**Measured** (H200, LLaDA2.0-mini's layer: 256 experts of 512, hidden 2048, top-8; random
routing; CUDA-graph replay with the weights rotated past the L2; ``bench/kernels/moe.py``,
copy 4.13 TB/s, 662 TFLOP/s bf16 sustained): the experts at 32 / 1024 / 4096 tokens take
168 / 363 / 666 µs against 329 / 760 / 1605 for ``forward_grouped``, 1.07 / 1.21 / 2.07x
the layer's floor (the larger of the reached experts' bytes at the copy bandwidth and the
FLOPs at the matmul rate: 157 / 300 / 322 µs). At 32 tokens gate/up streams the reached
experts' weights at 4.15 TB/s and down at 3.9. Of the 666 µs at 4096 tokens: alignment 20,
gate/up 381 (1.8x its FLOPs at the matmul rate; a sixth of its rows are padding), down 241
(with the 134 MB of per-pair rows it writes), the sum 38 (reading them back).

**Determinism**: no atomics; the alignment is a function of the ids, the K loops run in a
fixed order, a row's result depends only on that row (padding rows are never stored and
never enter another row), and the K-way sum runs in slot order. The same inputs give
bit-identical outputs; a row's output is the same in any batch of the same ``config_for``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["Alignment", "MoeConfig", "align", "config_for", "down_weighted", "fused_experts",
           "gate_up_silu", "max_tiles", "sum_pairs", "supports"]

_HALF = (torch.float16, torch.bfloat16)
# Under TRITON_INTERPRET=1 the kernels run on CPU tensors (numpy); used by the tests only.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Chunks of pairs the alignment's one scan program takes at once (a power of two): chunks
# grow with the pairs from 64 to 4096 pairs (one sort of a chunk a program), and past 32 *
# 4096 pairs (long prefills) the chunks grow in number instead.
MAX_CHUNKS = 32
_MIN_CHUNK, _MAX_CHUNK = 64, 4096
_SUM_BLOCK = 1024


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


# ---------------------------------------------------------------------------------------------
# Alignment: pairs in expert order, padded to whole tiles
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, E: tl.constexpr, E_P: tl.constexpr,
                  CHUNK: tl.constexpr):
    c = tl.program_id(0)
    r = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + r, mask=r < P, other=E).to(tl.int32)
    ok = (r < P) & (ids >= 0) & (ids < E)  # id E: another rank's expert
    tl.store(counts_ptr + c * E_P + tl.arange(0, E_P), tl.histogram(ids, E_P, mask=ok))


@triton.jit(do_not_specialize=["P", "chunks"])
def _scan_kernel(counts_ptr, delta_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, P, chunks,
                 E_P: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr,
                 TILE_BLOCK: tl.constexpr):
    rc = tl.arange(0, MAX_CHUNKS)[:, None]
    re = tl.arange(0, E_P)
    cnt = tl.load(counts_ptr + rc * E_P + re[None, :], mask=rc < chunks, other=0)
    total = tl.sum(cnt, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    # A pair that is the j-th of expert e in chunk c's sorted keys sits at position
    # before_e + j there and goes to row start[e] + (pairs of e in earlier chunks) + j.
    before_e = tl.cumsum(cnt, axis=1) - cnt
    earlier = tl.cumsum(cnt, axis=0) - cnt
    tl.store(delta_ptr + rc * E_P + re[None, :], start[None, :] + earlier - before_e,
             mask=rc < chunks)
    tl.store(num_tiles_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    # Each expert writes its id over its run of tiles, TILE_BLOCK tiles an expert a step (one
    # step while no expert has more than TILE_BLOCK tiles).
    n_tiles = padded // BLOCK_M
    first = (start // BLOCK_M)[:, None]
    expert = tl.broadcast_to(re[:, None], (E_P, TILE_BLOCK))
    for t0 in range(0, tl.max(n_tiles, axis=0), TILE_BLOCK):
        t = t0 + tl.arange(0, TILE_BLOCK)[None, :]
        tl.store(tile_expert_ptr + first + t, expert, mask=t < n_tiles[:, None])
    # Each expert's padding rows hold the sentinel P.
    rp = tl.arange(0, BLOCK_M)[None, :]
    fill = start + total
    tl.store(sorted_ptr + fill[:, None] + rp, tl.full((E_P, BLOCK_M), P, tl.int32),
             mask=rp < (padded - total)[:, None])


@triton.jit(do_not_specialize=["P"])
def _place_kernel(ids_ptr, delta_ptr, sorted_ptr, P, E: tl.constexpr, E_P: tl.constexpr,
                  CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    r = c * CHUNK + i
    ids = tl.load(ids_ptr + r, mask=r < P, other=E).to(tl.int32)
    ok = (r < P) & (ids >= 0) & (ids < E)
    # (expert, pair) keys: the sort puts the chunk's pairs in expert order and, within an
    # expert, in pair order; pairs without a row sort last.
    key = tl.sort(tl.where(ok, ids, E_P) * CHUNK + i)
    e = key // CHUNK
    mine = e < E_P
    row = tl.load(delta_ptr + c * E_P + e, mask=mine, other=0) + i
    tl.store(sorted_ptr + row, c * CHUNK + key % CHUNK, mask=mine)


@dataclass(frozen=True)
class Alignment:
    """The pairs (``p = token * K + slot``) in expert order: ``sorted_pairs`` ``[tiles *
    block_m]`` int32 (each expert's run padded to whole tiles with the sentinel ``P``; rows
    past the valid tiles unwritten), ``tile_expert`` ``[tiles]`` int32 (valid for the first
    ``num_tiles``), ``num_tiles`` ``[1]`` int32."""

    sorted_pairs: torch.Tensor
    tile_expert: torch.Tensor
    num_tiles: torch.Tensor
    block_m: int

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]


def max_tiles(pairs: int, experts: int, block_m: int) -> int:
    """Most tiles ``pairs`` pairs over ``experts`` experts can fill: each expert's run padded
    to ``block_m`` rows, and no tile without a pair."""
    return max(1, min(pairs, triton.cdiv(pairs + experts * (block_m - 1), block_m)))


def _chunk(pairs: int) -> int:
    return min(_MAX_CHUNK, max(_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(pairs,
                                                                             MAX_CHUNKS))))


def align(topk_ids: torch.Tensor, experts: int, block_m: int) -> Alignment:
    """The tile layout of ``topk_ids`` ``[T, K]`` (contiguous; id ``experts``: another
    rank's expert, no row) for ``block_m``-row tiles (a power of two)."""
    pairs = topk_ids.numel()
    dev = topk_ids.device
    e_p = triton.next_power_of_2(experts)
    chunk = _chunk(pairs)
    chunks = triton.cdiv(pairs, chunk)
    tiles = max_tiles(pairs, experts, block_m)
    counts = torch.empty((chunks, e_p), dtype=torch.int32, device=dev)
    delta = torch.empty((chunks, e_p), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(tiles * block_m, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=dev)
    num_tiles = torch.empty(1, dtype=torch.int32, device=dev)
    _count_kernel[(chunks,)](topk_ids, counts, pairs, E=experts, E_P=e_p, CHUNK=chunk,
                             num_warps=4)
    _scan_kernel[(1,)](counts, delta, sorted_pairs, tile_expert, num_tiles, pairs, chunks,
                       E_P=e_p, MAX_CHUNKS=max(MAX_CHUNKS, triton.next_power_of_2(chunks)),
                       BLOCK_M=block_m,
                       TILE_BLOCK=max(1, min(8, 2048 // e_p)), num_warps=8)
    _place_kernel[(chunks,)](topk_ids, delta, sorted_pairs, pairs, E=experts, E_P=e_p,
                             CHUNK=chunk, num_warps=4)
    return Alignment(sorted_pairs, tile_expert, num_tiles, block_m)


# ---------------------------------------------------------------------------------------------
# Expert GEMMs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the expert GEMMs: ``block_m`` rows of one expert a tile (the alignment's
    unit); ``swap_ab``: form ``W @ x.T`` (small tiles); gate/up: ``up_n`` columns of gate and
    as many of up a program, ``up_k`` of H a step; down: ``down_n`` columns of H a program,
    ``down_k`` of I a step."""

    block_m: int
    swap_ab: bool
    up_n: int
    up_k: int
    up_warps: int
    up_stages: int
    down_n: int
    down_k: int
    down_warps: int
    down_stages: int

    def label(self) -> str:
        return (f"m{self.block_m}{'T' if self.swap_ab else 'N'} up n{self.up_n}k{self.up_k}"
                f"w{self.up_warps}s{self.up_stages} down n{self.down_n}k{self.down_k}"
                f"w{self.down_warps}s{self.down_stages}")


def _fit(block: int, dim: int) -> int:
    """The largest power of two <= ``block`` dividing ``dim`` (a multiple of 16)."""
    while dim % block:
        block //= 2
    return block


def config_for(pairs: int, experts: int, hidden: int, inter: int) -> MoeConfig:
    """The tiles for ``pairs`` token-expert pairs over ``experts`` experts of ``[inter,
    hidden]`` gate/up and ``[hidden, inter]`` down projections. Keyed on the shapes only:
    the same for every routing of a batch size."""
    per_expert = pairs / experts
    if per_expert <= 6:  # batch 1 of block 32 (~1 row an expert): stream the weights
        cfg = MoeConfig(16, True, 64, 128, 4, 4, 128, 64, 4, 4)
    elif per_expert <= 24:  # batch 8-16
        cfg = MoeConfig(32, True, 128, 64, 4, 4, 128, 64, 4, 3)
    else:  # batch 32-128 (~32-128 rows an expert)
        cfg = MoeConfig(64, False, 256, 64, 8, 3, 128, 64, 4, 3)
    return MoeConfig(cfg.block_m, cfg.swap_ab, _fit(cfg.up_n, inter), _fit(cfg.up_k, hidden),
                     cfg.up_warps, cfg.up_stages, _fit(cfg.down_n, hidden),
                     _fit(cfg.down_k, inter), cfg.down_warps, cfg.down_stages)


@triton.jit
def _tile_rows(tile, sorted_ptr, tile_expert_ptr, P, BLOCK_M: tl.constexpr):
    """A valid tile's expert (int64), its rows, their pairs, which are real, and their
    tokens (padding rows: token 0, never stored)."""
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rm)
    return e, rm, pair, pair < P


@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, act_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr,
                    P, stride_xm, TOP_K: tl.constexpr, HID: tl.constexpr, INTER: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr):
    # Programs past the valid tiles (the grid is sized for the most there can be) leave.
    tile = tl.program_id(0) // (INTER // BLOCK_N)
    if tile >= tl.load(num_tiles_ptr):
        return
    e, rm, pair, valid = _tile_rows(tile, sorted_ptr, tile_expert_ptr, P, BLOCK_M)
    # Padding rows re-read token 0 and are never stored (each row's product is its own).
    tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    rn = (tl.program_id(0) % (INTER // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + rk[None, :]
    w_off = rn[:, None] * HID + rk[None, :]
    g_ptrs = wg_ptr + e * (INTER * HID) + w_off
    u_ptrs = wu_ptr + e * (INTER * HID) + w_off
    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for _ in range(HID // BLOCK_K):
        x = tl.load(x_ptrs)
        g = tl.load(g_ptrs)
        u = tl.load(u_ptrs)
        if SWAP_AB:
            acc_g = tl.dot(g, tl.trans(x), acc_g)
            acc_u = tl.dot(u, tl.trans(x), acc_u)
        else:
            acc_g = tl.dot(x, tl.trans(g), acc_g)
            acc_u = tl.dot(x, tl.trans(u), acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + rm[:, None] * INTER + rn[None, :], y.to(act_ptr.dtype.element_ty),
             mask=valid[:, None])


@triton.jit(do_not_specialize=["P"])
def _down_kernel(act_ptr, wd_ptr, topk_w_ptr, y_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr,
                 P, HID: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    tile = tl.program_id(0) // (HID // BLOCK_N)
    if tile >= tl.load(num_tiles_ptr):
        return
    e, rm, pair, valid = _tile_rows(tile, sorted_ptr, tile_expert_ptr, P, BLOCK_M)
    rn = (tl.program_id(0) % (HID // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Padding rows of act were never written: read as zeros.
    a_ptrs = act_ptr + rm[:, None] * INTER + rk[None, :]
    w_ptrs = wd_ptr + e * (HID * INTER) + (rn[:, None] * INTER + rk[None, :])
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(INTER // BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    pair_ok = tl.where(valid, pair, 0).to(tl.int64)
    acc = acc * tl.load(topk_w_ptr + pair_ok, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + pair_ok[:, None] * HID + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None])


@triton.jit(do_not_specialize=["E"])
def _sum_kernel(y_ptr, ids_ptr, out_ptr, E, stride_om, HID: tl.constexpr,
                TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = rn < HID
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k + tl.zeros_like(rn))
        mine = n_ok & (e >= 0) & (e < E)  # another rank's pair has no row
        acc += tl.load(y_ptr + (t * TOP_K + k) * HID + rn, mask=mine,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def supports(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
             down_proj: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor) -> bool:
    """Whether ``fused_experts`` takes these: half-precision ``x`` ``[T, H]`` (rows
    contiguous) and contiguous ``[E, I, H]`` / ``[E, H, I]`` stacks in its dtype on its
    device, H and I multiples of 16, ``[T, K]`` ids and float32 weights."""
    if not (_on_device(x) and x.dim() == 2 and x.dtype in _HALF and gate_proj.dim() == 3):
        return False
    e, i, h = gate_proj.shape
    t = x.shape[0]
    return (x.shape[1] == h and x.stride(1) == 1 and h % 16 == 0 and i % 16 == 0 and t >= 1
            and up_proj.shape == (e, i, h) and down_proj.shape == (e, h, i)
            and all(w.dtype == x.dtype and w.device == x.device and w.is_contiguous()
                    for w in (gate_proj, up_proj, down_proj))
            and topk_ids.dim() == 2 and topk_ids.shape[0] == t
            and topk_ids.dtype in (torch.int32, torch.int64)
            and topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32
            and topk_ids.device == x.device and topk_weights.device == x.device
            and topk_ids.numel() < 2**31 // max(1, triton.next_power_of_2(e)))


def fused_experts(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                  down_proj: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  config: MoeConfig | None = None) -> torch.Tensor:
    """``Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))`` with ``e = topk_ids[:, k]`` over this
    rank's experts (id ``E``: another rank's, skipped): ``[T, H]`` in x's dtype, float32
    inside, the per-pair results rounded once and summed in float32 in slot order. ``config``
    overrides ``config_for`` (benchmarks). Check ``supports`` first."""
    t, h = x.shape
    e, i, _ = gate_proj.shape
    k = topk_ids.shape[1]
    cfg = config if config is not None else config_for(t * k, e, h, i)
    ids = topk_ids.contiguous()
    layout = align(ids, e, cfg.block_m)
    act = gate_up_silu(x, gate_proj, up_proj, layout, k, cfg)
    y = down_weighted(act, down_proj, topk_weights.contiguous(), layout, cfg)
    return sum_pairs(y, ids, e, x.dtype)


def gate_up_silu(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                 layout: Alignment, top_k: int, cfg: MoeConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[token] @ gate_e.T) * (x[token] @ up_e.T)`` for every row of ``layout``'s valid
    tiles: ``[max_tiles * block_m, I]``, padding rows (and rows past the valid tiles) not
    written. ``out`` is written in place if given (tests poison it)."""
    e, i, h = gate_proj.shape
    rows = layout.max_tiles * cfg.block_m
    assert layout.block_m == cfg.block_m and i % cfg.up_n == 0 and h % cfg.up_k == 0
    act = out if out is not None else torch.empty((rows, i), dtype=x.dtype, device=x.device)
    assert act.shape == (rows, i) and act.is_contiguous()
    _gate_up_kernel[(layout.max_tiles * (i // cfg.up_n),)](
        x, gate_proj, up_proj, act, layout.sorted_pairs, layout.tile_expert, layout.num_tiles,
        x.shape[0] * top_k, x.stride(0), TOP_K=top_k, HID=h, INTER=i, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, SWAP_AB=cfg.swap_ab, num_warps=cfg.up_warps,
        num_stages=cfg.up_stages)
    return act


def down_weighted(act: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                  layout: Alignment, cfg: MoeConfig,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Each valid row's ``act @ down_e.T`` times its pair's weight (``topk_weights`` ``[T,
    K]`` float32, contiguous), rounded once into the pair's row of ``[T * K, H]``; another
    rank's pairs' rows are not written."""
    e, h, i = down_proj.shape
    pairs = topk_weights.numel()
    assert layout.block_m == cfg.block_m and h % cfg.down_n == 0 and i % cfg.down_k == 0
    assert topk_weights.is_contiguous() and act.shape[1] == i
    y = out if out is not None else torch.empty((pairs, h), dtype=act.dtype, device=act.device)
    assert y.shape == (pairs, h) and y.is_contiguous()
    _down_kernel[(layout.max_tiles * (h // cfg.down_n),)](
        act, down_proj, topk_weights, y, layout.sorted_pairs, layout.tile_expert,
        layout.num_tiles, pairs, HID=h, INTER=i, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_n,
        BLOCK_K=cfg.down_k, SWAP_AB=cfg.swap_ab, num_warps=cfg.down_warps,
        num_stages=cfg.down_stages)
    return y


def sum_pairs(y: torch.Tensor, topk_ids: torch.Tensor, experts: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Per token the sum of its K pair rows of ``y`` ``[T * K, H]`` in float32, slot 0 first,
    skipping pairs whose id is not below ``experts``: ``[T, H]`` in ``dtype``."""
    t, k = topk_ids.shape
    h = y.shape[1]
    out = torch.empty((t, h), dtype=dtype, device=y.device)
    block = min(_SUM_BLOCK, triton.next_power_of_2(h))
    _sum_kernel[(t, triton.cdiv(h, block))](y, topk_ids, out, experts, out.stride(0), HID=h,
                                            TOP_K=k, BLOCK=block, num_warps=4)
    return out
