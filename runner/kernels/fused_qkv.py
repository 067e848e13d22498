"""Fused Triton kernels for the small per-layer steps around attention (GPU; Triton imported
lazily by whoever imports this module, like ``dllm.runner.layer_ops``).

At batch 1 the per-layer path between the q/k/v GEMM and attention is five tiny kernels, each
a few microseconds of mostly launch gap: q head RMSNorm, k head RMSNorm, RoPE of q and k, and
the two ``index_put`` of K and V into the paged cache. This module does the same work in one
or two launches:

- ``qk_norm_rope``: per-head RMSNorm (optional: models without qk-norm pass ``None`` weights)
  and RoPE of q and k, read straight from the fused projection output ``qkv``
  ``[T, (H + 2·Hkv)·D]``, written to new contiguous ``q`` ``[T, H, D]`` and ``k``
  ``[T, Hkv, D]``. One launch for q and k together.
- ``store_kv``: both cache writes ``k_buf[loc] = k; v_buf[loc] = v`` in one launch (``k``/``v``
  may be strided views, e.g. the V column slice of ``qkv``).
- ``qk_norm_rope_store``: the two above as one launch. The rotated K and the V slice go
  straight into ``k_buf``/``v_buf`` at ``loc``; only ``q`` is returned (attention reads K back
  from the cache, where it would read it anyway).

Design. The grid is ``(T, groups)``: program ``(t, g)`` handles ``BLOCK_H`` heads of token
``t``, a ``[BLOCK_H, D]`` tile. Heads are numbered as the columns of ``qkv`` run (q heads,
then k heads, then v heads; head ``j`` starts at column ``j·D``), and ``BLOCK_H`` divides both
``H`` and ``Hkv``, so each program is all-q, all-k or all-v and takes one branch. RoPE in the
NeoX/HF ``rotate_half`` convention pairs channel ``i`` with ``i ± rotary_dim/2``: rather than
shuffle registers, the program loads its tile a second time at the partner channels (the same
cache lines, an L1 hit) and normalises both copies identically. Channels past ``rotary_dim``
(partial rotary) pass through: their partner is themselves, with cos 1 and sin 0. cos/sin come
from the float32 ``[max_pos, rotary_dim]`` table ``RotaryEmbedding.cos_sin_cache`` gives (cos
in the first half of the columns, sin in the second), indexed by position on the device.

Numerics (float32 inside; ``dtype`` = the activation dtype of ``qkv``). With qk-norm the norm
rounds exactly where the reference (``LayerOps.head_rms_norm``, as HF's ``Qwen3RMSNorm``)
materialises it: ``x·rstd`` (statistics in float32) is rounded to ``dtype`` before the weight
product, and the product is rounded to ``dtype`` (the norm's output, which the reference and
the FlashInfer path both store in ``dtype``). RoPE then runs in float32 on that value with the
float32 table and rounds once, when stored (as FlashInfer's RoPE kernel; the reference rounds
cos/sin and each product to ``dtype`` too). Without qk-norm: one rounding, at the store. The
cache writes cast to the buffers' dtype.

No host syncs and no host reads of device values: every launch is CUDA-graph capturable once
its kernel is compiled (the runner's warm-up forward, before capture, compiles it; each
distinct ``(H, Hkv, D, rotary_dim, BLOCK_H, dtype, norm)`` combination is one compilation).
Positions and cache slots are not bounds-checked (as FlashInfer's kernels and ``index_put``
on CUDA): the caller guarantees ``positions < max_pos`` and ``loc < num_slots``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

__all__ = ["qk_norm_rope", "qk_norm_rope_store", "store_kv", "supports", "supports_store"]


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_tile(src, w_ptr, cs_row, eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                    ROT: tl.constexpr, BLOCK_H: tl.constexpr):
    """``[BLOCK_H, D]`` float32 tile: heads at ``src`` (``D`` apart, channels contiguous),
    RMS-normalised times ``w_ptr`` (when ``HAS_NORM``) and rotated by the cos/sin row
    ``cs_row``; rounded to the source dtype where the reference norm rounds (module doc)."""
    dtype = src.dtype.element_ty
    HALF: tl.constexpr = ROT // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    # rotate_half partner of each channel; channels past ROT pair with themselves.
    partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
    x = tl.load(src + h * D + d).to(tl.float32)
    xp = tl.load(src + h * D + partner).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        w = tl.load(w_ptr + d).to(tl.float32)
        wp = tl.load(w_ptr + partner).to(tl.float32)
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    rot = d < ROT
    j = tl.where(d < HALF, d, d - HALF)
    cos = tl.load(cs_row + j, mask=rot, other=1.0)
    sin = tl.load(cs_row + HALF + j, mask=rot, other=0.0)
    sin = tl.where(d < HALF, -sin, sin)
    return x * cos + xp * sin


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, qkv_stride_t,
    qw_ptr, kw_ptr, cs_ptr, cs_stride, pos_ptr, loc_ptr,
    q_ptr, q_stride_t,
    k_ptr, k_stride_t, k_stride_h,
    v_ptr, v_stride_t, v_stride_h,
    eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    BLOCK_H: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    STORE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(t, g)``: heads ``[g·BLOCK_H, (g+1)·BLOCK_H)`` of token ``t`` in ``qkv``'s
    head order. q heads → ``q[t]``; k heads → ``k[t]`` (``k[loc[t]]`` when ``STORE``); v heads
    (present only when ``STORE``) are copied to ``v[loc[t]]``."""
    if PDL:  # launched early (programmatic dependent launch): wait for qkv's producer
        gdc_wait()
        gdc_launch_dependents()  # after the wait: launching earlier cascades down the stream
    t = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    src = qkv_ptr + t * qkv_stride_t + head0 * D
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    if head0 < H:
        cs_row = cs_ptr + tl.load(pos_ptr + t) * cs_stride
        out = _norm_rope_tile(src, qw_ptr, cs_row, eps, Q_NORM, D, ROT, BLOCK_H)
        dst = q_ptr + t * q_stride_t + (head0 + h) * D + d
        tl.store(dst, out.to(q_ptr.dtype.element_ty))
    else:
        row = t
        if STORE:
            row = tl.load(loc_ptr + t)
        if head0 < H + HKV:
            cs_row = cs_ptr + tl.load(pos_ptr + t) * cs_stride
            out = _norm_rope_tile(src, kw_ptr, cs_row, eps, K_NORM, D, ROT, BLOCK_H)
            dst = k_ptr + row * k_stride_t + (head0 - H + h) * k_stride_h + d
            tl.store(dst, out.to(k_ptr.dtype.element_ty))
        else:
            val = tl.load(src + h * D + d)
            dst = v_ptr + row * v_stride_t + (head0 - H - HKV + h) * v_stride_h + d
            tl.store(dst, val.to(v_ptr.dtype.element_ty))


