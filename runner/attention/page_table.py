"""The paged-KV page table of a batch in FlashInfer's CSR layout, from ``req_to_token``.

Built with a fixed number of tensor operations whatever the batch size (no per-row Python
loop over tensors): the indptr arrays on the host, where the scheduler's lists already are,
and the page indices gathered on the device, so nothing is read back from the GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.runner.forward_batch import ForwardBatch


@dataclass
class PageTable:
    qo_indptr: torch.Tensor  # [bs+1] int32, host
    kv_indptr: torch.Tensor  # [bs+1] int32, host
    kv_indices: torch.Tensor  # [num_pages] int32, on the batch's device
    kv_last_page_len: torch.Tensor  # [bs] int32, host


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def build_page_table(fb: ForwardBatch, page_size: int) -> PageTable:
    """Row ``i`` attends to keys ``[0, seq_len_i)``: its pages are the pages of the slots of
    tokens ``0, page_size, 2·page_size, …`` (slot ``s`` lies in page ``s // page_size``).

    The page indices are gathered from the batch's device tensors, with sizes known on the
    host: no host-to-device copy, which would wait for the work already queued (the step
    still running under overlapped scheduling)."""
    device = fb.input_ids.device
    seq = torch.tensor(fb.seq_lens_cpu, dtype=torch.int64)
    pages = (seq + page_size - 1) // page_size
    total = int(pages.sum())
    kv_indptr = _indptr(pages)
    bs = len(fb.seq_lens_cpu)
    pages_dev = (fb.seq_lens[:bs] + page_size - 1) // page_size
    first_dev = torch.cumsum(pages_dev, 0) - pages_dev  # each row's first entry
    rows = torch.repeat_interleave(torch.arange(bs, device=device), pages_dev,
                                   output_size=total)
    cols = (torch.arange(total, device=device) - first_dev[rows]) * page_size
    indices = (fb.req_to_token[fb.req_pool_indices[rows], cols] // page_size).to(torch.int32)
    return PageTable(
        qo_indptr=_indptr(torch.tensor(fb.extend_lens_cpu, dtype=torch.int64)),
        kv_indptr=kv_indptr,
        kv_indices=indices,
        kv_last_page_len=(seq - (pages - 1) * page_size).to(torch.int32),
    )
