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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dllm.algorithms.base import SamplingTensors, UnmaskingAlgorithm
from dllm.algorithms.dream import dream_probs, dream_propose
from dllm.denoise import DenoisePost, config_rows, sampling_rows, state_rows, trace_top
from dllm.request import BlockState, FinishReason, Req
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
    StepKind,
)
from dllm.runner.input_registry import InputRegistry
from dllm.sampling_params import check_engine_keys
from dllm.scheduler import Row, Scheduler

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
    def __init__(self, *args: Any, logits_shift: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.logits_shift = logits_shift
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
        reqs = self._pick()
        return [self.build_step(reqs)] if reqs else []

    def update(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        return self.apply_step(batch, output)

    def split(self, batch: ScheduledBatch) -> list[ScheduledBatch]:
        """One batch per request, a CFG request with its unconditional twin."""
        reqs = [self.running[rid] for rid in dict.fromkeys(batch.rids) if rid in self.running]
        return [self.build_step([req]) for req in reqs]

    def _pick(self) -> list[Req]:
        """Least recently run first, within the token budget (the first always runs)."""
        order = sorted(self.running.values(), key=lambda r: self._last_run.get(r.rid, -1))
        budget, picked = self.config.max_prefill_tokens, []
        for req in order:
            if req.full.block is None:
                self._start_block(req)
            lo, hi, _ = self._query(req)
            cost = (hi - lo) * (2 if req.full.cfg_scale > 0 else 1)
            if picked and cost > budget:
                continue
            picked.append(req)
            budget -= cost
        return picked

    def _start_block(self, req: Req) -> None:
        start = req.committed_len
        n = min(req.block_size, req.canvas_len - start)
        req.full.block = BlockState(start=start, tokens=[self.config.mask_token_id] * n,
                               editable=[True] * n, num_initial_masks=n)

    def _query(self, req: Req) -> tuple[int, int, int]:
        """``(first, end, seq_len)``: the row's query covers cache indices [first, end)."""
        blk, end = req.full.block, req.canvas_len
        if req.full.cache_mode == "exact" or blk.step == 0:
            return 0, end, end
        first = blk.start
        if req.full.cache_mode == "prefix":
            return first, end, end
        return first, blk.start + len(blk.tokens), end  # dual

    def _canvas(self, req: Req, uncond: bool) -> list[int]:
        mask = self.config.mask_token_id
        blk = req.full.block
        tail = req.canvas_len - blk.start - len(blk.tokens)
        head = [mask] * req.prompt_len if uncond else req.prompt_ids
        return [*head, *req.output_ids, *blk.tokens, *[mask] * tail]

    def build_step(self, reqs: list[Req]) -> ScheduledBatch:
        """Conditional rows first (row i is ``reqs[i]``), then the CFG twins."""
        batch = ScheduledBatch(ForwardMode.EXTEND, kind=StepKind.FULL_STEP,
                               attention_mask=AttentionMask.FULL, logits_mode=LogitsMode.NONE)
        twins = [r for r in reqs if r.full.cfg_scale > 0]
        rows = [(r, False) for r in reqs] + [(r, True) for r in twins]
        twin_row = {r.rid: len(reqs) + k for k, r in enumerate(twins)}
        for i, (req, uncond) in enumerate(rows):
            first, end, seq_len = self._query(req)
            pool_idx = req.full.cfg_pool_idx if uncond else req.req_pool_idx
            batch.add_row(req.rid, pool_idx, self._canvas(req, uncond)[first:end], first, seq_len)
            fields = {
                "fd.offset": req.full.block.start - first,
                "fd.partner": twin_row[req.rid] - i if req.full.cfg_scale > 0 and not uncond else 0,
                "fd.uncond": int(uncond),
                "fd.block_len": len(req.full.block.tokens),
                "fd.cfg_scale": float(req.full.cfg_scale),
                "fd.first_only": int(self.logits_shift > 0 and req.full.cache_mode != "exact"
                                     and req.full.block.step == 0),
            }
            for name, value in fields.items():
                batch.row_inputs.setdefault(name, []).append(value)
        row_reqs = [r for r, _ in rows]
        batch.rows = [Row(r) for r in row_reqs]
        batch.row_inputs.update(
            step=[r.full.block.step for r in row_reqs],
            num_initial_masks=[r.full.block.num_initial_masks for r in row_reqs],
            **sampling_rows(row_reqs),
            **config_rows(row_reqs),
        )
        batch.row_tensors.update(state_rows(row_reqs, self.req_pool.req_to_token.device))
        return batch

    def apply_step(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        if output is None:
            return []
        self._tick += 1
        result = DenoisePost.read(output, trace_top([row.req for row in batch.rows]))

        def apply_row(r: int, req: Req) -> bool:
            # Rows past the stepped requests are CFG twins (no result of their own).
            if r >= len(result.tokens) or req.full.block is None:
                return False
            self._last_run[req.rid] = self._tick
            req.num_forward_passes += 1
            req.num_denoise_forwards += 1
            blk = req.full.block
            blk.step += 1
            tokens = result.tokens[r][: len(blk.tokens)]
            if req.trace is not None:
                req.trace.record_step(blk.start, req.prompt_len, blk.tokens, tokens,
                                      blk.editable, self.config.mask_token_id,
                                      result.trace[r], result.done[r])
            blk.tokens = tokens
            blk.transfers += result.num_transferred[r]
            blk.algo_state = result.state[r]
            if result.done[r]:
                req.num_blocks_committed += 1
                req.full.block = None
                self.commit_traced(req, blk.tokens, blk.editable)
                return True
            return req.trace is not None and req.trace.keep_events

        return self.apply_rows(batch, apply_row)


class FullDiffusionPost:
    """Device post-step: the current block's logits of each active request (row i of the
    forward), CFG-combined with its twin's, then ``DenoisePost`` over ``[n, B]`` blocks
    (``B`` the longest block; shorter blocks are padded with non-editable positions)."""

    @classmethod
    def for_batch(cls, batch: ScheduledBatch, mask_token_id: int, logits_shift: int,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> FullDiffusionPost:
        """The requests a batch steps: its leading conditional rows (the CFG twins follow)."""
        inp = batch.row_inputs
        active: list[Req] = []
        for i, req in enumerate(row.req for row in batch.rows):
            if inp["fd.uncond"][i]:
                break
            partner = i + inp["fd.partner"][i]
            if partner >= batch.batch_size or batch.rids[partner] != req.rid:
                # ``split`` keeps a request's rows together; a lone CFG row is a bug.
                raise RuntimeError(f"request {req.rid}: a classifier-free-guidance row "
                                   "without its unconditional twin")
            active.append(req)
        return cls(active, mask_token_id, logits_shift, compute_logits)

    def __init__(self, reqs: list[Req], mask_token_id: int, logits_shift: int,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]):
        self.reqs = reqs
        self.width = max((len(r.full.block.tokens) for r in reqs), default=0)
        self.any_cfg = any(r.full.cfg_scale > 0 for r in reqs)
        self.shift = logits_shift
        self.compute_logits = compute_logits
        self.denoise = DenoisePost.for_reqs(reqs, [r.full.block for r in reqs], mask_token_id, 0)
        self.any_first_only = bool(logits_shift) and any(
            r.full.cache_mode != "exact" and r.full.block.step == 0 for r in reqs)

    def __call__(self, fb: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor | None) -> Any:
        n, width = len(self.reqs), self.width
        if n == 0:
            return None
        ex = fb.extras
        lens = fb.extend_lens[: len(fb.extend_lens_cpu)]
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
        n, width = len(self.reqs), self.width
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
