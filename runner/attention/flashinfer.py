"""FlashInfer attention over the paged KV cache (DESIGN §8). GPU only; imported lazily.

One plan per forward, reused by every layer:
- ``DLLM_EXTEND`` where every row is one whole block, and ``DECODE``, where Triton is
  installed: no FlashInfer plan, the project's Triton kernel
  (``dllm.runner.kernels.triton_extend``: q and the output in their natural layout, one
  program per row and KV head, keys split over several programs at small batch, query tiles
  of 64 rows and more unsplit in 64-row chunks while their grid is under a wave:
  ``triton_extend.plan``);
- other ``DLLM_EXTEND`` (a block on top of its cached prefix, the block non-causal inside): paged
  prefill with ``causal=False`` — each query sees every key of ``[0, seq_len)``. A batch with
  enough rows to fill the GPU alone (rows × KV heads ≥ SMs) runs each row as one decode query
  of ``block_size × heads`` query heads instead (each KV head's group of query heads times the
  block's tokens), unsplit: the decode kernel (on tensor cores) packs exactly those rows per KV
  head, where the paged prefill planned for a CUDA graph sizes its tiles by the whole batch's
  tokens (193 µs a layer at 128 rows of SDAR-8B, against 9 µs at one row);
- ``EXTEND`` with ``CAUSAL``: paged prefill with ``causal=True`` (queries are the last
  ``extend_len`` keys of their sequence);
- ``EXTEND`` with ``FULL``: ``causal=False`` (also the dual cache, whose keys run past the
  queries);
- ``EXTEND`` with ``BLOCK_CAUSAL`` over several prompt blocks, and a ``DLLM_EXTEND`` batch with
  a merged commit row (a finished block and the next one): a custom mask, built on the
  device from cache indices;
- ``DECODE`` without Triton: the batch-decode kernel.

The page table comes from ``req_to_token`` on the device (slot ``s`` lies in page
``s // page_size``); only the ``indptr`` arrays, which the scheduler's host lists give, are
built on the host, so planning reads nothing back from the GPU.
"""

from __future__ import annotations

import flashinfer
import torch

from dllm.runner.attention import triton_available
from dllm.runner.attention.base import AttentionBackend, AttentionLayer
from dllm.runner.attention.mask import visibility
from dllm.runner.attention.page_table import build_page_table
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode
from dllm.runner.kernels.hardware import num_sms

WORKSPACE_BYTES = 256 * 2**20


def _whole_blocks(fb: ForwardBatch) -> bool:
    """A ``DLLM_EXTEND`` batch whose every row is one whole block (the forms that treat a
    row as ``block_size`` queries over its keys)."""
    return (fb.mode is ForwardMode.DLLM_EXTEND
            and all(n == fb.block_size for n in fb.extend_lens_cpu))


