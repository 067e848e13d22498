"""The FlashInfer page table (CSR layout) built from ``req_to_token``, against a row-by-row
construction from the pages each request holds."""

from __future__ import annotations

import torch

from dllm.memory import ReqToTokenPool, TokenToKVPool
from dllm.runner.attention.page_table import build_page_table
from dllm.runner.forward_batch import ForwardBatch, ForwardMode


def test_page_table_matches_each_requests_pages():
    page = 4
    req_pool = ReqToTokenPool(6, 64)
    kv_pool = TokenToKVPool(64, page, 1, 1, 8, torch.float32)
    held = {}
    for n_pages in (3, 1, 5, 2, 4):  # allocate, free some, so pages are scattered
        row = req_pool.alloc()
        held[row] = kv_pool.alloc_pages(n_pages)
        req_pool.req_to_token[row, : n_pages * page] = kv_pool.slots_for(
            held[row], 0, n_pages * page)
    kv_pool.free_pages(held.pop(2))
    rows = sorted(held)
    assert rows == [1, 3, 4, 5]
    seq = [9, 17, 6, 13]  # keys attended per row, within its pages (rows 1, 3, 4, 5)
    ext = [3, 1, 4, 6]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=t([0] * sum(ext)),
        positions=t([0] * sum(ext)), req_pool_indices=t(rows),
        prefix_lens=t([s - e for s, e in zip(seq, ext, strict=True)]), extend_lens=t(ext),
        seq_lens=t(seq), out_cache_loc=t([0] * sum(ext)),
        prefix_lens_cpu=[s - e for s, e in zip(seq, ext, strict=True)], extend_lens_cpu=ext,
        seq_lens_cpu=seq, req_to_token=req_pool.req_to_token)
    table = build_page_table(fb, page)
    want_indices, want_ptr, want_last = [], [0], []
    for row, s in zip(rows, seq, strict=True):
        n = -(-s // page)
        want_indices += held[row][:n]
        want_ptr.append(want_ptr[-1] + n)
        want_last.append(s - (n - 1) * page)
    assert table.kv_indices.tolist() == want_indices
    assert table.kv_indptr.tolist() == want_ptr
    assert table.kv_last_page_len.tolist() == want_last
    assert table.qo_indptr.tolist() == [0, *torch.cumsum(t(ext), 0).tolist()]
    assert table.kv_indptr.dtype == table.qo_indptr.dtype == torch.int32
