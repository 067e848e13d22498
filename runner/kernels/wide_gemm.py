"""Wide GEMMs with the decoder's neighbours in their epilogues, for steps of many tokens (the
batch-128 denoise step: 512 rows).

At 512 rows cuBLAS runs the 8B shapes at the matmul rate, and what costs time beside them is
the small memory-bound kernels between them: SiLU-and-mul after gate/up (12 µs a layer), the
residual add + RMSNorm after o_proj (6 µs), and a memset cuBLAS puts before its gate/up
kernel, which the GPU idles 4 µs behind (SDAR-8B batch 128: 0.43 + 0.21 + 0.15 ms a step).
Two Triton kernels take them in, the same two fusions as the skinny GEMM's (``skinny_gemm``)
with the same contract (``PreNormed``), for M >= ``MIN_M``:

* ``linear_residual`` (o_proj; ``residual_pays`` says for which shapes): ``y = x @ W.T``
  over a grid of 128 x 128 tiles (pointer loads, 5 stages), with the epilogue of the skinny
  producer: the stream ``s = residual + y``, ``scaled = s * norm_weight`` (each rounded as
  the reference rounds) and each tile's float32 partial sums of ``s²``, ``[N / 128, M]``.
* ``gate_up_silu``: the fused ``[gate; up]`` projection as one persistent program an SM
  walking 128-row x (128 gate + 128 up)-column tiles, both halves brought by one TMA load
  into one MMA; given the producer's partial sums it scales the float32 accumulator by
  ``1 / rms(s)`` (summing the partials in a fixed order) and writes ``silu(gate) * up``
  rounded once.

**Measured** (H200, 512 rows, CUDA-graph replay, weights rotated through > L2;
``bench/kernels/wide_gemm.py``; bench/NOTES.md, session 7): the plain forms of these tiles against
cuBLAS: gate/up 138.8 µs vs 136.9 (the persistent TMA form; the best non-persistent one
150.1), o_proj 25.5 vs 24.4, down 70.9 vs 68.1; qkv 43.0 vs 35.7 (its 48 column tiles leave
the grid at 1.45 waves), so qkv stays with cuBLAS. With the fusions (session 7 too): o_proj +
residual step 27.7 µs against 24.4 + 5.9 for cuBLAS and FlashInfer's add + RMSNorm; gate/up +
SiLU 134.6-152.8 µs across stage counts and machines against 136.9 + ~12 + the memset's 4; the
o_proj → MLP chain a layer 270.2 µs against 278.3 at 512 rows, 522.8 against 545.0 at 1024,
but 177.1 against 145.5 at 256 (two row tiles: 1.45 waves), hence ``MIN_M`` = 512. SDAR-8B
batch 128, back to back on one machine: 14.77 ms a step against 15.01.

**Determinism and row independence**: a fixed configuration (no autotuning), no atomics, the
K order and the partial sums' order fixed; a row's result depends only on that row (rows
past M are never stored and never enter another row's sums). The tile shapes do differ from
cuBLAS's and the skinny GEMM's, so a row is bit-identical across batch sizes only while they
stay on one side of ``MIN_M`` (as between the skinny GEMM's row tiles and cuBLAS).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dllm.runner.kernels.hardware import num_sms
from dllm.runner.kernels.skinny_gemm import residual_operands_match

__all__ = ["MIN_M", "gate_up_silu", "linear_residual", "residual_pays", "supports",
           "supports_gate_up", "supports_residual"]

# Fewest rows the wide kernels take; below, cuBLAS and the separate kernels (from 33 rows) or
# the skinny GEMM (to 32). From 256 rows the layer's chain was slower (177.1 µs against 145.5)
# and without the wide kernels the SDAR-8B batch-128 step too (15.01 ms against 14.77;
# bench/NOTES.md, session 7).
MIN_M = 512
_HALF = (torch.float16, torch.bfloat16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 128, 128, 64, 8
RESIDUAL_WARPS, RESIDUAL_STAGES = 4, 5
# The gate/up kernel's pipeline depth (``bench/kernels/wide_gemm.py`` sets it for A/B runs): 3 stages
# measured within machine-to-machine noise of 4 in session 7 and slower in session 8, in situ
# 14.55 ms a step against 14.21 and 14.43 (bench/NOTES.md).
SILU_WARPS, SILU_STAGES = 8, 4


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the column tiles together (W tiles reused in
    L2)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit(do_not_specialize=["M"])
def _residual_kernel(x_ptr, w_ptr, r_ptr, nw_ptr, s_ptr, scaled_ptr, ss_ptr, M, N, K,
                     stride_xm, K_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # N is a multiple of BLOCK_N and K of BLOCK_K (``supports_residual``); rows past M re-read
    # a valid row and are never stored.
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(K_TILES):
        acc = tl.dot(tl.load(x_ptrs), tl.trans(tl.load(w_ptrs)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The skinny producer's epilogue: y rounded as the reference stores it, the bf16 residual
    # add, the next norm's weight, and this tile's partial sums of s^2.
    row_ok = rm < M
    mask = row_ok[:, None]
    cols = rm[:, None] * N + rn[None, :]
    y = acc.to(s_ptr.dtype.element_ty).to(tl.float32)
    st = (y + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)
          ).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + cols, st, mask=mask)
    sf = st.to(tl.float32)
    nw = tl.load(nw_ptr + rn).to(tl.float32)
    tl.store(scaled_ptr + cols, (sf * nw[None, :]).to(scaled_ptr.dtype.element_ty), mask=mask)
    tl.store(ss_ptr + pid_n * M + rm, tl.sum(sf * sf, axis=1), mask=row_ok)


@triton.jit
def _gate_up_tile(x_desc, w_desc, y_ptr, ss_ptr, eps, M, N, K, stride_ym, tile,
                  K_TILES: tl.constexpr, SS_PARTS: tl.constexpr, SS_BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < M
    if SS_PARTS > 0:
        # The row scale first, so that its loads overlap the main loop's (in the epilogue
        # they cost 4-6 µs a call at 512 rows; bench/NOTES.md, session 7).
        rp = tl.arange(0, SS_BLOCK)
        ss = tl.sum(tl.load(ss_ptr + rp[:, None] * M + rm[None, :],
                            mask=(rp[:, None] < SS_PARTS) & row_ok[None, :], other=0.0),
                    axis=0)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for kt in range(K_TILES):
        a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
        # w_desc views W as [2, N, K] (its gate and up halves): one TMA load brings BLOCK_N
        # gate rows and the matching up rows, which stay in shared memory as one
        # [2 * BLOCK_N, BLOCK_K] operand of one MMA (two MMAs of BLOCK_N columns measured
        # 170-180 µs against 136 for the 8B gate/up at 512 rows; bench/NOTES.md, session 7).
        w = w_desc.load([0, pid_n * BLOCK_N, kt * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
        acc = tl.dot(a, w.T, acc)
    if SS_PARTS > 0:
        acc = acc * rstd[:, None]
    # Columns [gate | up] to two tiles: each thread holds a column and the one BLOCK_N
    # further in the MMA's layout, so this moves no data.
    gate, up = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit(do_not_specialize=["M", "tiles"])
def _gate_up_kernel(x_desc, w_desc, y_ptr, ss_ptr, eps, M, N, K, stride_ym, tiles,
                    PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                    K_TILES: tl.constexpr, SS_PARTS: tl.constexpr, SS_BLOCK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    # W is [gate; up], 2N rows, N a multiple of BLOCK_N: each tile multiplies by BLOCK_N gate
    # rows and the matching up rows (w_desc: W as [2, N, K]). SS_PARTS > 0: x is s * norm_weight (rounded) and ss the
    # producer's [SS_PARTS, M] partial sums of s^2. ``tiles``: ceil(M / BLOCK_M) * N / BLOCK_N.
    # PERSISTENT (the GPU): program p takes the tiles p, p + NUM_PROGRAMS, ... (NUM_PROGRAMS:
    # the SM count; the grid is that or fewer), and Triton pipelines the loads across tile
    # boundaries; else (the interpreter, which cannot loop to a run-time bound) one program a
    # tile.
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
            _gate_up_tile(x_desc, w_desc, y_ptr, ss_ptr, eps, M, N, K, stride_ym, tile,
                          K_TILES, SS_PARTS, SS_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _gate_up_tile(x_desc, w_desc, y_ptr, ss_ptr, eps, M, N, K, stride_ym,
                      tl.program_id(0), K_TILES, SS_PARTS, SS_BLOCK, BLOCK_M, BLOCK_N,
                      BLOCK_K, GROUP_M)


def _on_device(x: torch.Tensor) -> bool:
    return x.is_cuda or (_INTERPRET and x.device.type == "cpu")


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the wide kernels take ``x [M, K] @ weight.T``: M >= ``MIN_M``, half precision,
    no bias, K a multiple of the K tile, x rows and the weight contiguous and aligned."""
    return (_on_device(x) and bias is None and x.dim() == 2 and weight.dim() == 2
            and x.shape[0] >= MIN_M and x.dtype in _HALF and weight.dtype == x.dtype
            and x.device == weight.device and x.shape[1] == weight.shape[1]
            and x.shape[1] % BLOCK_K == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0)


