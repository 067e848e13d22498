"""Skinny GEMM for small token counts: ``y = x @ W.T (+ bias)`` with x ``[M, K]``, M <= 64.

At batch 1 a denoise step multiplies 1-32 activation rows by every weight matrix, so each
GEMM is bound by reading W (``N * K * 2`` bytes) once from HBM; the arithmetic is tiny. cuBLAS
picks tiles made for larger M and reaches only ~2.5-3.5 TB/s on the 8B model's qkv, o_proj
and down shapes (H200 copy ceiling ~4.3 TB/s). This kernel is built to stream W:

* **One program per (BLOCK_N slice of output columns, K split).** It reads its
  ``[BLOCK_N, K / SPLIT_K]`` slab of W once, in ``[BLOCK_N, BLOCK_K]`` tiles that are
  contiguous along K (16-byte vector loads; the row stride is K, a multiple of 16), and
  produces those columns for *all* M rows. x is at most 64 x K and is re-read by every
  program from L1/L2, never from HBM in the steady state.
* **Tensor cores with M padded to 16** (past 16 rows: to 32 or 64). ``tl.dot`` needs
  every dimension >= 16, so x is loaded as a ``[16, BLOCK_K]`` tile with the rows >= M masked
  to zero. With ``SWAP_AB`` the product is formed as ``W_tile @ x_tile.T`` (``[BLOCK_N, 16]``):
  the large operand is the MMA's M side, which lets Triton use Hopper's wgmma for
  BLOCK_N >= 64. A broadcast multiply
  + ``tl.sum`` on the CUDA cores was rejected: at M = 16 it costs ``2 * 16 * N * K`` fp32 FMAs,
  about the same time as the weight read itself on an H200 (67 TFLOP/s fp32), and using it only
  for small M would make a row's result depend on the batch size (see below).
* **Software pipelining** (``num_stages``) keeps several W tiles (~32-64 KB) in flight per
  program; narrow tiles (BLOCK_N = 32) give o_proj / down 128 programs and qkv 192.
* **Split-K without atomics** (available, ``split_k > 1``): each split writes float32 partials
  ``[SPLIT_K, M, N]`` and a small second kernel sums them in the fixed order s = 0, 1, ...,
  adds the bias and rounds once. On the H200 it never beat the unsplit kernel by more than
  the noise (the second launch costs what the fuller grid gains), so the table does not use it.

**Measured** (H200, bf16, CUDA-graph replay, weights rotated through > L2; see ``CONFIGS``):
gate_up 4.1 TB/s and lm_head 4.4 TB/s (at the copy ceiling), down 3.7 TB/s (1.03-1.10x
cuBLAS), o_proj 2.85 TB/s (1.05-1.09x), qkv 3.1 TB/s (0.94-0.98x cuBLAS, i.e. a tie within
~0.5 us). Every shape pays a roughly fixed ~4 us per launch (ramp-up of the first loads and the
tail) over its bytes / 4.4 TB/s, which is what keeps the 34-50 MB shapes near 3 TB/s; tile
shape, stages and split-K do not move it. A whole batch-1 step's chain of these GEMMs
(``bench/kernels/layer_chain.py``, 36 layers, fused epilogues) runs at 1.14x its bytes at the copy
ceiling. Starting the next kernel's weight stream early does not hide that share: with
programmatic dependent launch (``pdl``) letting the next kernel launch at a program's start
or once its input is ready, the chain took 1.54-1.61x (the waiting programs of the next
kernel hold SM slots the running one needs), and after the main loop 1.15-1.20x, with 0-16
MB of each weight prefetched into L2 and with an ``evict_first`` policy on the weights alike
(bench/NOTES.md, session 6); ``evict_first`` alone changes nothing (1.143x).

**Determinism and row independence.** There are no atomics and no run-time autotuning: the
configuration comes from a fixed table keyed on the device's compute capability, (N, K) and
the row tile only (``CONFIGS`` for the 16-row tile, with a default heuristic for shapes not in
it; ``ROW_TILES`` for the 32- and 64-row ones), so the tiling, the K order and the split
reduction are the same for every M of a tile and every process on a device. The kernel is compiled once per
configuration and tile, not per M (M is
not specialised), and row m's outputs depend only on row m of x: the padded rows are zeros that
the MMA never mixes into other rows. So the same inputs give bit-identical outputs, and a row's
output is bit-identical whether it is computed alone or in a batch of up to 16 (and, within
the 32-row tile, in a batch of 17 to 32, within the 64-row tile in one of 33 to 64; across
tiles the MMA's N width, and the configuration, differ).

The hot path is launch-only (one ``torch.empty`` for the output, one for the split-K partials),
with no host syncs or data-dependent host logic, so it can be captured in a CUDA graph.

**Fused neighbours.** The pre-norm decoder's residual step (``s = residual + y``, then
RMSNorm(s)) and SwiGLU's ``silu(gate) * up`` ride in the projections around them, with the
main loop left as it is (only loads and MMAs): the projection *before* the norm
(``skinny_linear_residual``, o_proj or down) adds the residual in its epilogue, multiplies by
the next norm's weight and writes each program's partial sums of ``s²``; the projection
*after* it (``skinny_linear(..., sum_sq=)``, q/k/v or gate/up) sums those partials in a fixed
order and scales its float32 accumulator by ``1 / rms(s)`` at the end; with ``silu`` it
streams its gate rows and the matching up rows and writes ``silu(gate) * up``. At batch 1 that
removes three of a layer's ten launches (two add + RMSNorm kernels and the SiLU kernel).
Measured per call on the 8B shapes at 1-4 tokens (bench/NOTES.md, session 5): the
producer epilogue costs 0.7-1.3 µs over the plain kernel, the consumer's 0.4-1.2 µs, SiLU at
64 + 64 rows 0.9 µs (at 32 + 32 rows, mma.sync instead of wgmma, 8.5 µs); in the SDAR-8B batch-1
step, 5.05 → 4.68 ms together with the one-launch ``position_uniform``.

Work in the K loop is what must not be added: a first version normalised x tile by tile
inside the loop (the sum of squares, the norm weight, the residual add) and took qkv from 15.5
to 57 µs and gate/up from 49.5 to 78 µs (181 with SiLU) (bench/NOTES.md, session 5),
like an earlier attempt to form SiLU-and-mul in the down projection's K loop (57-133 µs
against 27 + 4-8 µs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dllm.runner.kernels.hardware import num_sms, tuned

__all__ = ["CONFIGS", "ROW_TILES", "ROWS32", "ROWS64", "SILU_CONFIGS", "SILU_ROWS32",
           "SILU_ROWS64", "SkinnyConfig", "config_for", "residual_operands_match", "silu_fused",
           "skinny_linear", "skinny_linear_residual", "supports", "supports_residual"]

# Rows the kernel takes: 1-16 in a 16-row tile, 17-32 (a full-attention model's 32-token dual
# window, SDAR's batch 8 at block 4) in a 32-row one, 33-64 (the dual window at batch 2, the
# prefix cache's 64-token window) in a 64-row one (``_block_m``). Past 16 rows ``supports``
# takes only the weight shapes of that tile's table (``ROW_TILES``); a benchmark sets
# ``MAX_M = 16`` or ``32`` for its A/B runs, or raises it to sweep a 128-row tile: at 96 and
# 128 rows cuBLAS was as fast or faster on every 8B and Dream-7B shape but one
# (``skinny-gemm-20261203-060159``: the best configurations 0.75-1.04x its speed; the one
# win, the 8B o_proj at 96 rows, needs a K split, which the residual step cannot take).
MAX_M = 64
_HALF = (torch.float16, torch.bfloat16)
# Under TRITON_INTERPRET=1 the kernels run on CPU tensors (numpy); used by the tests only.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = True

    def label(self) -> str:
        return (f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}"
                f"st{self.num_stages}{'T' if self.swap_ab else 'N'}")


# Compute capability -> (N, K) -> configuration (``hardware.tuned``: a device without an entry
# takes the H200's). Keyed on the weight's shape only: never on M (row independence).
# sm_90 from `bench/kernels/skinny_gemm.py --sweep --lm-head --tokens 1,4,8,16` on an H200 (torch 2.11,
# triton 3.6; bench/NOTES.md, session 4): the config with the least total time over M = 1, 4,
# 8, 16 out of 53-87 candidates per shape. Split-K never won by more than the run-to-run noise
# (~0.3 us).
CONFIGS: dict[tuple[int, int], dict[tuple[int, int], SkinnyConfig]] = {
    (9, 0): {
        (6144, 4096): SkinnyConfig(32, 256, 1, 4, 4),  # qkv    ~16.2 us, 3.1 TB/s (cuBLAS 15.5)
        (4096, 4096): SkinnyConfig(32, 512, 1, 4, 3),  # o_proj ~11.8 us, 2.9 TB/s (cuBLAS 12.6)
        (24576, 4096): SkinnyConfig(64, 128, 1, 4, 6),  # gate_up ~49.5 us, 4.1 TB/s (cuBLAS 50.4)
        (4096, 12288): SkinnyConfig(32, 512, 1, 4, 3),  # down  ~27.2 us, 3.7 TB/s (cuBLAS 29.4)
        (151936, 4096): SkinnyConfig(128, 128, 1, 8, 2),  # lm_head ~281 us, 4.4 TB/s (cuBLAS 299)
    },
}

# Compute capability -> (2N, K) of a fused [gate; up] weight -> the configuration of
# ``skinny_linear(silu=True)``, BLOCK_N counting the rows of each half. Where none is listed,
# ``silu_fused`` is False: on the H200 the two-accumulator kernel at the halved table tile
# (32 + 32 rows, mma.sync) measured 57.9 µs against 49.5 + ~4 for the plain kernel and a
# separate SiLU kernel; 64 + 64 rows (wgmma) runs at the plain kernel's speed (bench/NOTES.md,
# session 5).
SILU_CONFIGS: dict[tuple[int, int], dict[tuple[int, int], SkinnyConfig]] = {
    (9, 0): {
        # gate_up of the 8B shapes: 50.3 µs against 49.4 plain (bench/NOTES.md, session 5)
        (24576, 4096): SkinnyConfig(64, 128, 1, 4, 3),
    },
}

# The same for the 32-row tile (17-32 rows; the shape must also be in ``ROWS32``). From
# ``bench/kernels/skinny_gemm.py --fused --tokens 32 --silu-configs ...`` on the H200
# (bench/NOTES.md, session 18): the 8B gate/up 52.9 µs (the 16-row tile's 3 stages: 56.1;
# plain 50.7, plus a separate SiLU kernel of ~4 µs and its launch gap); Dream-7B's 68.5
# (plain 68.4).
SILU_ROWS32: dict[tuple[int, int], dict[tuple[int, int], SkinnyConfig]] = {
    (9, 0): {
        (24576, 4096): SkinnyConfig(64, 128, 1, 4, 4),
        (37888, 3584): SkinnyConfig(128, 64, 1, 8, 3),
    },
}


# Compute capability -> the (N, K) weight shapes the kernel takes at 17-32 rows -> the
# configuration of their 32-row tile (a tile of its own: its bits already differ from the
# 16-row tile's). At 24-32 rows on the H200 (``bench/kernels/skinny_gemm.py --tokens 16,24,32``;
# bench/NOTES.md, session 17) cuBLAS wins on qkv (15.8 µs against 18.7) and down (28.6
# against 30.4) at the 16-row tile's configuration and so keeps them, with the separate add +
# RMSNorm after down; o_proj (12.7 against 13.1) and gate/up (50.6 against 49.1, which its
# fused SiLU-and-mul and norm repay) run here, with the residual step after o_proj in the
# epilogues. LLaDA-8B's dual-cache step (bench/engine/full_attention.py, 32 rows a forward):
# 5.07 ms with these two shapes here, 5.10 with cuBLAS past 16 rows (back to back on one
# machine), 5.23 with every shape here up to 32 rows.
ROWS32: dict[tuple[int, int], dict[tuple[int, int], SkinnyConfig]] = {
    (9, 0): {
        (4096, 4096): SkinnyConfig(32, 512, 1, 4, 3),  # o_proj
        (24576, 4096): SkinnyConfig(64, 128, 1, 4, 6),  # gate_up
        # `--sweep --tokens 32` (bench/NOTES.md, session 18): LLaDA-8B's q/k/v 27.0 µs against
        # cuBLAS's 28.7; Dream-7B's gate/up 68.9 against 73.5 (with SiLU: SILU_ROWS32). Dream's
        # o_proj alone is slower (12.3 against 11.4 with cuBLAS's split-K reduction) but
        # carries the residual step, which saves the add + RMSNorm kernel: Dream-7B's dual
        # step 4.78 ms with it against 4.83 without, back to back. Dream's q/k/v and down stay
        # on cuBLAS (11.5 and 38.9 against 13.8 and 38.8 at their best split).
        (12288, 4096): SkinnyConfig(64, 128, 1, 4, 4),  # LLaDA-8B qkv
        (37888, 3584): SkinnyConfig(64, 128, 1, 4, 4),  # Dream-7B (Qwen2-7B) gate_up
        (3584, 3584): SkinnyConfig(32, 256, 1, 8, 4),  # Dream-7B o_proj
    },
}


# The 64-row tile (33-64 rows; LLaDA-8B's dual window at batch 2, the prefix cache's 64-token
# window, SDAR-8B's batch 16 at block 4). ``bench/kernels/skinny_gemm.py --sweep --tokens 48,64``
# (``skinny-gemm-20261203-060115``): the least total time over 48 and 64 rows, unsplit where
# the residual step rides the epilogue (it needs whole rows). At these rows the kernel ties
# cuBLAS within ~1-2 µs (0.87-1.07x), so a shape is listed where its fused neighbours repay
# it (``skinny-fused-20261203-060959``, 64 rows, µs against cuBLAS): the 8B o_proj with the
# residual step 13.6 against 12.6 plus an add + RMSNorm kernel (~3.2), gate/up with the norm
# and SiLU 54.3 against 52.1 plus the norm and a SiLU kernel (~3.6), down with the residual
# step 32.8 against 31.5 (its norm then rides LLaDA-8B's q/k/v: 29.1 against 28.6; SDAR-8B's
# and Qwen3-8B's q/k/v, 6144 x 4096, was not swept at 64 rows and stays with cuBLAS, which
# then takes the norm from the stream: ~1 µs a layer lost there); Dream-7B's o_proj 11.4
# against 10.0 and gate/up with the norm 72.0 against 74.8 (its SiLU stays a kernel: with
# SiLU the best configuration took 77.9 without the norm, against 70.7 plain). Dream-7B's
# q/k/v (13.5 against 11.8) and down (45.0 against 40.4) stay with cuBLAS, as at 32 rows.
ROWS64: dict[tuple[int, int], dict[tuple[int, int], SkinnyConfig]] = {
    (9, 0): {
        (4096, 4096): SkinnyConfig(32, 128, 1, 4, 5, False),  # o_proj
        (24576, 4096): SkinnyConfig(64, 64, 1, 4, 4),  # gate_up
        (4096, 12288): SkinnyConfig(32, 128, 1, 4, 5, False),  # down
        (12288, 4096): SkinnyConfig(128, 128, 1, 4, 4),  # LLaDA-8B qkv
        (3584, 3584): SkinnyConfig(32, 128, 1, 4, 5, False),  # Dream-7B o_proj
        (37888, 3584): SkinnyConfig(128, 64, 1, 4, 3),  # Dream-7B gate_up
    },
}
SILU_ROWS64: dict[tuple[int, int], dict[tuple[int, int], SkinnyConfig]] = {
    (9, 0): {
        (24576, 4096): SkinnyConfig(64, 64, 1, 4, 4),
    },
}

# Row tile past 16 rows -> the tables of the weight shapes the kernel takes at that tile
# (plain, SiLU); a tile not listed takes no shape.
ROW_TILES = {32: (ROWS32, SILU_ROWS32), 64: (ROWS64, SILU_ROWS64)}


def _tile_table(m: int, silu: bool, device: torch.device | str | None
                ) -> dict[tuple[int, int], SkinnyConfig]:
    """The (N, K) -> configuration table of ``m`` rows' tile on ``device`` (plain or SiLU):
    the 16-row tile's up to 16 rows (``CONFIGS`` / ``SILU_CONFIGS``), else ``ROW_TILES``'
    entry, empty for a tile it does not list."""
    tile = _block_m(m)
    if tile == 16:
        return tuned(SILU_CONFIGS if silu else CONFIGS, device)
    tables = ROW_TILES.get(tile)
    return {} if tables is None else tuned(tables[silu], device)


def _silu_config(rows: int, k: int, device: torch.device | None, m: int
                 ) -> SkinnyConfig | None:
    return _tile_table(m, True, device).get((rows, k))


def silu_fused(rows: int, k: int, device: torch.device | None = None, m: int = 1) -> bool:
    """Whether SiLU-and-mul in the gate/up GEMM's epilogue is measured to beat a separate
    kernel for this weight shape at ``m`` rows of x (on ``device``; None: the reference
    device)."""
    return _silu_config(rows, k, device, m) is not None


def _block_m(m: int) -> int:
    """The MMA's padded row count for ``m`` rows: 16 up to 16 rows, else the next power of
    two (32 or 64 within ``MAX_M``)."""
    return 16 if m <= 16 else 1 << (m - 1).bit_length()


def _halved(cfg: SkinnyConfig) -> SkinnyConfig:
    return SkinnyConfig(max(16, cfg.block_n // 2), cfg.block_k, 1, cfg.num_warps,
                        cfg.num_stages, cfg.swap_ab)


def _default(n: int, k: int, sms: int) -> SkinnyConfig:
    """Shapes not in the table: what the sweep favoured (no split, ~32-64 KB of W in flight
    per program), with K split only when the grid would leave most of the ``sms`` SMs idle."""
    block_n = 32 if n <= 16384 else (64 if n <= 65536 else 128)
    block_k = 256 if k % 256 == 0 else (128 if k % 128 == 0 else 64)
    stages = max(2, min(6, 65536 // (block_n * block_k * 2)))
    split = 1
    while (triton.cdiv(n, block_n) * split < sms // 2 and k % (block_k * split * 2) == 0
           and k // (block_k * split * 2) >= 8):
        split *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split,
                        num_warps=8 if block_n == 128 else 4, num_stages=stages)


def config_for(n: int, k: int, device: torch.device | None = None, rows: int = 1
               ) -> SkinnyConfig:
    """The configuration for an ``[n, k]`` weight on ``device`` (None: the reference device)
    at ``rows`` rows of x: the 16-row tile's up to 16 rows, past that the row tile's
    (``ROW_TILES``; the 16-row tile's configuration where that has no entry)."""
    cfg = _tile_table(rows, False, device).get((n, k)) or tuned(CONFIGS, device).get((n, k))
    return cfg if cfg is not None else _default(n, k, num_sms(device))


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``skinny_linear(x, weight, bias)`` handles these tensors."""
    ok_device = x.is_cuda or (_INTERPRET and x.device.type == "cpu")
    return (ok_device and x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_M
            and (x.shape[0] <= 16
                 or tuple(weight.shape) in _tile_table(x.shape[0], False, x.device))
            and x.dtype in _HALF and weight.dtype == x.dtype and x.device == weight.device
            and x.shape[1] == weight.shape[1] and x.shape[1] % 16 == 0 and x.stride(1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]
                                  and bias.device == x.device and bias.is_contiguous())))


@triton.jit(do_not_specialize=["M", "stride_ps"])
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ss_in_ptr, r_ptr, nw_ptr, s_ptr, ss_out_ptr,
                   eps, M, N, K, stride_xm, stride_wn, stride_om, stride_ps,
                   K_TILES: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                   EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                   SS_PARTS: tl.constexpr, SS_BLOCK: tl.constexpr, SILU: tl.constexpr,
                   RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
                   W_EVICT: tl.constexpr = "", TRIGGER: tl.constexpr = 0):
    # SS_PARTS > 0 (consumer of a fused residual step): x is s * norm_weight, rounded, and
    # ss_in holds [SS_PARTS, BLOCK_M] float32 partial sums of s^2; the accumulator is scaled
    # by 1 / rms(s) before the bias.
    # SILU: W has 2N rows [gate; up]; the program multiplies by both halves and writes
    # silu(gate) * up, N columns.
    # RESIDUAL (producer): instead of y, write the stream s = y + r and s * nw (both rounded)
    # and this program's partial sums of s^2 over its columns, ss_out[pid_n, :].
    # The main loop is the plain kernel's in every case: nothing but loads and MMAs.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ld = rn % N  # tail columns re-read a valid row; their results are not stored
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_k * (K_TILES * BLOCK_K)
    if PDL:
        # Programmatic dependent launch: this grid may start while the kernel that writes x
        # is still running. The weights do not depend on it, so pull the first
        # PREFETCH_LINES 128-byte lines of each of this program's rows into L2 now, and wait
        # for x's producer only before reading x; TRIGGER says when the next kernel may
        # launch.
        if PREFETCH_LINES > 0:
            lines = k0 + tl.arange(0, PREFETCH_LINES) * 64  # within the row: at most its length
            pf = w_ptr + rn_ld[:, None] * stride_wn + lines[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pf],
                                      dtype=tl.int32, is_pure=False, pack=1)
        if TRIGGER == 0:
            gdc_launch_dependents()
        gdc_wait()
        if TRIGGER == 1:
            gdc_launch_dependents()
    w_ptrs = w_ptr + rn_ld[:, None] * stride_wn + (k0 + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :]
    m_mask = rm[:, None] < M
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for kt in range(K_TILES):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy=W_EVICT)
            if SILU:
                w_up = tl.load(w_ptrs + N * stride_wn, eviction_policy=W_EVICT)
            xm = m_mask
        else:
            k_ok = (k0 + kt * BLOCK_K + rk) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy=W_EVICT)
            if SILU:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[None, :], other=0.0,
                               eviction_policy=W_EVICT)
            xm = m_mask & k_ok[None, :]
        x = tl.load(x_ptrs, mask=xm, other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
            if SILU:
                acc_up = tl.dot(w_up, tl.trans(x), acc_up)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
            if SILU:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL and TRIGGER == 2:
        gdc_launch_dependents()
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        acc_up = tl.trans(acc_up)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:
        p_ptrs = out_ptr + pid_k * stride_ps + rm[:, None] * N + rn[None, :]
        tl.store(p_ptrs, acc, mask=mask)
    else:
        if SS_PARTS > 0:
            rp = tl.arange(0, SS_BLOCK)
            ss = tl.sum(tl.load(ss_in_ptr + rp[:, None] * BLOCK_M + rm[None, :],
                                mask=rp[:, None] < SS_PARTS, other=0.0), axis=0)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if SILU:
                acc_up += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if RESIDUAL:
            # y rounded as the reference stores it, then the reference's bf16 residual add
            y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            cols = rm[:, None] * N + rn[None, :]
            st = (y + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                  ).to(out_ptr.dtype.element_ty)
            tl.store(s_ptr + cols, st, mask=mask)
            sf = tl.where(mask, st.to(tl.float32), 0.0)  # the bias reaches masked rows
            nw = tl.load(nw_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols, (sf * nw[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(ss_out_ptr + pid_n * BLOCK_M + rm, tl.sum(sf * sf, axis=1))
        else:
            o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "stride_ps"])
def _reduce_kernel(p_ptr, b_ptr, out_ptr, M, N, stride_ps, stride_om, HAS_BIAS: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (BLOCK columns, row); sums the splits in the fixed order 0..SPLIT_K-1.
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rn = pid * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * stride_ps + m * N + rn, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


_REDUCE_BLOCK = 1024
# The PDL variants below were measured (bench/NOTES.md, session 6) and lost to the plain
# launch; they stay constants that ``bench/kernels/layer_chain.py`` sets for its A/B runs.
# Bytes of a weight matrix prefetched into L2 under ``pdl``: well inside the H200's 50 MB L2,
# so the lines are still there when the main loop reads them (0: PDL without the prefetch;
# 0-16 MB measured alike).
PREFETCH_BYTES = 16 * 2**20
# The weights' L2 eviction policy ("", "evict_first", "evict_last"), for measurements: each
# weight is read once a step, but "evict_first" measured no change (1.143x vs 1.138x the
# bytes for the batch-1 GEMM chain).
W_EVICT = ""
# Under ``pdl``, where a program lets the next kernel launch: 0 at its start (before it waits
# for its own input), 1 once its input is ready, 2 after its main loop (only the epilogue left;
# the least slow of the three: 4.66 ms against 5.49 for 1 and 4.65 without PDL, SDAR-8B
# batch 1).
PDL_TRIGGER = 2


def _prefetch_lines(n: int, k: int) -> int:
    """128-byte lines per weight row to prefetch (a power of two, at most the row)."""
    lines = min(PREFETCH_BYTES // (n * 128), triton.cdiv(k * 2, 128))
    return 0 if lines < 1 else 1 << (lines.bit_length() - 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: SkinnyConfig | None = None, out: torch.Tensor | None = None,
                  pdl: bool = False, sum_sq: torch.Tensor | None = None, eps: float = 0.0,
                  silu: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with 1 <= M <= MAX_M (check ``supports``
    first). Float32 accumulation, output in x's dtype. ``config`` overrides the (N, K) table
    (benchmarks); ``out`` is written in place if given (tests poison it). ``pdl``: launch
    with programmatic dependent launch (Hopper and newer), streaming the first lines of each
    weight row (``PREFETCH_BYTES`` in all) into L2 before waiting for the kernel that writes
    ``x`` (the unsplit kernel only; slower than without, see the module notes).

    ``sum_sq`` (with ``eps``): x is the ``scaled`` output of ``skinny_linear_residual`` and
    ``sum_sq`` its partial sums; the result is ``F.linear(rms_norm(s) * norm_weight, ...)``.
    ``silu``: the weight is SwiGLU's fused ``[gate; up]`` (``2N`` rows) and the result is
    ``silu(gate) * up`` (``N`` columns), rounded once from float32."""
    m, k = x.shape
    rows = weight.shape[0]
    n = rows // 2 if silu else rows
    assert 1 <= m <= MAX_M, f"skinny GEMM takes 1..{MAX_M} rows, got {m}"
    assert weight.shape[1] == k and k % 16 == 0 and weight.stride(1) == 1 and x.stride(1) == 1
    if config is not None:
        cfg = config  # with silu: BLOCK_N rows of gate and as many of up per program
    elif silu:
        cfg = _silu_config(rows, k, x.device, m) or _halved(config_for(rows, k, x.device, m))
    else:
        cfg = config_for(rows, k, x.device, m)
    if silu or sum_sq is not None:
        cfg = _unsplit(cfg)
    out = _output(out, m, n, x)
    split = cfg.split_k
    if split == 1:
        _launch(x, weight, bias, out, cfg, pdl=pdl, n=n, sum_sq=sum_sq, eps=eps, silu=silu)
        return out
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _launch(x, weight, bias, part, cfg, partial=True)
    _reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
        part, bias if bias is not None else out, out, m, n, m * n, out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=_REDUCE_BLOCK, num_warps=4)
    return out


