"""Triton paged attention for the block-diffusion denoise forward (``DLLM_EXTEND``) and decode.

The case: every row (request) has exactly ``block_size`` (B) query tokens, at cache positions
``[seq_len - B, seq_len)``, and every query of the row sees every key ``[0, seq_len)`` of
its row (the block is non-causal inside, and its own K/V are already in the cache). So the
B tokens × G = H / Hkv query heads that share a KV head form one ``[M = B·G, D]`` query tile
against one stream of keys: exactly a decode query of B·G heads, with no mask but the length.

Design: one program per (row, KV head[, chunk of M]). The program loads its query tile
straight from ``q`` in the natural ``[T, H, D]`` layout (token t of row r is ``r·B + t``; the
G heads of a KV head are contiguous, so the tile is B runs of G·D elements), walks the row's
keys in chunks of ``BLOCK_N``: the slots ``req_to_token[req_pool_indices[row], j]``, K and V
gathered from the layer's ``[num_slots, Hkv, D]`` buffers at those slots and this KV head,
``S = q·Kᵀ`` scaled by ``sm_scale·log2(e)`` (softmax in base 2), keys ``j >= seq_len`` masked,
an online softmax in float32, ``acc += P·V`` with P cast to the KV dtype for the tensor-core
dot (as flash attention does), and writes ``acc / l`` to ``out`` in the ``[T, H, D]`` layout:
no head permutation before or after. Rows of ``seq_len == 0`` (CUDA-graph padding rows) run
no key chunk and write zeros. The grid is ``(rows, Hkv, M chunks)``, sizes the host knows, and
nothing is read back from the device: the launch can be captured in a CUDA graph. The tile
config depends only on (M, D) (``default_config``), never on the batch, and a program reads
only its own row: a row's output is bit-identical whatever batch it runs in. (The attention
backend takes the split count and the query tile from :func:`plan`, by the row count, the
heads and the block: there a row's bits are the same within one (splits, tile).)

The bound (SDAR-8B, 32/8 heads of 128, B = 4, 128 rows of ~330 keys, bf16): each row reads
its keys' K and V once per KV head, 128 × 330 × 8 × 128 × 2 B × 2 = 173 MB a layer, ≈ 41 µs at
4.25 TB/s; the FLOPs (4·M·keys·D per program, 1.4 GFLOP a layer) are nothing. FlashInfer's
packed decode form took 90.6 µs a layer plus two 7.7 µs head-permutation copies.
Measured (bench/kernels/triton_attention.py, H200, triton 3.6, 327 keys a row on average, KV from
HBM): 54 µs (3.2 TB/s, 1.35× the bound; 53 µs as a CUDA-graph replay) against 64 µs for
FlashInfer's packed decode kernel and 82 µs with its permutations. Every tile variant swept
(BLOCK_N 32–128, 4/8 warps, 1–4 stages, prefetching the next chunk, KV heads of a row side
by side) lands within a few µs: what is left is not the loop's latency. LLaDA2-mini (16/4
heads, B = 32, M = 128; 86 MB, 11 GFLOP a layer at 128 rows, so also tensor-core work):
54 µs against 55 µs (kernel) and 101 µs (with permutations).

``decode_attention`` is the same kernel with B = 1 (M = G, padded to 16 rows).

Split-KV (``num_splits`` S > 1, asked for by the caller, e.g. :func:`plan` from the row
count): at small batch rows × Hkv programs leave most SMs idle (batch 1 of SDAR-8B: 8
programs, ~10 µs walking 4 chunks of 64 keys in series). The grid's last axis then also runs
over S splits; split s walks the chunks s, s + S, s + 2S, ... of BLOCK_N keys (so the grid
depends on S alone and covers any seq_len: CUDA-graph replays may be longer than the capture)
and writes its un-normalised float32 acc with its running max and sum to a workspace; the
S partials of each query row are merged in the fixed order s = 0..S-1 and written as
``[T, H, D]`` in q's dtype. The merge runs in the last of the S programs to finish (an atomic
counter per (row, KV head, chunk of M), put back to 0 by the merging program, so a CUDA graph
replays it as captured): a separate merge launch cost ~1.9 µs plus a ~0.45 µs gap per layer
at batch 1 of SDAR-8B. ``fold_merge=False`` keeps that second launch (same bits). Splits
without keys weigh zero; rows of seq_len 0 give zeros. Bits are deterministic and
row-independent for a given S (not across S values).
"""