@triton.jit
def _store_kv_kernel(
    k_ptr, k_stride_t, k_stride_h,
    v_ptr, v_stride_t, v_stride_h,
    loc_ptr,
    kb_ptr, kb_stride_s, kb_stride_h,
    vb_ptr, vb_stride_s, vb_stride_h,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program ``(t, g)``: heads ``[g·BLOCK_H, …)`` of token ``t``, k heads then v heads."""
    t = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(loc_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    if head0 < HKV:
        val = tl.load(k_ptr + t * k_stride_t + (head0 + h) * k_stride_h + d)
        dst = kb_ptr + slot * kb_stride_s + (head0 + h) * kb_stride_h + d
        tl.store(dst, val.to(kb_ptr.dtype.element_ty))
    else:
        hv = head0 - HKV + h
        val = tl.load(v_ptr + t * v_stride_t + hv * v_stride_h + d)
        dst = vb_ptr + slot * vb_stride_s + hv * vb_stride_h + d
        tl.store(dst, val.to(vb_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Predicates
# ---------------------------------------------------------------------------------------------


def _shape_ok(num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int) -> bool:
    return (num_heads > 0 and num_kv_heads > 0
            and 0 < head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and 0 < rotary_dim <= head_dim and rotary_dim % 2 == 0)


def supports(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             rotary_dim: int) -> bool:
    """Whether ``qk_norm_rope`` (and ``store_kv``) take these inputs on the GPU: a CUDA
    ``float16``/``bfloat16`` ``qkv`` ``[T, (H + 2·Hkv)·D]`` with unit channel stride, ``D`` a
    power of two ≤ 256 and an even ``rotary_dim`` ≤ ``D``. (The kernels also run on float32,
    and on the CPU under ``TRITON_INTERPRET=1``, which the tests use; the runner should not.)"""
    return (qkv.is_cuda and qkv.dtype in _HALF and qkv.dim() == 2 and qkv.stride(-1) == 1
            and _shape_ok(num_heads, num_kv_heads, head_dim, rotary_dim)
            and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim)


def supports_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   rotary_dim: int, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """``supports`` and KV buffers ``[S, Hkv, D]`` (unit channel stride) on the same device:
    ``qk_norm_rope_store`` takes them."""
    shape = (num_kv_heads, head_dim)
    return (supports(qkv, num_heads, num_kv_heads, head_dim, rotary_dim)
            and all(b.device == qkv.device and b.dim() == 3 and tuple(b.shape[1:]) == shape
                    and b.stride(-1) == 1 and b.dtype in (*_HALF, torch.float32)
                    for b in (k_buf, v_buf)))


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------


def _block_heads(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Heads per program: a power of two dividing H and Hkv, as large as keeps ≥ 512 programs
    in flight (a few per SM), at most 2048 elements a tile (8 heads of 256, 16 of 128)."""
    g = math.gcd(num_heads, num_kv_heads)
    block = 1
    while (g % (block * 2) == 0 and block * 2 * head_dim <= 2048
           and tokens * (num_heads + num_kv_heads) // (block * 2) >= 512):
        block *= 2
    return block


def _num_warps(block_h: int, head_dim: int) -> int:
    return max(1, min(8, block_h * head_dim // 256))


def _check(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
           cos_sin: torch.Tensor, positions: torch.Tensor) -> int:
    rot = cos_sin.shape[-1]
    if not _shape_ok(num_heads, num_kv_heads, head_dim, rot):
        raise ValueError(f"unsupported heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, "
                         f"rotary_dim {rot}")
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        raise ValueError("qkv must be [T, (H + 2*Hkv)*D] with unit channel stride")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected "
                         f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.stride(-1) != 1:
        raise ValueError("cos_sin must be a float32 [max_pos, rotary_dim] table")
    if positions.shape != (qkv.shape[0],):
        raise ValueError("positions must be [T]")
    for w in (q_weight, k_weight):
        if w is not None and (w.shape != (head_dim,) or w.stride(-1) != 1):
            raise ValueError("qk-norm weights must be [head_dim]")
    return rot


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos_sin: torch.Tensor, positions: torch.Tensor,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (where the weight is given) then RoPE of the q and k column slices of
    ``qkv`` ``[T, (H + 2·Hkv)·D]``, one launch → new contiguous ``q`` ``[T, H, D]``, ``k``
    ``[T, Hkv, D]`` in ``qkv``'s dtype. ``cos_sin``: float32 ``[max_pos, rotary_dim]``
    (``RotaryEmbedding.cos_sin_cache``); ``positions``: ``[T]`` integer, on the device. V stays
    the view ``qkv[:, (H + Hkv)·D:]``. ``out``: preallocated contiguous ``(q, k)`` to write
    instead (any float dtype; the result is cast to it)."""
    rot = _check(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, cos_sin, positions)
    t = qkv.shape[0]
    if out is None:
        q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    else:
        q, k = out
        _check_out(q, (t, num_heads, head_dim))
        _check_out(k, (t, num_kv_heads, head_dim))
    # k stands in for the V destination too: without STORE there are no V programs.
    _launch(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps, cos_sin,
            positions, rot, q, k, k, None, pdl=False)
    return q, k


def _launch(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
            cos_sin: torch.Tensor, positions: torch.Tensor, rot: int, q: torch.Tensor,
            k_dst: torch.Tensor, v_dst: torch.Tensor, loc: torch.Tensor | None,
            pdl: bool) -> None:
    """One launch of the kernel: q heads to ``q``, k heads to ``k_dst`` (row ``t``, or row
    ``loc[t]`` with ``loc``, which also copies the v heads to ``v_dst[loc[t]]``)."""
    t = qkv.shape[0]
    if t == 0:
        return
    store = loc is not None
    block = _block_heads(t, num_heads, num_kv_heads, head_dim)
    dummy = qkv  # never read: the matching constexpr flag is off
    heads = num_heads + (2 if store else 1) * num_kv_heads
    _qk_norm_rope_kernel[(t, heads // block)](
        qkv, qkv.stride(0),
        dummy if q_weight is None else q_weight, dummy if k_weight is None else k_weight,
        cos_sin, cos_sin.stride(0), positions, loc if store else positions,
        q, q.stride(0),
        k_dst, k_dst.stride(0), k_dst.stride(1),
        v_dst, v_dst.stride(0), v_dst.stride(1),
        float(eps),
        H=num_heads, HKV=num_kv_heads, D=head_dim, ROT=rot, BLOCK_H=block,
        Q_NORM=q_weight is not None, K_NORM=k_weight is not None, STORE=store,
        PDL=pdl, launch_pdl=pdl, num_warps=_num_warps(block, head_dim),
    )


def qk_norm_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float, cos_sin: torch.Tensor, positions: torch.Tensor,
                       k_buf: torch.Tensor, v_buf: torch.Tensor,
                       loc: torch.Tensor, q_out: torch.Tensor | None = None,
                       pdl: bool = False) -> torch.Tensor:
    """``qk_norm_rope`` and ``store_kv`` in one launch: the rotated K and the V slice of
    ``qkv`` are written to ``k_buf[loc]``/``v_buf[loc]`` (``[S, Hkv, D]``, cast to their dtype)
    and only ``q`` ``[T, H, D]`` is returned. The cache is then up to date for this layer, so
    the attention backend must skip its own ``set_kv``. ``q_out``: a preallocated contiguous
    ``[T, H, D]`` to write instead. ``pdl``: launch with programmatic dependent launch
    (Hopper and newer; the kernel waits for its predecessor before reading anything)."""
    rot = _check(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, cos_sin, positions)
    _check_bufs(k_buf, v_buf, loc, qkv.shape[0], num_kv_heads, head_dim)
    t = qkv.shape[0]
    if q_out is None:
        q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    else:
        q = q_out
        _check_out(q, (t, num_heads, head_dim))
    _launch(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps, cos_sin,
            positions, rot, q, k_buf, v_buf, loc, pdl=pdl)
    return q


def _check_out(x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape or not x.is_contiguous():
        raise ValueError(f"output must be contiguous {list(shape)}, got {tuple(x.shape)}")


def _check_bufs(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, tokens: int,
                num_kv_heads: int, head_dim: int) -> None:
    for b in (k_buf, v_buf):
        if b.dim() != 3 or tuple(b.shape[1:]) != (num_kv_heads, head_dim) or b.stride(-1) != 1:
            raise ValueError(f"KV buffers must be [S, {num_kv_heads}, {head_dim}] with unit "
                             f"channel stride, got {tuple(b.shape)}")
    if loc.shape != (tokens,):
        raise ValueError(f"loc must be [T] = [{tokens}], got {tuple(loc.shape)}")


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``k_buf[loc] = k; v_buf[loc] = v`` in one launch. ``k``/``v`` ``[T, Hkv, D]`` may be
    strided views (unit channel stride), e.g. the V column slice of ``qkv``; values are cast to
    the buffers' dtype. ``loc`` ``[T]`` integer slots, distinct (as ``index_put``, a repeated
    slot gets one of the writes)."""
    t, hkv, d = k.shape
    if v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be [T, Hkv, D] with unit channel stride")
    if d & (d - 1) or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} must be a power of two <= {MAX_HEAD_DIM}")
    _check_bufs(k_buf, v_buf, loc, t, hkv, d)
    if t == 0:
        return
    block = _block_heads(t, hkv, hkv, d)
    _store_kv_kernel[(t, 2 * hkv // block)](
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        loc,
        k_buf, k_buf.stride(0), k_buf.stride(1),
        v_buf, v_buf.stride(0), v_buf.stride(1),
        HKV=hkv, D=d, BLOCK_H=block,
        num_warps=_num_warps(block, d),
    )