def supports_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear_residual`` handles these tensors."""
    return supports(x, weight, bias) and residual_operands_match(x, weight, residual, norm_weight)


def residual_operands_match(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                            norm_weight: torch.Tensor) -> bool:
    """The residual step's operands of a projection ``x @ weight.T`` (this module's and
    ``wide_gemm``'s): ``residual`` ``[M, N]`` and ``norm_weight`` ``[N]``, contiguous, on x's
    device in x's dtype."""
    n = weight.shape[0]
    return (residual.shape == (x.shape[0], n) and residual.dtype == x.dtype
            and residual.device == x.device and residual.is_contiguous()
            and norm_weight.shape == (n,) and norm_weight.dtype == x.dtype
            and norm_weight.device == x.device and norm_weight.is_contiguous())


def skinny_linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           residual: torch.Tensor, norm_weight: torch.Tensor, *,
                           config: SkinnyConfig | None = None, pdl: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection that ends in the pre-norm decoder's residual step, with the next RMSNorm
    half done: ``y = F.linear(x, weight, bias)`` (rounded), the stream ``s = residual + y``
    (rounded), ``scaled = s * norm_weight`` (rounded) and the float32 partial sums of ``s²``,
    ``[programs, 16]`` (one row per program's columns, 16 token slots; past 16 rows the row
    tile's). Returns ``(s, scaled, sum_sq)``; ``skinny_linear(scaled, ..., sum_sq=sum_sq, eps=...)`` then
    finishes the norm (``1 / rms(s)`` from the partials, in a fixed order) in its epilogue.
    The reference rounds ``s / rms(s)`` instead; the two agree within the dtype's rounding.
    Check ``supports_residual`` first."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_M and weight.shape[1] == k and k % 16 == 0
    cfg = _unsplit(config if config is not None else config_for(n, k, x.device, m))
    stream = torch.empty((m, n), dtype=x.dtype, device=x.device)
    scaled = torch.empty((m, n), dtype=x.dtype, device=x.device)
    sum_sq = torch.empty((triton.cdiv(n, cfg.block_n), _block_m(m)), dtype=torch.float32,
                         device=x.device)
    _launch(x, weight, bias, scaled, cfg, pdl=pdl,
            residual=(residual, norm_weight, stream, sum_sq))
    return stream, scaled, sum_sq


def _unsplit(cfg: SkinnyConfig) -> SkinnyConfig:
    """The epilogues that need a whole output row's K reduction run unsplit."""
    return cfg if cfg.split_k == 1 else SkinnyConfig(cfg.block_n, cfg.block_k, 1,
                                                     cfg.num_warps, cfg.num_stages, cfg.swap_ab)


def _output(out: torch.Tensor | None, m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1 and out.dtype == x.dtype
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, cfg: SkinnyConfig, *, pdl: bool = False, partial: bool = False,
            n: int | None = None, sum_sq: torch.Tensor | None = None, eps: float = 0.0,
            silu: bool = False,
            residual: tuple[torch.Tensor, ...] | None = None) -> None:
    """One launch of ``_skinny_kernel`` over ``N / BLOCK_N`` x ``split_k`` programs; ``out``
    is the float32 ``[split_k, M, N]`` partials when ``partial``. ``residual`` is
    ``(residual, norm_weight, stream, sum_sq_out)`` of ``skinny_linear_residual``."""
    m, k = x.shape
    n = weight.shape[0] if n is None else n
    split = cfg.split_k
    k_tiles = triton.cdiv(triton.cdiv(k, split), cfg.block_k)  # per split
    pdl = pdl and not partial and not _INTERPRET
    lines = _prefetch_lines(weight.shape[0], k) if pdl else 0
    r, nw, s, ss_out = residual if residual is not None else (out,) * 4  # never read then
    parts = 0
    if sum_sq is not None:
        parts = sum_sq.shape[0]
        assert sum_sq.shape[1] == _block_m(m) and sum_sq.dtype == torch.float32
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, bias if bias is not None else out, out,
        sum_sq if sum_sq is not None else out, r, nw, s, ss_out,
        eps, m, n, k, x.stride(0), weight.stride(0), 0 if partial else out.stride(0),
        m * n if partial else 0, K_TILES=k_tiles, HAS_BIAS=bias is not None, PARTIAL=partial,
        EVEN_K=k_tiles * cfg.block_k * split == k, SWAP_AB=cfg.swap_ab, BLOCK_M=_block_m(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH_LINES=lines, SS_PARTS=parts,
        SS_BLOCK=triton.next_power_of_2(parts), SILU=silu, RESIDUAL=residual is not None,
        PDL=pdl, W_EVICT=W_EVICT, TRIGGER=PDL_TRIGGER, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl)
