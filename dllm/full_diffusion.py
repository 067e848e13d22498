"""Generation for full-attention diffusion models: LLaDA, LLaDA-MoE, Dream (DESIGN §4, last
bullet).

Semantics are LLaDA's ``generate``: the canvas is the prompt followed by ``max_new_tokens``
mask tokens and every token attends to every other, the masked tail included. The canvas is
decoded in blocks of ``block_size`` positions starting at the prompt end (semi-autoregressive),
each block in the algorithm's steps; a block's tokens are final when it has no mask left.

**A step.** One ``EXTEND`` forward with the FULL mask, ragged: every row is its own sequence
(its own request slot and KV pages), so a request computes the same tokens alone or in any
batch. The forward returns hidden states only; the post-step computes the logits of each
request's current block (never of the whole canvas) and runs the unmasking algorithm through
``DenoisePost``. What a row queries depends on the request's ``cache_mode``:

* ``exact``: the whole canvas, every step: the reference generators' computation.
* ``prefix`` (Fast-dLLM prefix cache): the whole canvas at a block's first step, which writes
  the KV of every position; the block's later steps query the block and everything after it,
  attending to the prefix KV cached at the block start.
* ``dual`` (Fast-dLLM dual cache): as ``prefix`` at a block's first step; later steps query the
  block only and attend to the prefix and the suffix cached at the block start (``seq_len`` is
  the canvas end).

Shifted logits (Dream: position p is read from the logits at p − 1), in the cached modes as
Fast-dLLM's Dream block cache (``generation_utils_block.py``) does: the block-start forward
commits only the block's first position (Dream's proposal from the logits before it) and the
step schedule then counts from 1; later steps query from the block's first position, with all
earlier K/V as the block-start forward wrote them, and a query's first position reads its own
logits.

**CFG** (``cfg_scale`` > 0, LLaDA): the unconditional twin, the canvas with the prompt replaced
by mask tokens, is a second row of the same forward in its own request slot and pages (the
request reserves twice its canvas); logits = un + (cfg_scale + 1)·(cond − un), as LLaDA.

**Blocks and steps.** ``block_size``: the request's ``dllm.block_size``, else the engine's
(its argument or ``config.json``), else the family's ``canvas_block_size`` (32 for LLaDA and
LLaDA-MoE, the LLaDA demo and evaluation setting; the whole canvas for Dream); clipped to
``max_new_tokens``. The
reference asserts that the block size divides the generation length; here a last block may be
shorter. ``dllm.steps`` is the total over the canvas (LLaDA's and Dream's ``steps``): it must be
a multiple of the number of blocks, and each block gets ``steps // num_blocks`` (as
``steps_per_block`` for LLaDA's ``low_confidence_static``, overriding a ``steps_per_block``
setting, and as ``steps`` for Dream's schedules); unset, the algorithm's own keys apply (by
default one token per step).

**End.** Stops are searched in each decided block, which is exact: a block never changes once
decided, and it depends on later positions only as masks. So a request ends with the first
block that holds EOS/a stop (output cut after it; LLaDA's reference would go on filling the
canvas after EOS) or with its last block (``max_new_tokens``).

**Budget.** A step's rows fit ``max_prefill_tokens`` query tokens (at least one request always
runs); requests take turns, least recently run first.

**The window form.** A step whose rows all query the same number of tokens W (the dual
cache's later steps: the block; the prefix cache's: the block and the suffix, the same for
requests in step; exact: the canvas) runs as a ``DLLM_EXTEND`` batch of ``block_size`` W with
the full mask: each row W queries over the keys ``[0, seq_len)``, the shape of a denoise
batch, so it takes the block-diffusion attention kernels and replays a CUDA graph captured
per (rows, W) with the post-step inside (``FullDiffusionPost.graph_key``). Other steps, and
rows longer than ``max_window``, are ragged ``EXTEND`` forwards. Same tokens either way.

**Overlapped scheduling.** A step is queued before the previous step's result is read: a
block whose step is in flight continues from that step's output on the device (its input
tokens are carried, ``ScheduledBatch.carry`` with a per-row offset ``carry_at``; its
algorithm state is the in-flight state), when the host knows how that step ends: when the
algorithm's fixed schedule ends the block at the step in flight
(``UnmaskingAlgorithm.surely_done``), the next block starts at once, the finished block's
tokens carried into its canvas (``BlockState.prev``); when it surely does not
(``surely_continues``), the block's next step follows; when the host cannot tell (a
threshold rule), the request waits for the result, since a step on a block that had
resolved would be a wasted forward. Outputs equal the plain loop's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dllm.algorithms import get_algorithm
from dllm.algorithms.base import SamplingTensors, UnmaskingAlgorithm
from dllm.algorithms.dream import dream_probs, dream_propose
from dllm.denoise import (
    DenoisePost,
    config_rows,
    graph_flags,
    graph_group,
    sampling_rows,
    state_rows,
    trace_top,
)
from dllm.request import BlockState, FinishReason, Req
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
    StepKind,
)
from dllm.runner.host_copy import Carry
from dllm.runner.input_registry import InputRegistry
from dllm.sampling_params import check_engine_keys
from dllm.scheduler import Row, Scheduler

# The longest query of a window-form step (module docstring); a longer canvas runs as a ragged
# ``EXTEND``, whose attention kernels are built for long prompts.
MAX_WINDOW = 2048

# Post-step inputs, per row of the forward (name -> dtype).
ROW_FIELDS = {
    "fd.offset": torch.int64,  # index of the block's first token within the row's query
    "fd.partner": torch.int64,  # CFG: row of the unconditional twin minus this row (else 0)
    "fd.uncond": torch.int64,  # 1 on a twin row
    "fd.block_len": torch.int64,
    "fd.cfg_scale": torch.float32,
    "fd.first_only": torch.int64,  # 1: the step commits the block's first position only
}


def full_diffusion_inputs(registry: InputRegistry) -> None:
    for name, dtype in ROW_FIELDS.items():
        registry.register(name, "reqs", dtype, 0)


@dataclass(frozen=True)
class RequestLayout:
    """A full-attention request's resolved settings."""

    block_size: int
    cache_mode: str
    cfg_scale: float
    algo_config: dict[str, Any]