def block_causal_mask(fb: ForwardBatch) -> torch.Tensor:
    """Flattened ``sum(q_len * kv_len)`` bool mask, row-major per request."""
    device = fb.input_ids.device
    parts = []
    for p, n, s in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, fb.seq_lens_cpu, strict=True):
        parts.append(visibility(AttentionMask.BLOCK_CAUSAL, torch.arange(p, p + n, device=device),
                                torch.arange(s, device=device), fb.block_size,
                                fb.block_offset).flatten())
    return torch.cat(parts)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device, page_size: int,
                 workspace: torch.Tensor | None = None, use_cuda_graph: bool = False,
                 max_bs: int | None = None, max_pages: int | None = None):
        """``use_cuda_graph``: a backend of one captured batch size, planning into fixed
        buffers for exactly ``max_bs`` rows and at most ``max_pages`` pages (FlashInfer's
        CUDA-graph wrappers refuse any other batch size). Otherwise a general backend (the
        eager runner) for batches of any shape."""
        self.device = device
        self.num_sms = num_sms(device)
        # Programmatic dependent launch of the Triton kernel stays off: measured slower
        # (``layer_ops.FlashInferOps.pdl``).
        self.pdl = False
        self.page_size = page_size
        self.workspace = workspace if workspace is not None else torch.empty(
            WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if use_cuda_graph:
            if not (max_bs and max_pages):
                raise ValueError("a CUDA-graph backend needs max_bs and max_pages")
            # Fixed buffers: a captured graph reads the plan from the same addresses at every
            # replay.
            i32 = dict(dtype=torch.int32, device=device)
            kv_indptr = torch.zeros(max_bs + 1, **i32)
            kv_indices = torch.zeros(max_pages, **i32)
            last = torch.zeros(max_bs, **i32)
            self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(max_bs + 1, **i32), paged_kv_indptr_buf=kv_indptr,
                paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last)
            # Tensor cores pay off for grouped-query attention, the common layout.
            self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True, use_cuda_graph=True,
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last)
            # A CUDA-graph plan without KV splitting (the packed form below) launches its
            # padded grid with no mask for the padding blocks, which read the plan's unwritten
            # tail: zeroed, they repeat the first row's work (same values, written again)
            # instead of reading whatever a reused pinned block held (FlashInfer issue 4002).
            for wrapper in (self.prefill, self.decode):
                pinned = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
                if pinned is not None:
                    pinned.zero_()
        else:
            self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True)
        # ``DLLM_EXTEND`` with every row a whole block, and ``DECODE``, run the Triton kernel
        # where Triton is installed (``triton_extend``: no plan, no head permutation; 1.6×
        # faster than the packed form below at 128 rows of SDAR-8B and 1.9× than the paged
        # prefill at one).
        self.triton_extend = None
        if triton_available():
            from dllm.runner.kernels import triton_extend

            self.triton_extend = triton_extend
        # The wrapper planned for this forward, and the query tokens per decode row (the
        # block size for ``DLLM_EXTEND``, else 1).
        self._planned: tuple[object, int] | None = None
        # The last plan: its batch layout key and wrapper. A denoise block runs the same
        # layout step after step, so most steps skip the page table and the planning.
        self._last: tuple[tuple, tuple[object, int]] | None = None
        # FlashInfer's ``plan`` fills a pinned host buffer and queues its copy to the device:
        # with the next step built before this one runs (overlapped scheduling), the next
        # plan must wait until that copy is done before it writes the buffer again.
        self._plan_copied: torch.cuda.Event | None = None

    def prepare(self, forward_batch: ForwardBatch) -> None:
        # Planning needs the head counts, known at the first layer: plan lazily there,
        # unless the caller planned already (a CUDA graph is captured or replayed after
        # ``plan`` ran outside it).
        if forward_batch.attn_metadata is None:
            self._planned = None

    def plan(self, fb: ForwardBatch, layer: AttentionLayer, dtype: torch.dtype) -> None:
        """Plan now (outside a graph capture) and mark the batch as planned."""
        self._planned = self._plan(fb, layer, dtype)
        fb.attn_metadata = "planned"

    def _plan(self, fb: ForwardBatch, layer: AttentionLayer,
              dtype: torch.dtype) -> tuple[object, int]:
        """Plan the batch (or reuse the last plan, for the same layout); returns the wrapper
        whose ``run`` every layer calls, and the query tokens it packs per row (``None``
        and the block size: the Triton kernel, which needs no plan)."""
        triton_rows = fb.mode is ForwardMode.DECODE or _whole_blocks(fb)
        if (self.triton_extend is not None and triton_rows
                and self.triton_extend.supports(dtype, fb.kv_pool.dtype, layer.num_heads,
                                                layer.num_kv_heads, layer.head_dim,
                                                self.device)):
            return None, 1 if fb.mode is ForwardMode.DECODE else fb.block_size
        if fb.layout_key is not None and self._last is not None and self._last[0] == fb.layout_key:
            return self._last[1]
        self._last = None
        wrapper = self._plan_new(fb, layer, dtype)
        if fb.layout_key is not None:
            self._last = (fb.layout_key, wrapper)
        return wrapper

    def _plan_new(self, fb: ForwardBatch, layer: AttentionLayer,
                  dtype: torch.dtype) -> tuple[object, int]:
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        wrapper = self._plan_wrapper(fb, layer, dtype)
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()
        return wrapper

    def _plan_wrapper(self, fb: ForwardBatch, layer: AttentionLayer,
                      dtype: torch.dtype) -> tuple[object, int]:
        table = build_page_table(fb, self.page_size)
        common = dict(num_kv_heads=layer.num_kv_heads, page_size=self.page_size,
                      q_data_type=dtype, kv_data_type=fb.kv_pool.dtype, sm_scale=layer.scaling)
        rows = len(fb.seq_lens_cpu)
        packed = rows * layer.num_kv_heads >= self.num_sms and _whole_blocks(fb)
        if fb.mode is ForwardMode.DECODE or packed:
            block = fb.block_size if packed else 1
            self.decode.plan(table.kv_indptr, table.kv_indices, table.kv_last_page_len,
                             num_qo_heads=layer.num_heads * block, head_dim=layer.head_dim,
                             disable_split_kv=packed, **common)
            return self.decode, block
        mask = None
        causal = fb.attention_mask is AttentionMask.CAUSAL
        qo_indptr, kv_indptr, last = table.qo_indptr, table.kv_indptr, table.kv_last_page_len
        if fb.attention_mask is AttentionMask.BLOCK_CAUSAL and not _whole_blocks(fb):
            # Multi-block prompt prefill, or a denoise batch with a merged commit row (its
            # first block must not see its second): FlashInfer packs the custom mask on the
            # device and wants the indptr arrays there (such a batch is never graph-captured).
            mask = block_causal_mask(fb)
            qo_indptr, kv_indptr, last = (t.to(self.device) for t in (qo_indptr, kv_indptr, last))
        self.prefill.plan(qo_indptr, kv_indptr, table.kv_indices,
                          last, num_qo_heads=layer.num_heads,
                          head_dim_qk=layer.head_dim, custom_mask=mask, causal=causal, **common)
        return self.prefill, 1

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: AttentionLayer, forward_batch: ForwardBatch) -> torch.Tensor:
        fb = forward_batch
        if fb.mode is ForwardMode.IDLE or q.shape[0] == 0:
            return q.new_empty(q.shape)
        if k is not None:  # else written by the layer
            fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        if self._planned is None:
            self._planned = self._plan(fb, layer, q.dtype)
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        shape = (-1, self.page_size, layer.num_kv_heads, layer.head_dim)
        cache = (k_buf.view(shape), v_buf.view(shape))
        wrapper, block = self._planned
        if wrapper is None:  # the Triton kernel: rows of ``block`` tokens (1: decode)
            rows = q.shape[0] // block
            # The key splits and query tile from host numbers alone (rows, heads, block), so
            # a captured graph's grid holds for any lengths: few rows split each row's keys
            # over several programs; wide query tiles run unsplit in 64-row chunks.
            splits, tile = self.triton_extend.plan(
                rows, layer.num_kv_heads, block * layer.num_heads // layer.num_kv_heads,
                layer.head_dim, self.num_sms)
            return self.triton_extend.dllm_extend_attention(
                q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices[:rows],
                fb.seq_lens[:rows], block, layer.scaling, config=tile, num_splits=splits,
                pdl=self.pdl)
        if block == 1:
            return wrapper.run(q.contiguous(), cache)
        # [rows·block, heads, d] -> [rows, kv heads · block · group, d]: query head
        # (token t, head h) of a row sits in KV head h // group's run of block × group heads.
        n, h, d = q.shape
        hkv = layer.num_kv_heads
        g = h // hkv
        rows = q.view(n // block, block, hkv, g, d).transpose(1, 2).reshape(n // block, -1, d)
        out = wrapper.run(rows, cache)
        return out.view(n // block, hkv, block, g, d).transpose(1, 2).reshape(n, h, d)
