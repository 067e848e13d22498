"""The device half of loading a batch of uniform rows (``InputRegistry.load``) in one Triton
launch (CUDA only; the registry falls back to torch without Triton or on the CPU).

A batch whose every row has ``width`` tokens (a ``DLLM_EXTEND`` batch of whole blocks, a
``DECODE`` batch) needs two gathers once its host values have landed: the input ids of rows
that continue from an in-flight output (``ScheduledBatch.carry``: row ``carry_row[r]`` of the
carried tokens, where ``carry_row[r] >= 0``) and the cache slot of every token
(``req_to_token[req_pool_indices[r], positions[t]]``). In torch that is about ten small
kernels (clamp, compare, index, where, copy; repeat_interleave with its scan, index, copy),
each ~1-2 µs plus a gap, outside the CUDA graph, on every step; here it is one program per
row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Everything but the block size is a run-time value, kept out of Triton's specialisation
# (an int of 1 or a multiple of 16, a pointer's 16-byte alignment, each compile a variant of
# its own: the registry's buffers move when it grows): a new variant compiled
# while a server runs stalls it for a second, and the first carried step comes after the
# CUDA graphs' warm-up has compiled the kernels (with no carry).
@triton.jit(do_not_specialize=["stride_cr", "stride_cc", "stride_t", "width", "carry", "loc"],
            do_not_specialize_on_alignment=["carry_ptr", "carry_row_ptr", "ids_ptr",
                                            "table_ptr", "req_ptr", "pos_ptr", "loc_ptr"])
def _stage_kernel(carry_ptr, carry_row_ptr, ids_ptr, table_ptr, req_ptr, pos_ptr, loc_ptr,
                  stride_cr, stride_cc, stride_t, width, carry, loc, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < width
    tok = r * width + j
    if carry != 0:
        src = tl.load(carry_row_ptr + r)
        if src >= 0:
            ids = tl.load(carry_ptr + src * stride_cr + j * stride_cc, mask=ok)
            tl.store(ids_ptr + tok, ids, mask=ok)
    if loc != 0:
        req = tl.load(req_ptr + r)
        pos = tl.load(pos_ptr + tok, mask=ok, other=0)
        tl.store(loc_ptr + tok, tl.load(table_ptr + req * stride_t + pos, mask=ok), mask=ok)


def stage_rows(rows: int, width: int, input_ids: torch.Tensor, positions: torch.Tensor,
               req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
               out_cache_loc: torch.Tensor | None, carry: torch.Tensor | None,
               carry_row: torch.Tensor | None) -> None:
    """For the first ``rows`` rows of ``width`` tokens: ``input_ids[r·width + j] =
    carry[carry_row[r], j]`` where ``carry_row[r] >= 0`` (``carry`` given), and
    ``out_cache_loc[t] = req_to_token[req_pool_indices[t // width], positions[t]]``
    (``out_cache_loc`` given). All int64 on one CUDA device; ``req_to_token``'s rows
    contiguous."""
    if rows == 0 or (carry is None and out_cache_loc is None):
        return
    assert req_to_token.stride(1) == 1
    if carry is not None:
        assert carry.shape[1] == width and carry_row is not None
    dummy = input_ids
    _stage_kernel[(rows,)](
        carry if carry is not None else dummy, carry_row if carry_row is not None else dummy,
        input_ids, req_to_token, req_pool_indices, positions,
        out_cache_loc if out_cache_loc is not None else dummy,
        carry.stride(0) if carry is not None else 0, carry.stride(1) if carry is not None else 0,
        req_to_token.stride(0), width, int(carry is not None), int(out_cache_loc is not None),
        BLOCK=triton.next_power_of_2(width), num_warps=1)
