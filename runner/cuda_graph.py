"""``CudaGraphRunner`` (DESIGN §7): captures the steps of one kind for bucketed batch sizes,
the post-step included, and replays one graph per step: ``DLLM_EXTEND`` rows of W query
tokens each (a denoise step: W = ``block_size``; a full-attention step's window, see
``dllm.full_diffusion``) and ``DECODE`` (one token a row). Shapes it did not capture fall back
to the eager runner.

A graph is identified by the padded row count, the tokens per row W and the step's own key
(``StepSpec.graph_key``: the algorithm, the sampling flags, whatever else the post-step's
shape depends on). The start-up windows are captured for every size at start; a key not seen
yet is captured on first use; so is another window, when the graph's tokens (rows × W) are
at most ``lazy_tokens`` (a graph per shape: a few, for the windows of a workload's
canvases), else its batches run eagerly. A capture that runs out of device memory leaves
that shape to the eager runner.

A live batch is padded to the next captured size with padding rows that point at the reserved
request row 0 and KV page 0, copied into this runner's own static registry (fixed addresses),
planned with a FlashInfer wrapper kept per captured size (its plan buffers are fixed too), and
replayed."""

from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable, Hashable
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
    StepKind,
)
from dllm.runner.input_registry import InputRegistry
from dllm.runner.model_runner import ModelRunner, PostStep, Runner

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)

