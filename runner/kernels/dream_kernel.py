"""Dream's greedy proposal and its confidences in four small launches, and its schedule in one
(Triton; CUDA only).

For a batch whose rows are all greedy and unfiltered, Dream's ``sample_tokens`` computes a
float32 softmax over the whole vocabulary per position, the first maximum of those
probabilities, and (``alg="entropy"``) ``sum p * log(p + 1e-10)``. The reference path
(:func:`dllm.algorithms.dream.dream_probs` and ``vocab_parallel.neg_entropy``) writes and
reads float32 ``[positions, vocab]`` tensors about a dozen times (the probabilities, their
log, the product, every level of the fixed-order sum): ~0.1 ms a step at 32 positions of
Dream's 152064-token vocabulary, more in proportion for a whole canvas. This reads the logits
three times and writes a few numbers a position.

The element-wise arithmetic is the reference's own, with CUDA's correctly rounded float32
division and libdevice's ``expf`` / ``logf`` (what torch's CUDA kernels call): the maximum
``m`` is exact, each ``exp(x - m)``, ``p = exp(x - m) / s`` and ``p * log(p + 1e-10)`` is
the value torch computes for the same ``m`` and ``s`` (no fused multiply-add). Only the two
sums (``s`` and the entropy) run in another fixed order: each position's vocabulary is cut
into ``SPLITS`` slices, a program's ``BLOCK`` lanes accumulate a slice's ids in order and
one tree reduction adds the lanes, and the slices' partials are added in slice order. The
slicing depends on the vocabulary size alone, so a position's results depend on its own
logits alone, whatever the batch (the property :mod:`dllm.algorithms.reductions` gives the
reference); they agree with the reference to float32 rounding, not bit for bit.

The proposal is the first id whose probability equals the largest one, ``1 / s`` (the
maximum logit's ``exp(0) = 1`` divided by ``s``; ``p`` is monotone in the logit, so a lower
logit can tie it only after rounding, within an ulp of ``exp(0)``, and which such ids tie
depends on ``s``, whose last bit may differ from the reference's). That value is also
``maskgit_plus``'s confidence. A row whose ``s`` is NaN (a NaN or +inf logit, or no finite
one) gives id 0 and NaN confidences, as the reference's all-NaN probabilities do.

``dream_schedule`` is the other per-step computation of Dream's schedules that torch spreads
over many tiny launches: ``1 - s / t`` from ``torch.linspace``'s CUDA values (about 30
element-wise kernels over ``[bs]`` rows in ``transfer_fraction``), here one launch with the
same float64 and float32 roundings, bit for bit.

Launches: the slices' maxima; the slices' sums of ``exp(x - m)`` (each program reads its
row's maxima); the slices' first maximum and entropy terms (each reads its row's sums, added
in slice order); one program a position adds the partials in slice order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

SPLITS = 16  # vocabulary slices per position: 512 programs at a 32-position block
BLOCK = 2048  # ids per chunk
NUM_WARPS = 8
# CUDA's correctly rounded division and libdevice's exp / log; the interpreter has neither
# (its numpy float32 division, exp and log stand in).
_CUDA_MATH = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _div(a, b, CUDA_MATH: tl.constexpr):
    """``a / b`` correctly rounded (Triton's ``/`` is CUDA's 2-ulp ``div.full``)."""
    if CUDA_MATH:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _exp(x, CUDA_MATH: tl.constexpr):
    """``expf`` (Triton's ``tl.exp`` is the approximate ``ex2.approx`` on a scaled input)."""
    if CUDA_MATH:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, CUDA_MATH: tl.constexpr):
    """``logf``."""
    if CUDA_MATH:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _row_sum(part_ptr, row, SPLITS: tl.constexpr):
    """A row's slice partials added in slice order (the same bits in every kernel)."""
    total = tl.load(part_ptr + row * SPLITS)
    for p in tl.static_range(1, SPLITS):
        total += tl.load(part_ptr + row * SPLITS + p)
    return total