def resolve_request(config: Mapping[str, Any], algorithm: UnmaskingAlgorithm,
                    default_block_size: int | None, max_new_tokens: int) -> RequestLayout:
    """Block size, cache mode, CFG scale and the per-block algorithm settings of a request
    from its merged ``dllm`` settings (engine ``algorithm_config`` under the request's)."""
    check_engine_keys(config)
    block = min(config.get("block_size") or default_block_size or max_new_tokens, max_new_tokens)
    num_blocks = -(-max_new_tokens // block)
    cfg = dict(config)
    steps = cfg.get("steps")
    if steps:  # the total over the canvas; 0 or unset: the algorithm's default
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"dllm.steps must be a non-negative integer, got {steps!r}")
        if steps % num_blocks:
            raise ValueError(
                f"dllm.steps ({steps}) must be a multiple of the number of blocks "
                f"({num_blocks}: max_new_tokens {max_new_tokens} in blocks of {block})")
        per_block = steps // num_blocks  # more than the block's masks: zero-token steps
        if "steps_per_block" in algorithm.defaults:
            cfg["steps_per_block"] = per_block
        cfg["steps"] = per_block
    return RequestLayout(block, config.get("cache_mode", "exact"),
                         float(config.get("cfg_scale", 0.0)), algorithm.validate(cfg, block))


