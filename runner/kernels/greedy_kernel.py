"""The greedy draw and its confidence in one pass over the logits (Triton; CUDA only).

A batch whose rows are all greedy needs, per position, only ``x0 = argmax(logits)`` (the
excluded id never wins while another id is finite, ties go to the lowest id; as in the
reference, a row of nothing but -inf gives id 0) and the log-probability of ``x0`` under
the plain softmax, ``-log1p(S)`` with ``S = Σ_{i ≠ x0} exp(logit_i - top)``
(``sampling.log_probs``'s form, exact near a confidence of 1). The reference computes
that with about ten float32 passes over a ``[positions, vocab]`` copy of the logits (1.6 ms
a step at 512 positions of a 151936-token vocabulary on an H200); this reads the logits once.

Each position's vocabulary is cut into ``SPLITS`` fixed slices. A program reduces one slice
of one position to ``(max, first argmax, S of the slice)``: each of its ``BLOCK`` lanes keeps
a running state over the ids it sees (a larger value rescales the lane's sum by
``exp(old - new)`` and adds the old top as a term: one exp per id), and one tree reduction
merges the lanes at the end (ties go to the lower id); a second kernel merges the slices in
order the same way. An earlier version reduced every chunk across the block (three block
reductions per chunk): 157 µs at 512 positions on an H200, about 4× its logits read. The
slicing, the chunk size and the reduction tree depend on the vocabulary size alone, so a
position's result depends on that position's logits alone, whatever the batch (the property
``dllm.algorithms.reductions`` gives the reference); the summation order differs from the
reference's, so the two agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLITS = 16  # vocabulary slices per position: enough programs at one row, few partials
BLOCK = 2048  # ids per chunk


@triton.jit
def _merge(m, i, s, bm, bi, bs):
    """Merge two states ``(max, argmax, S)`` (``S`` sums ``exp(x - max)`` over every id but
    the argmax): the larger maximum wins, a tie goes to the lower id (``tl.reduce``'s tree
    does not visit lanes in id order). The loser's top joins the sum, scaled to the winner's
    maximum; an empty state (-inf) adds nothing (its exp would be exp(nan) otherwise)."""
    later = (bm > m) | ((bm == m) & (bi < i))
    lose_m = tl.where(later, m, bm)
    win_m = tl.where(later, bm, m)
    lose_s = tl.where(later, s, bs)
    win_s = tl.where(later, bs, s)
    scale = tl.where(lose_m > float("-inf"), tl.exp(lose_m - win_m), 0.0)
    return win_m, tl.where(later, bi, i), win_s + (lose_s + 1.0) * scale


@triton.jit
def _slice_kernel(logits_ptr, row_stride, vocab, exclude, part_m, part_i, part_s,
                  SLICE: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * row_stride
    start = part * SLICE
    lane = tl.arange(0, BLOCK)
    # Lane state: its maximum, that id, and S over the lane's other ids (relative to the max).
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    i = start + lane
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, SLICE, BLOCK):
        offs = start + c + lane
        valid = (offs < vocab) & (offs != exclude)
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
        # ids rise along a lane: a later id wins only with a strictly larger value
        up = x > m
        lo = tl.minimum(x, m)
        e = tl.where(lo > float("-inf"), tl.exp(lo - tl.maximum(x, m)), 0.0)
        s = tl.where(up, (s + 1.0) * e, s + e)
        i = tl.where(up, offs, i)
        m = tl.maximum(x, m)
    m, i, s = tl.reduce((m, i, s), 0, _merge)
    out = row * SPLITS + part
    tl.store(part_m + out, m)
    tl.store(part_i + out, i)
    tl.store(part_s + out, s)


@triton.jit
def _row_kernel(part_m, part_i, part_s, x0_ptr, logconf_ptr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    m = tl.load(part_m + row * SPLITS)
    i = tl.load(part_i + row * SPLITS)
    s = tl.load(part_s + row * SPLITS)
    for p in tl.static_range(1, SPLITS):
        m, i, s = _merge(m, i, s, tl.load(part_m + row * SPLITS + p),
                         tl.load(part_i + row * SPLITS + p), tl.load(part_s + row * SPLITS + p))
    # log1p(s) without a libdevice call: log(u) * s / (u - 1) with u = 1 + s is accurate to
    # a few ulp (Goldberg), and s itself where u rounds to 1 (a confidence of 1 - 1e-9 keeps
    # its distinct log-probability, as in the reference).
    u = 1.0 + s
    log1p = tl.where(u == 1.0, s, tl.log(u) * (s / tl.where(u == 1.0, 1.0, u - 1.0)))
    tl.store(x0_ptr + row, i.to(tl.int64))
    tl.store(logconf_ptr + row, -log1p)


def supports(logits: torch.Tensor) -> bool:
    return (logits.is_cuda and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and logits.shape[-1] > 0 and logits.stride(-1) == 1)


def greedy_log_confidence(logits: torch.Tensor,
                          exclude_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [..., V]`` → ``(x0 [...] int64, log-probability of x0 [...] float32)``."""
    lead = logits.shape[:-1]
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    n = rows.shape[0]
    dev = logits.device
    part_m = torch.empty((n, SPLITS), dtype=torch.float32, device=dev)
    part_i = torch.empty((n, SPLITS), dtype=torch.int32, device=dev)
    part_s = torch.empty((n, SPLITS), dtype=torch.float32, device=dev)
    x0 = torch.empty(n, dtype=torch.int64, device=dev)
    logconf = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        slice_len = triton.cdiv(triton.cdiv(vocab, SPLITS), BLOCK) * BLOCK
        _slice_kernel[(n, SPLITS)](rows, rows.stride(0), vocab,
                                   -1 if exclude_id is None else exclude_id,
                                   part_m, part_i, part_s, SLICE=slice_len, BLOCK=BLOCK,
                                   SPLITS=SPLITS, num_warps=8)
        _row_kernel[(n,)](part_m, part_i, part_s, x0, logconf, SPLITS=SPLITS, num_warps=1)
    return x0.view(lead), logconf.view(lead)
