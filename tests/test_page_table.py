"""The FlashInfer page table (CSR layout) built from ``req_to_token``, against a row-by-row
construction from the pages each request holds."""

from __future__ import annotations

import torch

from dllm.runner.attention.page_table import build_page_table
from dllm.runner.forward_batch import ForwardBatch, ForwardMode
from dllm.runner.memory import ReqToTokenPool, TokenToKVPool


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


def _denoise_batch(rows: list[int], starts: list[int], version: int | None):
    from dllm.runner.forward_batch import AttentionMask, LogitsMode, ScheduledBatch

    b = ScheduledBatch(ForwardMode.DLLM_EXTEND, attention_mask=AttentionMask.BLOCK_CAUSAL,
                       block_size=4, logits_mode=LogitsMode.ALL, table_version=version)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        b.add_row(f"r{i}", row, [7 + i] * 4, start)
    return b


def test_plan_key_changes_with_layout_and_slot_table():
    """A backend may reuse its plan only for a batch of the same rows, lengths and slot-table
    version: a freed and re-handed-out row (same index, other pages) gets a new key."""
    from dllm.runner.input_registry import InputRegistry

    req_pool = ReqToTokenPool(4, 32)
    reg = InputRegistry(4, 16, torch.device("cpu"))
    a, b = req_pool.alloc(), req_pool.alloc()
    v = req_pool.version
    key = reg.load(_denoise_batch([a, b], [8, 12], v), req_pool.req_to_token).layout_key
    # Another denoise step of the same block (other tokens): the same plan.
    again = _denoise_batch([a, b], [8, 12], v)
    again.input_ids = [1] * 8
    assert reg.load(again, req_pool.req_to_token).layout_key == key
    assert reg.load(_denoise_batch([a, b], [12, 12], v),
                    req_pool.req_to_token).layout_key != key  # the next block
    req_pool.free(b)
    assert req_pool.alloc() == b  # the same row index, handed out again
    assert reg.load(_denoise_batch([a, b], [8, 12], req_pool.version),
                    req_pool.req_to_token).layout_key != key
    assert reg.load(_denoise_batch([a, b], [8, 12], None),
                    req_pool.req_to_token).layout_key is None


def test_registry_pads_and_loads_every_field():
    """One staged copy per arena: values land in their fields, padding entries hold each
    field's padding value, device-resident values are copied too."""
    from dllm.runner.input_registry import InputRegistry

    req_pool = ReqToTokenPool(4, 32)
    row = req_pool.alloc()
    req_pool.req_to_token[row, :16] = torch.arange(100, 116)
    reg = InputRegistry(4, 16, torch.device("cpu"))
    reg.register("temperature", "reqs", torch.float32, 0.5)
    reg.register("editable", "tokens", torch.int64, 3)
    reg.register("state.k", "reqs", torch.int64, 9)
    batch = _denoise_batch([row], [8], 0)
    batch.row_inputs["temperature"] = [0.25]
    batch.token_inputs["editable"] = [1, 0, 1, 1]
    batch.row_tensors["state.k"] = torch.tensor([42])
    fb = reg.load(batch, req_pool.req_to_token, padded_bs=3, padded_tokens=12)
    assert fb.input_ids.tolist() == [7] * 4 + [0] * 8
    assert fb.positions.tolist() == [8, 9, 10, 11] + [0] * 8
    assert fb.seq_lens.tolist() == [12, 1, 1] and fb.extend_lens.tolist() == [4, 1, 1]
    assert fb.out_cache_loc.tolist() == [108, 109, 110, 111] + [0] * 8
    assert fb.extras["temperature"].tolist() == [0.25, 0.5, 0.5]
    assert fb.extras["editable"].tolist() == [1, 0, 1, 1] + [3] * 8
    assert fb.extras["state.k"].tolist() == [42, 9, 9]
