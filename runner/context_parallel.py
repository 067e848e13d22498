"""Context-parallel prefill (DESIGN §3, §9): an ``EXTEND`` forward split along the token axis.

Every rank of the context-parallel group runs the same batch (the engine replicas plan the
same batches, ``dllm.distributed``). In an ``EXTEND`` forward each rank keeps only its part of
each row's query tokens — a zigzag split: the row's tokens cut into ``2N`` near-equal chunks,
rank ``r`` takes chunks ``r`` and ``2N - 1 - r``, so under a causal or block-causal mask every
rank gets the same attention work (an early chunk, cheap, with a late one, dear). The model
runs on those tokens only: embeddings, projections, RoPE at their absolute positions, MLPs and
experts are per token. Each attention layer all-gathers the new K/V of the group, writes the
whole prompt's K/V into this rank's own paged cache (so every rank holds the full cache, and
the denoise and decode steps that follow run unsplit, replicated on every rank), and attends
its queries to the cached keys under the batch's mask, evaluated at absolute cache indices.
After the last layer the hidden states are all-gathered back into the batch's token order, so
the LM head, the logits mode and the post-step see the batch exactly as without the split.

The split of a batch is computed on the host from the scheduler's lists: nothing is read back
from the device. A rank's part of a row is expressed as one or two sub-rows of the local batch
(cache indices ``[prefix + lo, prefix + hi)`` of the same request), so the attention backend
underneath (SDPA, FlashInfer) attends them as it attends any row over a cached prefix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dllm.runner.attention.base import AttentionBackend, AttentionLayer
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode, LogitsMode


@dataclass(frozen=True)
class ContextParallel:
    """This process's place in the group an ``EXTEND`` forward's tokens split over."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed process group; None: the default one

    def splits(self, batch_mode: ForwardMode) -> bool:
        return self.size > 1 and batch_mode is ForwardMode.EXTEND

    def forward(self, model: torch.nn.Module, fb: ForwardBatch) -> torch.Tensor:
        """The hidden states ``[T, H]`` of the whole batch ``fb`` (an ``EXTEND`` batch over a
        KV cache), this rank computing only its zigzag share of every row; every rank
        returns the same tensor and has written the K/V of every token of ``fb``."""
        if fb.kv_pool is None or fb.req_to_token is None:
            raise ValueError("context-parallel prefill needs a paged KV cache")
        plan = SplitPlan.build(fb, self)
        local = plan.local_batch(fb, ContextParallelAttention(fb.attn_backend, self, plan,
                                                              fb.out_cache_loc))
        local.attn_backend.prepare(local)
        hidden = model(local.input_ids, local.positions, local)
        return plan.gather(hidden, self)