from __future__ import annotations

import torch

from dllm.runner.kernels import hardware

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the CPU install may have no Triton
    triton = None
    tl = None

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
MAX_BLOCK_M = 128
MAX_SPLITS = 16
MERGE_M = 16  # query rows per program of the split merge


def supports(q_dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
             head_dim: int, device: torch.device | str) -> bool:
    """Whether :func:`dllm_extend_attention` serves this layer: half-precision q and KV of one
    dtype, head_dim 64/128/256, grouped heads, a CUDA device and Triton installed."""
    return (triton is not None
            and torch.device(device).type == "cuda"
            and q_dtype in (torch.bfloat16, torch.float16) and kv_dtype == q_dtype
            and head_dim in HEAD_DIMS
            and num_kv_heads > 0 and num_heads % num_kv_heads == 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def splits_for(rows: int, num_kv_heads: int, num_sms: int | None = None) -> int:
    """Key splits for ``rows`` × ``num_kv_heads`` programs (a row per query tile): enough that
    programs × splits ≥ 2 × the SM count (``num_sms``: the device's; None, the reference
    device's, ``hardware.REFERENCE``), at most :data:`MAX_SPLITS`, 1 once the programs alone
    fill two waves. From host numbers only (never the lengths), so a CUDA graph captured for
    ``rows`` fits any replayed batch."""
    if num_sms is None:
        num_sms = hardware.num_sms(None)
    programs = max(rows, 1) * max(num_kv_heads, 1)
    return max(1, min(MAX_SPLITS, _cdiv(2 * num_sms, programs)))


def default_config(m: int, head_dim: int) -> dict:
    """Tile config from the query tile and head size alone (never from the batch): the same
    row gives the same bits in any batch."""
    block_m = min(max(16, _next_power_of_2(m)), MAX_BLOCK_M)
    common = dict(PREFETCH=0, KV_FIRST=False)
    if head_dim >= 256:
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=8 if block_m >= 64 else 4,
                    num_stages=2, **common)
    if block_m >= 64:  # LLaDA2-mini (M = 32 × 4): 56 µs at 128 rows on an H200 vs 77
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=4, num_stages=3, PREFETCH=1,
                    KV_FIRST=False)
    # SDAR-8B (M = 4 × 4): every BLOCK_N / warps / stages / prefetch variant within 2 µs
    return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=3, **common)


# A split launch whose grid at ``default_config``'s query tile stays under one wave (a row or
# so of a full-attention window or an LLaDA2 block): a 16-row query tile, which multiplies the
# programs. Measured on the H200 at one row of 384 keys, 4 splits, the launch in a CUDA graph
# of launches over KV copies (bench/kernels/triton_attention.py --sweep-splits; bench/NOTES.md,
# session 18): LLaDA-8B 10.6 → 9.6 µs (32 KV heads, 32 query rows), Dream-7B 18.2 → 8.9
# (4 KV heads, 224 rows), LLaDA2-mini 17.1 → 7.9 (4 KV heads, 128 rows).
SMALL_GRID = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=3, PREFETCH=1, KV_FIRST=False)


def launch_config(rows: int, num_kv_heads: int, m: int, head_dim: int, num_splits: int,
                  num_sms: int) -> dict | None:
    """A launch plan's tile, for ``dllm_extend_attention(config=...)``: ``SMALL_GRID`` for a
    split launch (``num_splits`` > 1) of head_dim <= 128 whose grid at the default query tile
    (wider than 16 rows) would leave SMs of the ``num_sms`` idle; None (the default tile)
    otherwise. From host numbers only (graph-safe); like the split count it depends on the
    row count."""
    block_m = default_config(m, head_dim)["BLOCK_M"]
    if (num_splits > 1 and head_dim <= 128 and block_m > 16
            and rows * num_kv_heads * _cdiv(m, block_m) * num_splits < num_sms):
        return dict(SMALL_GRID)
    return None


