"""Pooled embeddings through the engine: causal ``EXTEND`` over the prompt (chunked by the
token budget, KV kept between chunks), pooled on the device, one vector per request."""

from __future__ import annotations

from typing import Any

import torch

from dllm.models.pooling import PoolingConfig, PoolingType, finish_embedding
from dllm.request import FinishReason, Req
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
    StepKind,
)
from dllm.scheduler import Scheduler


def pool_parts(fb: ForwardBatch, hidden: torch.Tensor, logits: Any) -> tuple[torch.Tensor, ...]:
    """Per row of the chunk: the sum, the first and the last hidden state (float32)."""
    bs = len(fb.extend_lens_cpu)
    n = sum(fb.extend_lens_cpu)
    h = hidden[:n].float()
    ext = fb.extend_lens[:bs]
    rows = torch.repeat_interleave(torch.arange(bs, device=h.device), ext, output_size=n)
    sums = torch.zeros(bs, h.shape[1], dtype=h.dtype, device=h.device).index_add_(0, rows, h)
    last = fb.last_token_index[:bs]
    first = last - ext + 1
    return sums, h[first], h[last]


class EmbeddingScheduler(Scheduler):
    def __init__(self, *args: Any, pooling: PoolingConfig, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pooling = pooling

    def schedule(self) -> list[ScheduledBatch]:
        rows = self.chunk_prefill(lambda r: r.prompt_len, 1)
        if not rows:
            return []
        batch = ScheduledBatch(ForwardMode.EXTEND, kind=StepKind.POOL,
                               attention_mask=AttentionMask.CAUSAL, logits_mode=LogitsMode.NONE)
        for req, start, end in rows:
            batch.add_row(req.rid, req.req_pool_idx, req.prompt_ids[start:end], start)
        return [batch]

    def update(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        sums, first, last = output

        def apply_row(i: int, req: Req) -> bool:
            req.num_forward_passes += 1
            st = req.embed.pool_state
            if batch.prefix_lens[i] == 0:
                st["first"], st["sum"] = first[i], sums[i]
            else:
                st["sum"] = st["sum"] + sums[i]
            st["last"] = last[i]
            req.prefilled_len += batch.extend_lens[i]
            if req.needs_prefill:
                return False
            pooled = {PoolingType.LAST: st["last"], PoolingType.CLS: st["first"],
                      PoolingType.MEAN: st["sum"] / req.prompt_len}[self.pooling.pooling]
            emb = req.embed
            normalize = self.pooling.normalize if emb.normalize is None else emb.normalize
            emb.embedding = finish_embedding(pooled, normalize, emb.dimensions).tolist()
            emb.pool_state = {}
            self.finish(req, FinishReason.STOP)
            return True

        return self.apply_rows(batch, apply_row)