# The forward of each captured step kind: mode, attention mask and the logits it computes.
_FORMS = {
    StepKind.DENOISE: (ForwardMode.DLLM_EXTEND, AttentionMask.BLOCK_CAUSAL, LogitsMode.ALL),
    StepKind.FULL_STEP: (ForwardMode.DLLM_EXTEND, AttentionMask.FULL, LogitsMode.NONE),
    StepKind.SAMPLE: (ForwardMode.DECODE, AttentionMask.CAUSAL, LogitsMode.LAST),
}


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
    """Graphs of the steps of ``kind``. ``post_for(bs, key)`` gives the post-step a graph of
    ``bs`` rows captures for a batch whose ``graph_key(batch)`` is ``key`` (None: no graph
    takes the batch); ``windows``: the tokens per row captured at start (``capture_all``)."""

    def __init__(self, owner: ModelRunner, kind: StepKind, sizes: list[int], max_context: int,
                 page_size: int, post_for: Callable[[int, Hashable], PostStep],
                 graph_key: Callable[[ScheduledBatch], Hashable | None],
                 windows: tuple[int, ...], lazy_tokens: int = 0, capture: bool = True):
        """``capture=False`` (``disable_cuda_graph``): the same padded batches, planned the
        same way, run eagerly. FlashInfer plans a CUDA-graph batch differently from a general
        one (tile sizes, KV splits) and a padded batch runs GEMMs of another shape, so only
        this keeps eager and graph steps identical, token for token."""
        from dllm.runner.attention.flashinfer import FlashInferBackend

        self.capture = capture
        self.owner = owner
        self.kind = kind
        self.mode, self.attention_mask, self.logits_mode = _FORMS[kind]
        self.windows = windows if self.mode is ForwardMode.DLLM_EXTEND else (1,)
        self.lazy_tokens = lazy_tokens if self.mode is ForwardMode.DLLM_EXTEND else 0
        self.sizes = sorted(sizes)
        self.page_size = page_size
        self.post_for = post_for
        self.graph_key = graph_key
        # The attention plan's head counts (None: no attention layer, e.g. pure Mamba2).
        self.layer: AttentionLayer | None = next(
            (m.spec for m in owner.model.modules() if isinstance(m, Attention)), None)
        self.dtype = next(owner.model.parameters()).dtype
        # Fixed buffers for the largest graph (they must not move once a graph reads them).
        self.registry = InputRegistry(
            self.sizes[-1], max(self.sizes[-1] * max(self.windows, default=1), self.lazy_tokens),
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
        self.graphs: dict[tuple[int, int, Hashable], _Graph] = {}
        self.failed: set[tuple[int, int, Hashable]] = set()  # out of memory at capture
        self.warned_rows = False  # a batch above the largest size was logged
        self._loaded: _Graph | PostStep | None = None
        self.last_replayed: _Graph | None = None  # for profiling (bench/engine/offline.py)

    @property
    def name(self) -> str:
        return "cuda_graph" if self.capture else "eager"

    # ---- Runner interface ------------------------------------------------------------
    def _shape(self, batch: ScheduledBatch) -> tuple[int, int, Hashable] | None:
        """``(padded rows, tokens per row, key)`` of the graph that would run ``batch``."""
        if batch.mode is not self.mode or not self.sizes:
            return None
        if batch.batch_size > self.sizes[-1]:
            if self.capture and not self.warned_rows:  # once: each such batch runs eagerly
                self.warned_rows = True
                logger.warning("CUDA graphs: a batch of %d rows is above the largest captured "
                               "size (%d rows) and runs eagerly (a merged commit or a CFG twin "
                               "is a second row of its request); --cuda-graph-max-bs or "
                               "--cuda-graph-bs captures larger batches, up to 256 rows",
                               batch.batch_size, self.sizes[-1])
            return None
        window = batch.block_size if self.mode is ForwardMode.DLLM_EXTEND else 1
        # Whole windows only: a merged commit row (2·block_size tokens) runs eagerly.
        if any(n != window for n in batch.extend_lens):
            return None
        key = self.graph_key(batch)
        if key is None:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, batch.batch_size)], window, key

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Whether a graph takes ``batch``; a shape allowed but not captured yet is captured
        here, first (``capture=False``: nothing to capture)."""
        shape = self._shape(batch)
        if shape is None or shape in self.failed:
            return False
        bs, window, _ = shape
        if window not in self.windows and bs * window > self.lazy_tokens:
            return False
        if not self.capture or shape in self.graphs:
            return True
        return self._try_graph(*shape) is not None

    def load_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        bs, window, key = self._shape(batch)
        self._loaded = self.graphs[bs, window, key] if self.capture else self.post_for(bs, key)
        padded = self._pad(batch, bs, window)
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
    def capture_all(self, keys: list[Hashable]) -> None:
        """Capture every size for the start-up windows and ``keys``, largest first (smaller
        graphs reuse its memory pool). A size whose capture runs out of device memory is
        dropped with a warning: its batches run on the next larger captured size or, above
        the largest, eagerly."""
        if not self.capture:
            return
        dropped = []
        for bs in reversed(list(self.sizes)):
            try:
                for window in self.windows:
                    for key in keys:
                        self._graph(bs, window, key)
                continue
            except torch.OutOfMemoryError:
                pass
            # Out of memory: drop the size, and free the failed attempt's tensors (unreferenced
            # once the exception is gone).
            self.graphs = {k: g for k, g in self.graphs.items() if k[0] != bs}
            self.sizes.remove(bs)
            del self.backends[bs]
            dropped.append(bs)
            _free()
        if dropped:
            logger.warning("CUDA graphs: out of device memory capturing batch size(s) %s; "
                           "captured %s (larger batches run eagerly; a lower "
                           "--cuda-graph-max-bs or KV budget avoids this)",
                           sorted(dropped), self.sizes)

    def _try_graph(self, bs: int, window: int, key: Hashable) -> _Graph | None:
        """A graph captured on first use; None (and the shape left to the eager runner) when
        its capture runs out of device memory."""
        try:
            return self._graph(bs, window, key)
        except torch.OutOfMemoryError:
            self.failed.add((bs, window, key))
            _free()
            logger.warning("CUDA graphs: out of device memory capturing %d rows of %d "
                           "tokens; such batches run eagerly", bs, window)
            return None

    def _graph(self, bs: int, window: int, key: Hashable) -> _Graph:
        shape = (bs, window, key)
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(bs, window, key)
        return self.graphs[shape]

    def _capture(self, bs: int, window: int, key: Hashable) -> _Graph:
        backend = self.backends[bs]
        dummy = self._pad(ScheduledBatch(self.mode, attention_mask=self.attention_mask,
                                         block_size=window, logits_mode=self.logits_mode,
                                         kind=self.kind), bs, window)
        fb = self.registry.load(dummy, self.owner.req_to_token)
        fb.kv_pool, fb.attn_backend = self.owner.kv_pool, backend
        fb.state_pool = self.owner.state_pool
        if self.layer is not None:
            backend.plan(fb, self.layer, self.dtype)
        post = self.post_for(bs, key)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy initialisation stays out of the graph
                post(fb, *self.owner.run_model(fb))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = post(fb, *self.owner.run_model(fb))
        logger.debug("captured %s bs=%d window=%d %s", self.mode.value, bs, window, key)
        return _Graph(graph, fb, output, backend)

    # ---- padding ---------------------------------------------------------------------
    def _pad(self, batch: ScheduledBatch, bs: int, t: int) -> ScheduledBatch:
        """``batch`` plus padding rows of ``t`` tokens up to ``bs``: request row 0 (reserved,
        all slots in page 0), positions from 0, settings at each field's padding value."""
        n = bs - batch.batch_size
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
            if name in _OPTIONAL and name not in batch.row_inputs:
                continue  # their absence means something (the carry's whole width)
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


_CORE = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens",
         "extend_lens", "seq_lens", "state_read_slots", "state_write_slots",
         "state_track_slots")
# Registry inputs a batch may leave out (``InputRegistry._gather_carry``).
_OPTIONAL = ("carry_at", "carry_len")


def _free() -> None:
    """Give back what a failed capture allocated (its tensors are unreferenced by now)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


def _detach(output: Any) -> Any:
    """Copies of the graph's outputs: the next replay overwrites its buffers."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, tuple):
        return tuple(_detach(o) for o in output)
    if isinstance(output, dict):
        return {k: _detach(v) for k, v in output.items()}
    return output