# The key splits a plan may ask for: a row of a few hundred keys has only a few chunks to share
# out.
MAX_PLAN_SPLITS = 4
# Query tiles of 64 rows and more (a full-attention model's prefix windows and whole canvas,
# M = window × G; LLaDA2-mini's 128-row blocks): on a grid of under one wave at the default
# tile, one program per 64 rows, no split, BLOCK_N 64; between one and two waves, the default
# tile unsplit. Measured on the H200 (bench/kernels/triton_attention.py --sweep-space large /
# --plans, graph over KV copies; bench/NOTES.md, session 20): at one row of 384 keys 9.4-10.3
# µs at windows of 64-256 tokens and 14 µs at 384 (LLaDA-8B, Dream-7B), against 34-37 µs for
# the split default tile at 384; LLaDA2-mini 10.7 µs against 20.2 (4 splits) at batch 8, 15.5
# against 38.7 (3 splits) at 32; at 64 rows (256 programs of the default tile) 27.9 µs for the
# default tile unsplit, 33.2 for the wide tile, 47.1 with 2 splits; at 128 rows the default
# tile 51.7 against 62.7 for the wide one.
WIDE_TILE = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, PREFETCH=1, KV_FIRST=False)
WIDE_MIN_PROGRAMS = 24


def plan(rows: int, num_kv_heads: int, m: int, head_dim: int,
         num_sms: int) -> tuple[int, dict | None]:
    """``(num_splits, config)`` for a launch of ``rows`` rows of an ``m``-row query tile per KV
    head, from host numbers only (graph-safe: a graph captured for ``rows`` fits any
    lengths). Where the query tile has at least 64 rows (head_dim <= 128) and its 64-row
    chunks give at least :data:`WIDE_MIN_PROGRAMS` programs: ``WIDE_TILE`` unsplit while the
    default tile's unsplit grid stays under one wave of the ``num_sms``, the default tile
    unsplit under two. Otherwise :func:`splits_for` over the default tile's programs (rows × M
    chunks; at most :data:`MAX_PLAN_SPLITS`) and :func:`launch_config`'s tile."""
    chunks = _cdiv(m, default_config(m, head_dim)["BLOCK_M"])
    programs = rows * num_kv_heads * chunks
    wide = WIDE_TILE["BLOCK_M"]
    if (head_dim <= 128 and m >= wide
            and rows * num_kv_heads * _cdiv(m, wide) >= WIDE_MIN_PROGRAMS):
        if programs < num_sms:
            return 1, dict(WIDE_TILE)
        if programs < 2 * num_sms:
            return 1, None
    splits = min(splits_for(rows * chunks, num_kv_heads, num_sms), MAX_PLAN_SPLITS)
    return splits, launch_config(rows, num_kv_heads, m, head_dim, splits, num_sms)


