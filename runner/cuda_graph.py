"""``CudaGraphRunner`` (DESIGN §7): captures ``DLLM_EXTEND`` at ``bs × block_size`` tokens (the
unmasking step included) and ``DECODE`` (the sampling step included) for bucketed batch sizes,
and replays one graph per denoise or decode step. Shapes it did not capture fall back to the
eager runner.

A live batch is padded to the next captured size with padding rows that point at the reserved
request row 0 and KV page 0, copied into this runner's own static registry (fixed addresses),
planned with a FlashInfer wrapper kept per captured size (its plan buffers are fixed too), and
replayed."""

from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dllm.models.attention import Attention, AttentionLayer
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
)
from dllm.runner.input_registry import InputRegistry
from dllm.runner.model_runner import ModelRunner, PostStep, Runner

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in DEFAULT_BATCH_SIZES if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    fb: ForwardBatch
    output: Any
    backend: Any


class CudaGraphRunner(Runner):
    """``post_for(mode, bs, group, flags)`` gives the post-step to capture: the unmasking
    algorithm ``group`` over ``bs`` rows for ``DLLM_EXTEND``, the sampler for ``DECODE``;
    ``flags`` = (some row samples, some sampled row filters, some row filters), so a greedy
    batch replays a graph without the sampling work."""

    def __init__(self, owner: ModelRunner, block_size: int, sizes: list[int], max_context: int,
                 page_size: int,
                 post_for: Callable[[ForwardMode, int, str, tuple[bool, bool, bool]],
                                    PostStep],
                 modes: tuple[ForwardMode, ...] = (ForwardMode.DLLM_EXTEND,),
                 capture: bool = True):
        """``capture=False`` (``disable_cuda_graph``): the same padded batches, planned the
        same way, run eagerly. FlashInfer plans a CUDA-graph batch differently from a general
        one (tile sizes, KV splits) and a padded batch runs GEMMs of another shape, so only
        this keeps eager and graph steps identical, token for token."""
        from dllm.runner.attention.flashinfer import FlashInferBackend

        self.capture = capture
        self.owner = owner
        self.block_size = block_size
        self.sizes = sorted(sizes)
        self.page_size = page_size
        self.post_for = post_for
        self.modes = modes
        # The attention plan's head counts (None: no attention layer, e.g. pure Mamba2).
        self.layer: AttentionLayer | None = next(
            (m.spec for m in owner.model.modules() if isinstance(m, Attention)), None)
        self.dtype = next(owner.model.parameters()).dtype
        tokens_per_row = block_size if ForwardMode.DLLM_EXTEND in modes else 1
        self.registry = InputRegistry(self.sizes[-1], self.sizes[-1] * tokens_per_row,
                                      owner.device)
        for name, f in owner.registry.fields.items():
            self.registry.register(name, f.axis, f.dtype, f.pad)
        pages_per_row = -(-max_context // page_size)
        workspace = owner.backend.workspace if hasattr(owner.backend, "workspace") else None
        self.backends = {
            bs: FlashInferBackend(owner.device, page_size, workspace, use_cuda_graph=True,
                                  max_bs=bs, max_pages=bs * pages_per_row)
            for bs in self.sizes
        }
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[ForwardMode, int, str, tuple[bool, bool]], _Graph] = {}
        self._loaded: _Graph | None = None
        self.last_replayed: _Graph | None = None  # for profiling (bench/engine/offline.py)

    # ---- Runner interface ------------------------------------------------------------
    def can_run(self, batch: ScheduledBatch) -> bool:
        if (batch.mode not in self.modes or not self.sizes
                or batch.batch_size > self.sizes[-1]):
            return False
        if batch.mode is ForwardMode.DLLM_EXTEND:
            # Whole blocks only: a merged commit row (2·block_size tokens) runs eagerly.
            return (len(set(batch.row_groups)) == 1 and batch.block_size == self.block_size
                    and all(n == self.block_size for n in batch.extend_lens))
        return True

    def load_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        bs = self.sizes[bisect.bisect_left(self.sizes, batch.batch_size)]
        group = batch.row_groups[0] if batch.row_groups else ""
        key = (batch.mode, bs, group, _flags(batch))
        # First: a graph captured now (a group or flags not seen yet) loads and plans a dummy
        # batch into the same buffers.
        self._loaded = self._graph(*key) if self.capture else self.post_for(*key)
        padded = self._pad(batch, bs)
        fb = self.registry.load(padded, self.owner.req_to_token)
        fb.kv_pool, fb.attn_backend = self.owner.kv_pool, self.backends[bs]
        fb.state_pool = self.owner.state_pool
        if self.layer is not None:
            self.backends[bs].plan(fb, self.layer, self.dtype)
        return fb

    def execute(self, forward_batch: ForwardBatch, post: PostStep | None) -> Any:
        """Replay the graph ``load_batch`` chose (its inputs are in place and planned), or
        without capture run the forward and the post-step the graph would hold."""
        g, self._loaded = self._loaded, None
        if not self.capture:
            return g(forward_batch, *self.owner.run_model(forward_batch))
        g.graph.replay()
        self.last_replayed = g
        return _detach(g.output)

    # ---- capture ---------------------------------------------------------------------
    def capture_all(self, groups: list[str]) -> None:
        """Capture every size, largest first (smaller graphs reuse its memory pool). A size
        whose capture runs out of device memory is dropped with a warning: its batches run on
        the next larger captured size or, above the largest, eagerly."""
        if not self.capture:
            return
        dropped = []
        for bs in reversed(list(self.sizes)):
            try:
                for mode in self.modes:
                    for group in (groups if mode is ForwardMode.DLLM_EXTEND else [""]):
                        for flags in ((False, False, False), (True, True, True)):
                            self._graph(mode, bs, group, flags)
                continue
            except torch.OutOfMemoryError:
                pass
            # Out of memory: drop the size, and free the failed attempt's tensors (unreferenced
            # once the exception is gone).
            self.graphs = {k: g for k, g in self.graphs.items() if k[1] != bs}
            self.sizes.remove(bs)
            del self.backends[bs]
            dropped.append(bs)
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
        if dropped:
            logger.warning("CUDA graphs: out of device memory capturing batch size(s) %s; "
                           "captured %s (larger batches run eagerly; a lower "
                           "--cuda-graph-max-bs or KV budget avoids this)",
                           sorted(dropped), self.sizes)

    def _graph(self, mode: ForwardMode, bs: int, group: str,
               flags: tuple[bool, bool, bool]) -> _Graph:
        key = (mode, bs, group, flags)
        if key not in self.graphs:
            self.graphs[key] = self._capture(mode, bs, group, flags)
        return self.graphs[key]

    def _capture(self, mode: ForwardMode, bs: int, group: str,
                 flags: tuple[bool, bool, bool]) -> _Graph:
        backend = self.backends[bs]
        dummy = self._pad(self._empty(mode), bs)
        fb = self.registry.load(dummy, self.owner.req_to_token)
        fb.kv_pool, fb.attn_backend = self.owner.kv_pool, backend
        fb.state_pool = self.owner.state_pool
        if self.layer is not None:
            backend.plan(fb, self.layer, self.dtype)
        post = self.post_for(mode, bs, group, flags)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy initialisation stays out of the graph
                post(fb, *self.owner.run_model(fb))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = post(fb, *self.owner.run_model(fb))
        logger.debug("captured %s bs=%d %s", mode.value, bs, group)
        return _Graph(graph, fb, output, backend)

    # ---- padding ---------------------------------------------------------------------
    def _empty(self, mode: ForwardMode) -> ScheduledBatch:
        if mode is ForwardMode.DLLM_EXTEND:
            return ScheduledBatch(mode, attention_mask=AttentionMask.BLOCK_CAUSAL,
                                  block_size=self.block_size, logits_mode=LogitsMode.ALL)
        return ScheduledBatch(mode, attention_mask=AttentionMask.CAUSAL,
                              logits_mode=LogitsMode.LAST)

    def _pad(self, batch: ScheduledBatch, bs: int) -> ScheduledBatch:
        """``batch`` plus padding rows up to ``bs``: request row 0 (reserved, all slots in
        page 0), positions from 0, settings at each field's padding value."""
        n = bs - batch.batch_size
        t = self.block_size if batch.mode is ForwardMode.DLLM_EXTEND else 1
        out = ScheduledBatch(
            batch.mode, list(batch.rids), list(batch.req_pool_indices), list(batch.input_ids),
            list(batch.positions), list(batch.prefix_lens), list(batch.extend_lens),
            list(batch.seq_lens), batch.attention_mask, batch.block_size, batch.block_offset,
            batch.logits_mode, row_groups=list(batch.row_groups),
            table_version=batch.table_version, carry=batch.carry, kind=batch.kind,
            state_read_slots=list(batch.state_read_slots),
            state_write_slots=list(batch.state_write_slots),
            state_track_slots=list(batch.state_track_slots),
            state_write_gate=batch.state_write_gate,  # its real rows only: padding writes 0
        )
        for i in range(n):
            out.add_row(f"<pad{i}>", 0, [0] * t, 0)
            out.add_state(0 if batch.state_read_slots else None, 0)  # the padding slot
        fields = self.registry.fields
        for name in (set(fields) - set(_CORE)):
            f = fields[name]
            if f.axis == "reqs" and name.startswith("state."):
                src = batch.row_tensors.get(name)
                if src is not None and n == 0:  # a full batch: no padding rows to add
                    out.row_tensors[name] = src
                    continue
                pad = torch.full((n,), f.pad, dtype=f.dtype, device=self.owner.device)
                out.row_tensors[name] = pad if src is None else torch.cat([src, pad])
            elif f.axis == "reqs":
                out.row_inputs[name] = list(batch.row_inputs.get(
                    name, [f.pad] * batch.batch_size)) + [f.pad] * n
            else:
                out.token_inputs[name] = list(batch.token_inputs.get(
                    name, [f.pad] * batch.num_tokens)) + [f.pad] * (n * t)
        return out


def _flags(batch: ScheduledBatch) -> tuple[bool, bool, bool]:
    """Greedy batches replay the graph without sampling work; any sampling row takes the
    general graph (exact for every row). The flags are ``sampling_flags``'."""
    greedy = all(t == 0 for t in batch.row_inputs["temperature"])
    return (False, False, False) if greedy else (True, True, True)


_CORE = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens",
         "extend_lens", "seq_lens", "state_read_slots", "state_write_slots",
         "state_track_slots")


def _detach(output: Any) -> Any:
    """Copies of the graph's outputs: the next replay overwrites its buffers."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, tuple):
        return tuple(_detach(o) for o in output)
    if isinstance(output, dict):
        return {k: _detach(v) for k, v in output.items()}
    return output
