"""Reference attention backend: torch ``scaled_dot_product_attention`` over the paged cache.

Works on CPU and GPU. Each request's keys are gathered from its slots (``req_to_token``) and an
explicit boolean mask is built from cache indices, so every ``AttentionMask`` rule is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.runner.attention.base import AttentionBackend, AttentionLayer
from dllm.runner.attention.mask import visibility
from dllm.runner.forward_batch import ForwardBatch, ForwardMode


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        fb = forward_batch
        if fb.mode is ForwardMode.IDLE or q.shape[0] == 0:
            return q.new_empty(q.shape)
        if fb.kv_pool is not None:
            if k is not None:  # else written by the layer
                fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
            k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        out = torch.empty_like(q)
        group = layer.num_heads // layer.num_kv_heads
        starts = fb.extend_start_loc_cpu
        for i in range(fb.batch_size):
            start, n = starts[i], fb.extend_lens_cpu[i]
            prefix, seq_len = fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            if fb.kv_pool is not None:
                # A 1-element index tensor: no host read of the row number.
                slots = fb.req_to_token[fb.req_pool_indices[i : i + 1], :seq_len][0]
                keys, values = k_buf[slots], v_buf[slots]
            else:
                if prefix != 0 or seq_len != n:
                    raise ValueError("attention without a KV cache cannot have a prefix")
                keys, values = k[start : start + n], v[start : start + n]
            device = q.device
            allowed = visibility(
                fb.attention_mask,
                torch.arange(prefix, prefix + n, device=device),
                torch.arange(seq_len, device=device),
                fb.block_size,
                fb.block_offset,
            )
            qi = q[start : start + n].transpose(0, 1)  # [H, n, D]
            ki = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, seq, D]
            vi = values.transpose(0, 1).repeat_interleave(group, dim=0)
            oi = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                attn_mask=allowed, scale=layer.scaling,
            )
            out[start : start + n] = oi.squeeze(0).transpose(0, 1)
        return out