@triton.jit
def _max_kernel(logits_ptr, row_stride, vocab, part_m,
                SLICE: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * row_stride
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for c in range(0, SLICE, BLOCK):
        offs = part * SLICE + c + lane
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    tl.store(part_m + row * SPLITS + part, tl.max(m, 0))


@triton.jit
def _sum_kernel(logits_ptr, row_stride, vocab, part_m, part_s,
                SLICE: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                CUDA_MATH: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * row_stride
    m = tl.max(tl.load(part_m + row * SPLITS + tl.arange(0, SPLITS)), 0)
    lane = tl.arange(0, BLOCK)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, SLICE, BLOCK):
        offs = part * SLICE + c + lane
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        s += _exp(x - m, CUDA_MATH)
    tl.store(part_s + row * SPLITS + part, tl.sum(s, 0))


@triton.jit
def _term_kernel(logits_ptr, row_stride, vocab, part_m, part_s, part_i, part_h,
                 SLICE: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                 ENTROPY: tl.constexpr, CUDA_MATH: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * row_stride
    m = tl.max(tl.load(part_m + row * SPLITS + tl.arange(0, SPLITS)), 0)
    s = _row_sum(part_s, row, SPLITS)
    top = _div(1.0, s, CUDA_MATH)
    lane = tl.arange(0, BLOCK)
    first = tl.full([BLOCK], 2**31 - 1, dtype=tl.int32)
    h = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, SLICE, BLOCK):
        offs = part * SLICE + c + lane
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        p = _div(_exp(x - m, CUDA_MATH), s, CUDA_MATH)
        first = tl.minimum(first, tl.where(p == top, offs, 2**31 - 1))
        if ENTROPY:
            h += p * _log(p + 1e-10, CUDA_MATH)
    tl.store(part_i + row * SPLITS + part, tl.min(first, 0))
    tl.store(part_h + row * SPLITS + part, tl.sum(h, 0))


@triton.jit
def _finish_kernel(part_s, part_i, part_h, x0_ptr, top_ptr, negent_ptr,
                   SPLITS: tl.constexpr, CUDA_MATH: tl.constexpr):
    row = tl.program_id(0)
    s = _row_sum(part_s, row, SPLITS)
    first = tl.min(tl.load(part_i + row * SPLITS + tl.arange(0, SPLITS)), 0)
    # no id equals 1 / s only when s is NaN (a NaN or +inf logit, or no finite one): every
    # probability is then NaN and the reference's argmax gives the first, id 0
    first = tl.where(first == 2**31 - 1, 0, first)
    tl.store(x0_ptr + row, first.to(tl.int64))
    tl.store(top_ptr + row, _div(1.0, s, CUDA_MATH))
    tl.store(negent_ptr + row, _row_sum(part_h, row, SPLITS))


@triton.jit
def _schedule_kernel(step_ptr, steps_ptr, frac_ptr, last_ptr, n, SPAN: tl.constexpr,
                     END: tl.constexpr, BLOCK: tl.constexpr, CUDA_MATH: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n
    step = tl.load(step_ptr + r, mask=ok, other=0).to(tl.int64)
    steps = tl.load(steps_ptr + r, mask=ok, other=1).to(tl.int64)
    index = tl.minimum(step, steps - 1)
    # torch.linspace(1, END, steps + 1)[i] as CUDA computes it (dllm.algorithms.dream):
    # the float32 step, then start + step * i or end - step * (steps - i), exact in float64
    n64 = steps.to(tl.float64)
    # (float64 division is IEEE's round-to-nearest in PTX: div.rn.f64)
    h = (tl.full([BLOCK], SPAN, tl.float64) / n64).to(tl.float32).to(tl.float64)
    half = (steps + 1) // 2
    i0 = index.to(tl.float64)
    t = tl.where(index < half, 1.0 + h * i0, END - h * (n64 - i0)).to(tl.float32)
    i1 = i0 + 1.0
    s = tl.where(index + 1 < half, 1.0 + h * i1, END - h * (n64 - i1)).to(tl.float32)
    frac = tl.where(step >= steps, 0.0, 1.0 - _div(s, t, CUDA_MATH))
    tl.store(frac_ptr + r, frac, mask=ok)
    tl.store(last_ptr + r, (step == steps - 1).to(tl.int8), mask=ok)


def dream_schedule(step: torch.Tensor, steps: torch.Tensor, span: float, end: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's ``1 - s / t`` (float32, 0 past the schedule) and the last-step flag per row
    (``[bs]`` int ``step`` and ``steps``), bit for bit as ``dllm.algorithms.dream
    .transfer_fraction`` computes them with torch, in one launch instead of ~30."""
    n = step.shape[0]
    frac = torch.empty(n, dtype=torch.float32, device=step.device)
    last = torch.empty(n, dtype=torch.bool, device=step.device)
    if n:
        block = max(16, triton.next_power_of_2(min(n, 1024)))
        _schedule_kernel[(triton.cdiv(n, block),)](
            step, steps, frac, last.view(torch.int8), n, SPAN=span, END=end, BLOCK=block,
            CUDA_MATH=_CUDA_MATH, num_warps=1,
            **({} if not _CUDA_MATH else {"enable_fp_fusion": False}))
    return frac, last


def supports(logits: torch.Tensor) -> bool:
    return (logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and logits.shape[-1] > 0 and logits.stride(-1) == 1)


def dream_greedy(logits: torch.Tensor, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``logits [..., V]`` → ``(x0 [...] int64, p(x0) [...] float32, neg_entropy
    [...] float32 or None)`` of the plain float32 softmax, as Dream's greedy rows compute
    them (module docstring); ``entropy=False`` skips the entropy terms."""
    lead = logits.shape[:-1]
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    n = rows.shape[0]
    dev = logits.device
    part_m, part_s, part_h = (torch.empty((n, SPLITS), dtype=torch.float32, device=dev)
                              for _ in range(3))
    part_i = torch.empty((n, SPLITS), dtype=torch.int32, device=dev)
    x0 = torch.empty(n, dtype=torch.int64, device=dev)
    top = torch.empty(n, dtype=torch.float32, device=dev)
    negent = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        slice_len = triton.cdiv(triton.cdiv(vocab, SPLITS), BLOCK) * BLOCK
        grid = (n, SPLITS)
        shape = dict(SLICE=slice_len, BLOCK=BLOCK, SPLITS=SPLITS, num_warps=NUM_WARPS)
        _max_kernel[grid](rows, rows.stride(0), vocab, part_m, **shape)
        _sum_kernel[grid](rows, rows.stride(0), vocab, part_m, part_s, CUDA_MATH=_CUDA_MATH, **shape)
        # no fused multiply-add: each entropy term is rounded as the reference rounds it
        _term_kernel[grid](rows, rows.stride(0), vocab, part_m, part_s, part_i, part_h,
                           ENTROPY=entropy, CUDA_MATH=_CUDA_MATH, **shape,
                           **({} if not _CUDA_MATH else {"enable_fp_fusion": False}))
        _finish_kernel[(n,)](part_s, part_i, part_h, x0, top, negent, SPLITS=SPLITS,
                             CUDA_MATH=_CUDA_MATH, num_warps=1)
    return x0.view(lead), top.view(lead), negent.view(lead) if entropy else None