def zigzag_ranges(n: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[lo, hi)`` token ranges of a row of ``n`` tokens that ``rank`` of ``size``
    takes: chunks ``rank`` and ``2·size − 1 − rank`` of ``2·size`` chunks whose lengths differ
    by at most one (empty ones when ``n < 2·size``)."""
    cuts = 2 * size
    bound = [c * n // cuts for c in range(cuts + 1)]
    early, late = rank, cuts - 1 - rank
    return (bound[early], bound[early + 1]), (bound[late], bound[late + 1])


def _key_end(mask: AttentionMask, last_query: int, seq_len: int, block_size: int,
             block_offset: int) -> int:
    """One past the last key a query at cache index ``last_query`` (or any before it) may
    see: the mask's reach, within the row's ``seq_len`` keys."""
    if mask is AttentionMask.CAUSAL:
        return min(seq_len, last_query + 1)
    if mask is AttentionMask.BLOCK_CAUSAL:
        block = (last_query - block_offset) // block_size
        return min(seq_len, (block + 1) * block_size + block_offset)
    return seq_len


@dataclass
class SplitPlan:
    """One batch's split over the group, the same on every rank (all host lists)."""

    counts: list[int]  # tokens each rank holds
    local_tokens: torch.Tensor  # [counts[rank]] this rank's tokens, as indices of the batch's
    gather_index: torch.Tensor  # [T] where each batch token lies in the gathered [size·width]
    rows: list[int]  # the batch row of each local sub-row
    prefix_lens: list[int]  # each sub-row's first cache index
    extend_lens: list[int]
    seq_lens: list[int]

    @property
    def width(self) -> int:
        return max(self.counts)

    @classmethod
    def build(cls, fb: ForwardBatch, cp: ContextParallel) -> SplitPlan:
        starts = fb.extend_start_loc_cpu
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(cp.size)]
        rows, prefixes, extends, seqs = [], [], [], []
        for i, n in enumerate(fb.extend_lens_cpu):
            prefix, seq = fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            for r in range(cp.size):
                for lo, hi in zigzag_ranges(n, cp.size, r):
                    if hi == lo:
                        continue
                    per_rank[r].append(torch.arange(starts[i] + lo, starts[i] + hi))
                    if r == cp.rank:
                        rows.append(i)
                        prefixes.append(prefix + lo)
                        extends.append(hi - lo)
                        seqs.append(_key_end(fb.attention_mask, prefix + hi - 1, seq,
                                             fb.block_size, fb.block_offset))
        tokens = [torch.cat(t) if t else torch.zeros(0, dtype=torch.int64) for t in per_rank]
        counts = [int(t.numel()) for t in tokens]
        width = max(counts)
        gather_index = torch.empty(sum(counts), dtype=torch.int64)
        for r, t in enumerate(tokens):
            gather_index[t] = r * width + torch.arange(counts[r])
        return cls(counts, tokens[cp.rank], gather_index, rows, prefixes, extends, seqs)

    def local_batch(self, fb: ForwardBatch, backend: AttentionBackend) -> ForwardBatch:
        """``fb`` restricted to this rank's tokens: one sub-row per non-empty chunk."""
        device = fb.input_ids.device
        to = lambda values: _to_device(values, device)  # noqa: E731
        tokens = to(self.local_tokens)
        self.gather_index = to(self.gather_index)
        return dataclasses.replace(
            fb, batch_size=len(self.rows), input_ids=fb.input_ids[tokens],
            positions=fb.positions[tokens], out_cache_loc=fb.out_cache_loc[tokens],
            req_pool_indices=fb.req_pool_indices[to(self.rows)],
            prefix_lens=to(self.prefix_lens), extend_lens=to(self.extend_lens),
            seq_lens=to(self.seq_lens), prefix_lens_cpu=self.prefix_lens,
            extend_lens_cpu=self.extend_lens, seq_lens_cpu=self.seq_lens,
            logits_mode=LogitsMode.NONE, attn_backend=backend, attn_metadata=None,
            extras={}, row_groups=[], layout_key=None, memo={})

    def gather(self, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        """``[counts[rank], ...]`` on each rank → ``[T, ...]`` in the batch's token order."""
        width = self.width
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        out = x.new_empty(cp.size * width, *x.shape[1:])
        if dist.get_backend(cp.group) == "nccl":
            dist.all_gather_into_tensor(out, padded, group=cp.group)
        else:
            dist.all_gather(list(out.view(cp.size, width, *x.shape[1:]).unbind(0)), padded,
                            group=cp.group)
        return out.index_select(0, self.gather_index)


def _to_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(values, dtype=torch.int64)
    if device.type == "cuda":  # pinned and asynchronous: no wait for the queued work
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class ContextParallelAttention(AttentionBackend):
    """The attention of a split ``EXTEND``: gather the group's new K/V, write all of it to
    this rank's cache, attend this rank's queries with the backend underneath."""

    name = "context_parallel"

    def __init__(self, inner: AttentionBackend, cp: ContextParallel, plan: SplitPlan,
                 full_cache_loc: torch.Tensor):
        self.inner, self.cp, self.plan, self.full_cache_loc = inner, cp, plan, full_cache_loc

    def prepare(self, forward_batch: ForwardBatch) -> None:
        self.inner.prepare(forward_batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: AttentionLayer, forward_batch: ForwardBatch) -> torch.Tensor:
        fb = forward_batch
        if k is None:  # a fused layer wrote this rank's K/V to its slots already
            k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
            k, v = k_buf[fb.out_cache_loc].to(q.dtype), v_buf[fb.out_cache_loc].to(q.dtype)
        t, kv_heads, kd, vd = k.shape[0], k.shape[1], k.shape[2], v.shape[2]
        # One collective per layer: K and V side by side (a rank may hold no token: t = 0).
        both = self.plan.gather(torch.cat([k.reshape(t, kv_heads * kd),
                                           v.reshape(t, kv_heads * vd)], dim=1), self.cp)
        keys = both[:, : kv_heads * kd].reshape(-1, kv_heads, kd)
        values = both[:, kv_heads * kd :].reshape(-1, kv_heads, vd)
        fb.kv_pool.set_kv(layer.layer_id, self.full_cache_loc, keys, values)
        return self.inner.forward(q, None, None, layer, fb)