class FullDiffusionScheduler(Scheduler):
    """``logits_shift``: 1 for Dream. ``max_window``: the longest uniform query a step runs
    in the window form (module docstring; 0: never, the engine's choice under context
    parallelism, whose split applies to ``EXTEND`` forwards only)."""

    def __init__(self, *args: Any, logits_shift: int = 0, max_window: int = MAX_WINDOW,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.logits_shift = logits_shift
        self.max_window = max_window
        self._tick = 0
        self._last_run: dict[str, int] = {}

    # ---- memory: a CFG request also holds its twin's slot and pages ---------------------
    def _pages(self, req: Req) -> int:
        return self.kv_pool.pages_for(req.reserved_len) * (2 if req.full.cfg_scale > 0 else 1)

    def check_fits(self, req: Req) -> None:
        super().check_fits(req)
        if req.full.cfg_scale > 0:
            if self.req_pool.max_reqs < 2:
                raise ValueError("cfg_scale > 0 needs two request slots (the unconditional "
                                 "twin); start the engine with max_running_requests >= 2")
            if self._pages(req) > self.kv_pool.num_usable_pages:
                raise ValueError(
                    f"request needs 2 x {req.reserved_len} tokens of KV cache (prompt + "
                    f"max_new_tokens, twice for cfg_scale > 0); the engine holds at most "
                    f"{self.kv_pool.num_usable_pages * self.kv_pool.page_size}")

    def _try_admit(self, req: Req) -> bool:
        twin = req.full.cfg_scale > 0
        if twin and (self.req_pool.num_free < 2
                     or self.kv_pool.num_free_pages < self._pages(req)):
            return False
        if not super()._try_admit(req):
            return False
        if twin:
            n = req.reserved_len
            pages = self.kv_pool.alloc_pages(self.kv_pool.pages_for(n))
            req.kv_pages.extend(pages)
            req.full.cfg_pool_idx = self.req_pool.alloc()
            self.req_pool.req_to_token[req.full.cfg_pool_idx, :n] = self.kv_pool.slots_for(
                pages, 0, n).to(self.req_pool.req_to_token.device)
        return True

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        if req.full.cfg_pool_idx is not None:
            self.req_pool.free(req.full.cfg_pool_idx)
            req.full.cfg_pool_idx = None
        self._last_run.pop(req.rid, None)
        super().finish(req, reason, error)

    def check_memory(self) -> None:
        held = [p for r in self.running.values() for p in r.kv_pages]
        assert len(held) == len(set(held)), "a KV page is held twice"
        assert len(held) + self.kv_pool.num_free_pages == self.kv_pool.num_usable_pages, (
            f"KV pages leaked: {self.kv_pool.num_usable_pages} usable, "
            f"{self.kv_pool.num_free_pages} free, {len(held)} held")
        slots = [s for r in self.running.values() for s in (r.req_pool_idx, r.full.cfg_pool_idx)
                 if s is not None]
        assert len(slots) + self.req_pool.num_free == self.req_pool.max_reqs, "request slots leaked"

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> list[ScheduledBatch]:
        self.admit()
        picked = self._pick()
        return [self.build_step(picked)] if picked else []

    def update(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        return self.apply_step(batch, output)

    def split(self, batch: ScheduledBatch) -> list[ScheduledBatch]:
        """One batch per request, a CFG request with its unconditional twin."""
        units: dict[str, tuple[Req, BlockState]] = {}
        for i, row in enumerate(batch.rows):
            req = self.row_owner(batch, i)
            if req is not None and not batch.row_inputs["fd.uncond"][i]:
                units.setdefault(req.rid, (req, row.block))
        return [self.build_step([unit]) for unit in units.values()]

    def _pick(self) -> list[tuple[Req, BlockState]]:
        """Least recently run first, within the token budget (the first always runs)."""
        order = sorted(self.running.values(), key=lambda r: self._last_run.get(r.rid, -1))
        budget, picked = self.config.max_prefill_tokens, []
        for req in order:
            blk = self._next_block(req)
            if blk is None:
                continue
            lo, hi, _ = self._query(req, blk)
            cost = (hi - lo) * (2 if req.full.cfg_scale > 0 else 1)
            if picked and cost > budget:
                continue
            picked.append((req, blk))
            budget -= cost
        return picked

    def _next_block(self, req: Req) -> BlockState | None:
        """The block ``req``'s next step runs on; None: nothing to run this step. Under the
        overlap schedule a step of the request may be in flight: one its algorithm's fixed
        schedule is sure to end the block lets the next block start at once, its tokens
        carried on the device (``BlockState.prev``); one sure not to end it is followed by
        the block's next step; after any other the request waits for the result (a step on
        a block that had already resolved would be a wasted forward)."""
        blk = req.full.block
        if blk is None:  # the host has every committed token
            if req.committed_len >= req.canvas_len:
                return None
            blk = self._new_block(req, req.committed_len, None)
        elif req.inflight and blk.carry is not None:  # a step on ``blk`` is in flight
            known = self._known_done(req, blk)
            if known is None:
                return None
            if known:
                start = blk.start + len(blk.tokens)
                if start >= req.canvas_len:
                    return None  # that step ends the request
                blk = self._new_block(req, start, blk)
        return blk

    def _new_block(self, req: Req, start: int, prev: BlockState | None) -> BlockState:
        n = min(req.block_size, req.canvas_len - start)
        req.full.block = blk = BlockState(
            start=start, tokens=[self.config.mask_token_id] * n, editable=[True] * n,
            num_initial_masks=n, prev=prev)
        return blk

    def _known_done(self, req: Req, blk: BlockState) -> bool | None:
        """Whether the step in flight on ``blk`` (its ``blk.step - 1``-th) ends it, as the
        device will compute, when the host knows it whatever the logits (None: it cannot
        tell)."""
        step, n = blk.step - 1, len(blk.tokens)
        if self._first_only(req, step):
            return n <= 1
        algo = get_algorithm(req.full.algorithm)
        config = req.full.algo_config
        if algo.surely_done(config, step):
            return True
        return False if algo.surely_continues(config, step, n) else None

    def _first_only(self, req: Req, step: int) -> bool:
        """Dream's cached modes: a block's first forward commits its first position alone."""
        return self.logits_shift > 0 and req.full.cache_mode != "exact" and step == 0

    def _query(self, req: Req, blk: BlockState) -> tuple[int, int, int]:
        """``(first, end, seq_len)``: the row's query covers cache indices [first, end)."""
        end = req.canvas_len
        if req.full.cache_mode == "exact" or blk.step == 0:
            return 0, end, end
        if req.full.cache_mode == "prefix":
            return blk.start, end, end
        return blk.start, blk.start + len(blk.tokens), end  # dual

    def _canvas(self, req: Req, blk: BlockState, uncond: bool) -> list[int]:
        """The sequence as the host knows it: a block whose step is still in flight
        (``blk.prev``) stands as masks, its tokens carried on the device."""
        mask = self.config.mask_token_id
        unread = len(blk.prev.tokens) if blk.prev is not None else 0
        tail = req.canvas_len - blk.start - len(blk.tokens)
        head = [mask] * req.prompt_len if uncond else req.prompt_ids
        return [*head, *req.output_ids, *[mask] * unread, *blk.tokens, *[mask] * tail]

    def _carry(self, req: Req, blk: BlockState, first: int
               ) -> tuple[tuple[torch.Tensor, int] | None, int, int]:
        """The carried tokens of a row: ``(source, at, length)``, ``source`` the in-flight
        output row holding the tokens of the block the host has not read, written at query
        index ``at`` (None: nothing in flight)."""
        if not req.inflight:
            return None, 0, 0
        if blk.carry is not None:  # the next step of the same block
            return blk.carry, blk.start - first, len(blk.tokens)
        prev = blk.prev  # the first step of a block started before the last one was read
        assert prev is not None and prev.carry is not None, "a step in flight on no block"
        return prev.carry, prev.start - first, len(prev.tokens)

    def build_step(self, picked: list[tuple[Req, BlockState]]) -> ScheduledBatch:
        """Conditional rows first (row i is ``picked[i]``), then the CFG twins. Rows of one
        query length run in the window form (module docstring)."""
        twins = [(r, b) for r, b in picked if r.full.cfg_scale > 0]
        rows = [(r, b, False) for r, b in picked] + [(r, b, True) for r, b in twins]
        queries = [self._query(r, b) for r, b, _ in rows]
        widths = {end - first for first, end, _ in queries}
        window = len(widths) == 1 and 0 < (w := next(iter(widths))) <= self.max_window
        batch = ScheduledBatch(ForwardMode.DLLM_EXTEND if window else ForwardMode.EXTEND,
                               kind=StepKind.FULL_STEP, attention_mask=AttentionMask.FULL,
                               logits_mode=LogitsMode.NONE, block_size=w if window else 1)
        twin_row = {r.rid: len(picked) + k for k, (r, _) in enumerate(twins)}
        carry = Carry()
        carry_at: list[int] = []
        carry_len: list[int] = []
        top = trace_top([r for r, _ in picked])
        for i, ((req, blk, uncond), (first, end, seq_len)) in enumerate(
                zip(rows, queries, strict=True)):
            pool_idx = req.full.cfg_pool_idx if uncond else req.req_pool_idx
            batch.add_row(req.rid, pool_idx, self._canvas(req, blk, uncond)[first:end], first,
                          seq_len)
            batch.row_groups.append(graph_group(req.full.algorithm, top))
            source, at, length = self._carry(req, blk, first)
            carry.add(source)
            carry_at.append(at)
            carry_len.append(length)
            fields = {
                "fd.offset": blk.start - first,
                "fd.partner": twin_row[req.rid] - i if req.full.cfg_scale > 0 and not uncond else 0,
                "fd.uncond": int(uncond),
                "fd.block_len": len(blk.tokens),
                "fd.cfg_scale": float(req.full.cfg_scale),
                "fd.first_only": int(self._first_only(req, blk.step)),
            }
            for name, value in fields.items():
                batch.row_inputs.setdefault(name, []).append(value)
            batch.rows.append(Row(req, blk))
        row_reqs = [r for r, _, _ in rows]
        batch.row_inputs.update(
            step=[b.step for _, b, _ in rows],
            num_initial_masks=[b.num_initial_masks for _, b, _ in rows],
            **sampling_rows(row_reqs),
            **config_rows(row_reqs),
        )
        carry.attach(batch)
        if batch.carry is not None:
            batch.row_inputs.update(carry_at=carry_at, carry_len=carry_len)
        batch.row_tensors.update(state_rows(row_reqs, self.req_pool.req_to_token.device))
        return batch

    def launched(self, batch: ScheduledBatch, output: Any) -> None:
        """The step is queued: each block continues from its output row on the device
        (the next step's input tokens and algorithm state), read by the host or not."""
        packed, states = output
        tokens = packed[:, : max(batch.row_inputs["fd.block_len"])]
        for i, row in enumerate(batch.rows):
            req = self.row_owner(batch, i)
            if req is None:  # finished since the batch was built (a retried launch)
                continue
            req.inflight += 1  # a CFG request counts its twin's row too: applied row by row
            if batch.row_inputs["fd.uncond"][i]:
                continue
            blk = row.block
            blk.step += 1
            blk.carry = (tokens, i)
            blk.algo_state = {k: v[i] for k, v in states.items()}

    def apply_step(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        if output is None:
            return []
        self._tick += 1
        result = DenoisePost.read(output, trace_top([row.req for row in batch.rows]))

        def apply_row(r: int, req: Req) -> bool:
            if batch.row_inputs["fd.uncond"][r]:  # a CFG twin: its result is the request's
                return False
            blk = batch.rows[r].block
            self._last_run[req.rid] = self._tick
            req.num_forward_passes += 1
            req.num_denoise_forwards += 1
            tokens = result.tokens[r][: len(blk.tokens)]
            if req.trace is not None:
                req.trace.record_step(blk.start, req.prompt_len, blk.tokens, tokens,
                                      blk.editable, self.config.mask_token_id,
                                      result.trace[r], result.done[r])
            blk.tokens = tokens
            blk.transfers += result.num_transferred[r]
            if not result.done[r]:
                if blk is not req.full.block:
                    raise RuntimeError("a block sure to resolve did not (the next block "
                                       "was launched)")
                return req.trace is not None and req.trace.keep_events
            req.num_blocks_committed += 1
            blk.resolved = True
            nxt = req.full.block
            if nxt is blk:
                req.full.block = None
            elif nxt is not None and nxt.prev is blk:  # started already: its tokens are known
                nxt.prev = None
            self.commit_traced(req, blk.tokens, blk.editable)
            return True

        return self.apply_rows(batch, apply_row)


class FullDiffusionPost:
    """Device post-step over every row of the forward: the current block's logits of each
    row (``[n, B]``, ``B`` the longest block; shorter blocks are padded with non-editable
    positions), a conditional row's CFG-combined with its twin's, then ``DenoisePost``. A
    CFG twin, and a CUDA graph's padding row, gets a result of its own that the host
    ignores: the work is the same for every row, so a graph captures it for ``bs`` rows.

    ``width``, ``any_cfg`` (some row has a twin: the twins' block logits are computed) and
    ``any_first_only`` (Dream's block-start forward in a cached mode) are host facts of the
    batch and, with the algorithm group and the sampling flags, the identity of a captured
    graph (``graph_key``)."""

    def __init__(self, num_rows: int, width: int, any_cfg: bool, any_first_only: bool,
                 denoise: DenoisePost, logits_shift: int,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]):
        self.num_rows = num_rows
        self.width = width
        self.any_cfg = any_cfg
        self.any_first_only = any_first_only
        self.denoise = denoise
        self.shift = logits_shift
        self.compute_logits = compute_logits

    @classmethod
    def for_batch(cls, batch: ScheduledBatch, mask_token_id: int, logits_shift: int,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> FullDiffusionPost:
        inp = batch.row_inputs
        for i in range(batch.batch_size):
            partner = i + inp["fd.partner"][i]
            if inp["fd.partner"][i] and (partner >= batch.batch_size
                                         or batch.rids[partner] != batch.rids[i]):
                # ``split`` keeps a request's rows together; a lone CFG row is a bug.
                raise RuntimeError(f"request {batch.rids[i]}: a classifier-free-guidance row "
                                   "without its unconditional twin")
        rows = batch.rows
        denoise = DenoisePost.for_reqs([r.req for r in rows], [r.block for r in rows],
                                       mask_token_id, 0)
        width, any_cfg, any_first = _layout(batch)
        return cls(batch.batch_size, width, any_cfg, any_first, denoise, logits_shift,
                   compute_logits)

    @classmethod
    def for_graph(cls, bs: int, key: Hashable, mask_token_id: int, logits_shift: int,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> FullDiffusionPost:
        """The post-step a CUDA graph of ``bs`` rows captures for ``graph_key`` ``key``."""
        group, flags, width, any_cfg, any_first = key
        denoise = DenoisePost.for_graph(bs, group, flags, mask_token_id, 0)
        return cls(bs, width, any_cfg, any_first, denoise, logits_shift, compute_logits)

    @staticmethod
    def graph_key(batch: ScheduledBatch) -> Hashable | None:
        """What a captured graph of ``batch`` depends on besides its shape; None when no
        graph can take it (ragged rows, or rows of several algorithms)."""
        if batch.mode is not ForwardMode.DLLM_EXTEND or len(set(batch.row_groups)) != 1:
            return None
        return (batch.row_groups[0], graph_flags(batch.row_inputs), *_layout(batch))

    def __call__(self, fb: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor | None) -> Any:
        n, width = self.num_rows, self.width
        ex = fb.extras
        lens = fb.extend_lens[:n]
        row_start = torch.cumsum(lens, 0) - lens
        j = torch.arange(width, device=hidden.device)
        last = fb.num_tokens - 1

        def block_index(rows: torch.Tensor) -> torch.Tensor:  # [n, width] token indices
            return (row_start[rows] + ex["fd.offset"][rows])[:, None] + j

        def block_logits(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            # shifted: a token reads the logits before it, a query's first token its own
            at = torch.maximum(index - self.shift, row_start[rows][:, None])
            return self.compute_logits(hidden[at.clamp(0, last).reshape(-1)]).view(n, width, -1)

        rows = torch.arange(n, device=hidden.device)
        index = block_index(rows)
        out = block_logits(rows, index)
        if self.any_cfg:  # rows without a twin point at themselves: un == cond there
            partner = rows + ex["fd.partner"][:n]
            un = block_logits(partner, block_index(partner))
            scale = (ex["fd.cfg_scale"][:n] + 1.0).to(out.dtype)[:, None, None]
            out = un + scale * (out - un)
        index = index.clamp(max=last)
        view = dataclasses.replace(
            fb, input_ids=fb.input_ids[index].reshape(-1),
            positions=fb.positions[index].reshape(-1), block_size=width,
            extras={**ex, "editable": (j < ex["fd.block_len"][:n, None]).reshape(-1)})
        packed, states = self.denoise(view, hidden, out.reshape(n * width, -1))
        if self.any_first_only:
            packed, states = self._first_only(view, out, packed, states)
        return packed, states

    def _first_only(self, view: ForwardBatch, logits: torch.Tensor, packed: torch.Tensor,
                    states: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Rows flagged ``fd.first_only`` commit the block's first position alone (Dream's
        proposal there) and keep a fresh algorithm state."""
        ex = view.extras
        n, width = self.num_rows, self.width
        flag = ex["fd.first_only"][:n].bool()
        sampling = SamplingTensors(ex["temperature"][:n], ex["top_k"][:n], ex["top_p"][:n],
                                   ex["seed"][:n], *self.denoise.flags)
        positions = view.positions.view(n, width)[:, :1]
        probs = dream_probs(logits[:, :1], sampling)
        first = dream_propose(probs, sampling, ex["step"][:n], positions)[:, 0]
        tokens = view.input_ids.view(n, width).clone()
        tokens[:, 0] = first
        done = (ex["fd.block_len"][:n] <= 1).to(packed.dtype)
        one = torch.ones_like(done)
        tail = packed[:, width + 2:]  # the next token (and a traced batch's trace columns)
        if self.denoise.trace is not None:  # the trace of the token this path chose
            nan = torch.full(tokens.shape, float("nan"), device=tokens.device)
            tail = torch.cat([tail[:, :1], self.denoise._trace(
                logits, logits[:, -1], tokens, tail[:, 0], nan)], dim=1)
        patched = torch.cat([tokens, done[:, None], one[:, None], tail], dim=1)
        packed = torch.where(flag[:, None], patched, packed)
        states = {k: torch.where(flag, torch.zeros_like(v), v) for k, v in states.items()}
        return packed, states


def _layout(batch: ScheduledBatch) -> tuple[int, bool, bool]:
    """``(width, any_cfg, any_first_only)`` of a batch (``FullDiffusionPost``)."""
    inp = batch.row_inputs
    return (max(inp["fd.block_len"]), any(inp["fd.partner"]), any(inp["fd.first_only"]))