if triton is not None:

    @triton.jit
    def _load_kv(k_base, v_base, slots, valid, stride_ks, stride_vs, offs_d):
        """K and V ``[len(slots), D]`` of one KV head at cache ``slots`` (zeros where not
        ``valid``)."""
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        return k, v

    @triton.jit
    def _merge_partials(acc_ws, ml_ws, offs_r, offs_d, BLOCK_M: tl.constexpr, D: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, CACHE: tl.constexpr):
        """The normalised output of query rows ``offs_r`` (of a BLOCK_M tile) from the
        NUM_SPLITS partial states at ``acc_ws``/``ml_ws``, merged in the order s = 0..S-1."""
        m_max = tl.full(offs_r.shape, -1.0e30, dtype=tl.float32)
        for s in range(NUM_SPLITS):
            m_max = tl.maximum(m_max, tl.load(ml_ws + s * (2 * BLOCK_M) + offs_r,
                                              cache_modifier=CACHE))
        l_sum = tl.zeros(offs_r.shape, dtype=tl.float32)
        acc = tl.zeros([offs_r.shape[0], D], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            w = tl.math.exp2(tl.load(ml_ws + s * (2 * BLOCK_M) + offs_r, cache_modifier=CACHE)
                             - m_max)
            l_sum += tl.load(ml_ws + s * (2 * BLOCK_M) + BLOCK_M + offs_r,
                             cache_modifier=CACHE) * w
            part = tl.load(acc_ws + s * (BLOCK_M * D) + offs_r[:, None] * D + offs_d[None, :],
                           cache_modifier=CACHE)
            acc += part * w[:, None]
        # Every split empty (seq_len == 0): m_max = -1e30, w = 1, l = 0, acc = 0 -> zeros.
        l_safe = tl.where(l_sum == 0.0, 1.0, l_sum)
        return acc / l_safe[:, None]

    @triton.jit
    def _paged_block_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr,
        acc_ws_ptr, ml_ws_ptr, count_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_rt, stride_ar, stride_ah, stride_mr, stride_mh, stride_cr,
        qk_scale,
        B: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        STATIC_KEYS: tl.constexpr, PREFETCH: tl.constexpr, KV_FIRST: tl.constexpr,
        NUM_SPLITS: tl.constexpr, FOLD: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        if PDL:  # launched early (programmatic dependent launch): wait for q's producer
            gdc_wait()
            gdc_launch_dependents()  # after the wait: launching earlier cascades
        if KV_FIRST:  # the KV heads of a row run side by side: they read the same pages
            kvh = tl.program_id(0).to(tl.int64)
            row = tl.program_id(1).to(tl.int64)
        else:
            row = tl.program_id(0).to(tl.int64)
            kvh = tl.program_id(1).to(tl.int64)
        # Split-KV (NUM_SPLITS > 1): axis 2 is mblk·S + split, and split s takes the key chunks
        # s, s + S, s + 2S, ... of BLOCK_N keys: the same fixed grid covers any seq_len.
        STEP: tl.constexpr = BLOCK_N * NUM_SPLITS
        if NUM_SPLITS == 1:
            mblk = tl.program_id(2)
        else:
            mblk = tl.program_id(2) // NUM_SPLITS
            split = tl.program_id(2) % NUM_SPLITS

        seq_len = tl.load(seq_lens_ptr + row)
        req = tl.load(req_pool_ptr + row)

        # Query tile rows: m = t·G + g -> token row·B + t, head kvh·G + g.
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < B * G
        tok = row * B + (offs_m // G)
        head = kvh * G + (offs_m % G)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=m_valid[:, None], other=0.0)

        # Finite start: a chunk with every key masked (the interpreter's static loop) then
        # leaves the state unchanged instead of making NaN (exp2(-inf - -inf)).
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

        table = req_to_token_ptr + req * stride_rt
        # n_keys: the row's keys from this program's first chunk on (table shifted to it).
        n_keys = seq_len
        if NUM_SPLITS > 1:
            table += split * BLOCK_N
            n_keys = seq_len - split * BLOCK_N
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        offs_n = tl.arange(0, BLOCK_N)
        # The compiled kernel loops to the row's own length. STATIC_KEYS > 0 (the CPU
        # interpreter, which cannot take a loaded value as a loop bound) loops to the table's
        # width instead, the chunks past seq_len fully masked.
        # PREFETCH: 0 loads each chunk's slots, then its K and V, in the iteration that uses
        # them (left to Triton's pipeliner, num_stages); 1 loads the next chunk's slots one
        # iteration ahead; 2 also issues the next chunk's K and V before this chunk's math
        # (two chunks in flight without shared-memory stages).
        slots_next = tl.load(table + offs_n, mask=offs_n < n_keys, other=0)
        if PREFETCH == 2:
            k_next, v_next = _load_kv(k_base, v_base, slots_next, offs_n < n_keys, stride_ks,
                                      stride_vs, offs_d)
            slots_next = tl.load(table + STEP + offs_n, mask=STEP + offs_n < n_keys,
                                 other=0)
        for start in range(0, STATIC_KEYS if STATIC_KEYS > 0 else n_keys, STEP):
            cols = start + offs_n
            n_valid = cols < n_keys
            if PREFETCH == 2:
                k = k_next
                v = v_next
                nxt = cols + STEP
                k_next, v_next = _load_kv(k_base, v_base, slots_next, nxt < n_keys,
                                          stride_ks, stride_vs, offs_d)
                slots_next = tl.load(table + nxt + STEP, mask=nxt + STEP < n_keys,
                                     other=0)
            else:
                if PREFETCH == 1:
                    slots = slots_next
                    slots_next = tl.load(table + cols + STEP, mask=cols + STEP < n_keys,
                                         other=0)
                else:
                    slots = tl.load(table + cols, mask=n_valid, other=0)
                k, v = _load_kv(k_base, v_base, slots, n_valid, stride_ks, stride_vs, offs_d)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(n_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if NUM_SPLITS == 1:
            # seq_len == 0: no chunk ran, acc == 0 and l == 0 -> zeros, not NaN.
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_safe[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=m_valid[:, None])
        else:
            # The partial state, un-normalised, to this program's workspace slot (all BLOCK_M
            # rows): acc [BLOCK_M, D], then m and l [BLOCK_M] each. A split with no key keeps
            # m = -1e30, l = 0, acc = 0: it weighs nothing in the merge.
            offs_r = tl.arange(0, BLOCK_M)
            slot = tl.program_id(2).to(tl.int64)
            acc_ws = acc_ws_ptr + row * stride_ar + kvh * stride_ah + slot * (BLOCK_M * D)
            tl.store(acc_ws + offs_r[:, None] * D + offs_d[None, :], acc)
            ml_ws = ml_ws_ptr + row * stride_mr + kvh * stride_mh + slot * (2 * BLOCK_M)
            tl.store(ml_ws + offs_r, m_i)
            tl.store(ml_ws + BLOCK_M + offs_r, l_i)
            if FOLD:
                # The last of the S programs of this (row, KV head, chunk of M) to finish
                # merges all S partials (CUTLASS's semaphore pattern: the CTA's stores, a
                # barrier, one release/acquire atomic; the partials then read from L2), and
                # puts the counter back to 0 for the next launch. The merge reads the
                # workspace in the order s = 0..S-1 whichever program comes last: the bits of
                # the separate merge kernel.
                tl.debug_barrier()
                MBLOCKS: tl.constexpr = (B * G + BLOCK_M - 1) // BLOCK_M
                count = count_ptr + row * stride_cr + kvh * MBLOCKS + mblk
                if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                    first = mblk.to(tl.int64) * NUM_SPLITS
                    out = _merge_partials(
                        acc_ws_ptr + row * stride_ar + kvh * stride_ah + first * (BLOCK_M * D),
                        ml_ws_ptr + row * stride_mr + kvh * stride_mh + first * (2 * BLOCK_M),
                        offs_r, offs_d, BLOCK_M, D, NUM_SPLITS, ".cg")
                    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                             mask=m_valid[:, None])
                    tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _merge_splits_kernel(
        acc_ws_ptr, ml_ws_ptr, out_ptr,
        stride_ar, stride_ah, stride_mr, stride_mh, stride_ot, stride_oh,
        B: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Merges the NUM_SPLITS partial states of MERGE_M query rows of one (row, KV head,
        chunk of M), in the order s = 0..S-1 (deterministic), into ``out``."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()  # after the wait: launching earlier cascades
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        SUBS: tl.constexpr = BLOCK_M // MERGE_M
        mblk = tl.program_id(2) // SUBS
        offs_r = (tl.program_id(2) % SUBS) * MERGE_M + tl.arange(0, MERGE_M)  # in the tile
        offs_m = mblk * BLOCK_M + offs_r
        m_valid = offs_m < B * G
        tok = row * B + (offs_m // G)
        head = kvh * G + (offs_m % G)
        offs_d = tl.arange(0, D)
        first = mblk.to(tl.int64) * NUM_SPLITS
        acc_ws = acc_ws_ptr + row * stride_ar + kvh * stride_ah + first * (BLOCK_M * D)
        ml_ws = ml_ws_ptr + row * stride_mr + kvh * stride_mh + first * (2 * BLOCK_M)

        out = _merge_partials(acc_ws, ml_ws, offs_r, offs_d, BLOCK_M, D, NUM_SPLITS, "")
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def _interpreted(q: torch.Tensor) -> bool:
    knobs = getattr(triton, "knobs", None)
    return q.device.type != "cuda" or bool(knobs and knobs.runtime.interpret)


# Split counters of the folded merge, per device: int32, zero between launches (the merging
# program puts its counter back). One buffer serves every launch on the device, so launches
# that use it must not run concurrently (the runners issue one stream's work at a time). A
# buffer outgrown is kept, not freed: a captured CUDA graph still points at it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _counters(device: torch.device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Zeros made inside a capture exist only once the graph replays: an eager launch
            # before that would count from garbage (the runners warm up every shape first).
            raise RuntimeError("the split-merge counters must be allocated before a CUDA "
                               "graph capture: run the launch once eagerly first")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def dllm_extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor, block_size: int, sm_scale: float,
                          out: torch.Tensor | None = None, config: dict | None = None,
                          num_splits: int = 1, pdl: bool = False,
                          fold_merge: bool = True) -> torch.Tensor:
    """Attention of ``rows`` rows of ``block_size`` query tokens each over their paged keys.

    ``q`` ``[rows·B, H, D]`` (last dim contiguous; token t of row r at ``r·B + t``);
    ``k_buf``/``v_buf`` ``[num_slots, Hkv, D]``; ``req_to_token`` ``[R, C]`` int64 slot table;
    ``req_pool_indices``/``seq_lens`` ``[rows]`` int64 on the device. Row r's queries see keys
    ``[0, seq_lens[r])`` of table row ``req_pool_indices[r]``, all of them (non-causal).
    Returns ``out`` (allocated ``[T, H, D]`` like ``q`` when None). ``config`` overrides
    keys of the tile config ``default_config(B·G, D)`` (BLOCK_M, BLOCK_N, num_warps,
    num_stages, PREFETCH, KV_FIRST): a caller's launch plan (:func:`plan`) or a
    benchmark's variant. A row's bits are the same in any batch launched with the same
    ``num_splits`` and ``config``.

    ``num_splits`` S > 1 splits every row's keys over S programs (split s takes the BLOCK_N
    chunks s, s + S, ...; any seq_len, the grid fixed), which write float32 partials to a
    workspace, merged in the order s = 0..S-1: for small batches (see :func:`splits_for`).
    With ``fold_merge`` the last program of each (row, KV head, M chunk) to finish merges, counted
    with an atomic (one launch); without, a second launch merges. Both give the same bits.
    Deterministic and row-independent for a given S; the bits differ from another S. S = 1
    is the single launch. ``pdl``: launch with programmatic dependent
    launch (Hopper and newer; each kernel waits for its predecessor before reading)."""
    if triton is None:
        raise RuntimeError("dllm_extend_attention needs Triton")
    pdl = pdl and not _interpreted(q)
    t, h, d = q.shape
    hkv = k_buf.shape[1]
    rows = req_pool_indices.shape[0]
    if h % hkv or t != rows * block_size or d not in HEAD_DIMS:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, kv heads {hkv}, rows {rows}, "
                         f"block {block_size}")
    if k_buf.shape[2] != d or v_buf.shape[2] != d:
        raise ValueError("K, V and q must share head_dim")
    if q.stride(2) != 1 or k_buf.stride(2) != 1 or v_buf.stride(2) != 1 or \
            req_to_token.stride(1) != 1:
        raise ValueError("the last dim of q, K, V and req_to_token must be contiguous")
    if out is None:
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError("out must be [T, H, D] with a contiguous last dim")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if rows == 0:
        return out
    g = h // hkv
    m = block_size * g
    cfg = dict(default_config(m, d))
    if config:
        cfg.update(config)
    block_m = cfg["BLOCK_M"]
    mblocks = triton.cdiv(m, block_m)
    fold = fold_merge and num_splits > 1
    if num_splits == 1:  # the single launch: no workspace (unused pointer args: out)
        acc_ws = ml_ws = counters = out
        ws_strides = (0, 0, 0, 0)
    else:  # partial acc [BLOCK_M, D] and (m, l) [2, BLOCK_M] per (row, KV head, mblk, split)
        slots = mblocks * num_splits
        acc_ws = torch.empty((rows, hkv, slots, block_m, d), dtype=torch.float32,
                             device=q.device)
        ml_ws = torch.empty((rows, hkv, slots, 2, block_m), dtype=torch.float32,
                            device=q.device)
        ws_strides = (acc_ws.stride(0), acc_ws.stride(1), ml_ws.stride(0), ml_ws.stride(1))
        counters = _counters(q.device, rows * hkv * mblocks) if fold else out
    axis2 = mblocks * num_splits
    grid = (hkv, rows, axis2) if cfg["KV_FIRST"] else (rows, hkv, axis2)
    _paged_block_attn_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, acc_ws, ml_ws,
        counters, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), *ws_strides, hkv * mblocks,
        sm_scale * LOG2E,
        B=block_size, G=g, D=d, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        STATIC_KEYS=req_to_token.shape[1] if _interpreted(q) else 0,
        PREFETCH=cfg["PREFETCH"], KV_FIRST=cfg["KV_FIRST"], NUM_SPLITS=num_splits, FOLD=fold,
        PDL=pdl, launch_pdl=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1 and not fold:
        merge_m = min(MERGE_M, block_m)
        _merge_splits_kernel[(rows, hkv, mblocks * (block_m // merge_m))](
            acc_ws, ml_ws, out, *ws_strides, out.stride(0), out.stride(1),
            B=block_size, G=g, D=d, BLOCK_M=block_m, MERGE_M=merge_m, NUM_SPLITS=num_splits,
            PDL=pdl, launch_pdl=pdl, num_warps=4,
        )
    return out


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float,
                     out: torch.Tensor | None = None, num_splits: int = 1, pdl: bool = False,
                     fold_merge: bool = True) -> torch.Tensor:
    """``DECODE``: one query token per row (its key already in the cache at ``seq_len - 1``),
    attending to keys ``[0, seq_len)``: the block kernel with B = 1 (``num_splits``, ``pdl``
    and ``fold_merge`` as there)."""
    return dllm_extend_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
                                 1, sm_scale, out, num_splits=num_splits, pdl=pdl,
                                 fold_merge=fold_merge)


def reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
              req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
              seq_lens: torch.Tensor, block_size: int, sm_scale: float) -> torch.Tensor:
    """Float32 torch reference of :func:`dllm_extend_attention` (reads the index tensors back
    on the host: tests and benchmarks only)."""
    t, h, d = q.shape
    hkv = k_buf.shape[1]
    g = h // hkv
    out = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    for r, (req, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                     strict=True)):
        if n == 0:
            continue
        slots = req_to_token[req, :n]
        k = k_buf[slots].float().repeat_interleave(g, dim=1)  # [n, H, D]
        v = v_buf[slots].float().repeat_interleave(g, dim=1)
        qi = q[r * block_size:(r + 1) * block_size].float()  # [B, H, D]
        s = torch.einsum("bhd,nhd->hbn", qi, k) * sm_scale
        out[r * block_size:(r + 1) * block_size] = torch.einsum(
            "hbn,nhd->bhd", s.softmax(-1), v)
    return out


__all__ = ["SMALL_GRID", "decode_attention", "default_config", "dllm_extend_attention",
           "launch_config", "plan", "reference", "splits_for", "supports"]