def supports_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether ``linear_residual`` takes these tensors."""
    return (supports(x, weight, bias) and weight.shape[0] % BLOCK_N == 0
            and residual_operands_match(x, weight, residual, norm_weight))


def residual_pays(n: int, k: int) -> bool:
    """Whether ``linear_residual`` beats cuBLAS + the separate add + RMSNorm for an ``[n, k]``
    weight in the decoder: for o_proj (K = N; its consumer, gate/up, finishes the norm in its
    epilogue) 27.7 µs against 24.4 + 5.9; not for down (K = 3N; its consumer, q/k/v, stays
    with cuBLAS and needs a plain RMSNorm of the stream): 72.3 + 4.0 against 68.1 + 5.9 (8B
    shapes at 512 rows, bench/NOTES.md, session 7)."""
    return k <= n


def supports_gate_up(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     sum_sq: torch.Tensor | None = None) -> bool:
    """Whether ``gate_up_silu`` takes these tensors (``sum_sq``: a ``linear_residual``'s
    partial sums for ``x``'s rows)."""
    return (supports(x, weight, bias) and weight.shape[0] % (2 * BLOCK_N) == 0
            and x.is_contiguous()
            and (sum_sq is None or (sum_sq.dim() == 2 and sum_sq.shape[1] == x.shape[0]
                                    and sum_sq.dtype == torch.float32
                                    and sum_sq.is_contiguous() and sum_sq.device == x.device)))


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    norm_weight: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``skinny_linear_residual``'s contract for many rows: ``y = x @ weight.T`` (rounded),
    the stream ``s = residual + y`` (rounded), ``scaled = s * norm_weight`` (rounded) and the
    float32 partial sums of ``s²``, ``[N / 128, M]``. Returns ``(s, scaled, sum_sq)``; check
    ``supports_residual`` first."""
    m, k = x.shape
    n = weight.shape[0]
    stream = torch.empty((m, n), dtype=x.dtype, device=x.device)
    scaled = torch.empty((m, n), dtype=x.dtype, device=x.device)
    sum_sq = torch.empty((n // BLOCK_N, m), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M) * (n // BLOCK_N),)
    _residual_kernel[grid](x, weight, residual, norm_weight, stream, scaled, sum_sq, m, n, k,
                           x.stride(0), K_TILES=k // BLOCK_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                           BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=RESIDUAL_WARPS,
                           num_stages=RESIDUAL_STAGES)
    return stream, scaled, sum_sq


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, sum_sq: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` of SwiGLU's fused ``[gate; up]`` weight (``2N`` rows): ``[M, N]``,
    rounded once from float32. With ``sum_sq`` (and ``eps``), x is a ``linear_residual``'s
    ``scaled`` and the result is that of ``rms_norm(s) * norm_weight``. Check
    ``supports_gate_up`` first."""
    m, k = x.shape
    n = weight.shape[0] // 2
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor(weight, [2, n, k], [n * k, k, 1], [2, BLOCK_N, BLOCK_K])
    tiles = triton.cdiv(m, BLOCK_M) * (n // BLOCK_N)
    # One program an SM, or one a tile where there are fewer tiles; the loop's stride is the
    # SM count whatever the grid (a program then takes one tile), so that a token count
    # never compiles a variant of its own. The interpreter: one program a tile.
    stride = 1 if _INTERPRET else num_sms(x.device)
    programs = tiles if _INTERPRET else min(tiles, stride)
    parts = 0 if sum_sq is None else sum_sq.shape[0]
    _gate_up_kernel[(programs,)](
        x_desc, w_desc, y, sum_sq if sum_sq is not None else y, eps, m, n, k, y.stride(0),
        tiles, PERSISTENT=not _INTERPRET, NUM_PROGRAMS=stride, K_TILES=k // BLOCK_K,
        SS_PARTS=parts, SS_BLOCK=max(2, triton.next_power_of_2(parts)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=SILU_WARPS, num_stages=SILU_STAGES)
    return y
