"""The scheduler's shared half: the waiting queue, admission bounded by memory, finishing and
memory accounting. Each generation kind (block diffusion, autoregressive, ...) subclasses it
and says which forwards one engine step runs (``schedule``) and how their results apply
(``update``)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.request import BlockState, FinishReason, Req, ReqStatus
from dllm.runner.forward_batch import ScheduledBatch
from dllm.runner.memory import MambaStatePool, ReqToTokenPool, TokenToKVPool
from dllm.stop import StopChecker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """A scheduled row as its scheduler knows it: the request it was built for and, for a
    denoise row, the block it denoises (the request may have moved on to the next block by
    the time the result applies)."""

    req: Req
    block: BlockState | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    block_size: int = 1  # tokens of a block (1 for autoregressive models)
    mask_token_id: int | None = None


class Scheduler(ABC):
    def __init__(self, config: SchedulerConfig, req_pool: ReqToTokenPool,
                 kv_pool: TokenToKVPool, stop_checker: StopChecker,
                 state_pool: MambaStatePool | None = None):
        self.config = config
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.state_pool = state_pool  # hybrid models: one committed state slot per request
        self.stop_checker = stop_checker
        self.waiting: deque[Req] = deque()
        self.running: dict[str, Req] = {}  # admission order

    @abstractmethod
    def schedule(self) -> list[ScheduledBatch]:
        """The forwards of one engine step, in order."""

    @abstractmethod
    def update(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        """Apply the result of ``batch`` (the one host read of its step happens here);
        returns the requests whose output grew or that finished. ``batch`` may be a part of
        a scheduled batch (``split``)."""

    def launched(self, batch: ScheduledBatch, output: Any) -> None:
        """The overlap schedule's hook, called right after ``batch``'s forward is queued and
        before its result is read: record what the next step may build on (each row's device
        output). The default builds on nothing."""
        return None

    def split(self, batch: ScheduledBatch) -> list[ScheduledBatch]:
        """``batch`` as one batch per request, for the retry after a failure (one per row)."""
        return [batch.row(i) for i in range(batch.batch_size)]

    # ---- queue -------------------------------------------------------------------------
    def check_fits(self, req: Req) -> None:
        """Raise ``ValueError`` if the request could never be admitted, however long it
        waited (the whole pool is smaller than its reservation)."""
        pages = self.kv_pool.pages_for(req.reserved_len)
        if pages > self.kv_pool.num_usable_pages or req.reserved_len > self.req_pool.max_context:
            cap = min(self.kv_pool.num_usable_pages * self.kv_pool.page_size,
                      self.req_pool.max_context)
            raise ValueError(
                f"request needs {req.reserved_len} tokens of KV cache (prompt + max_new_tokens, "
                f"rounded up to a block); the engine holds at most {cap}")

    def add(self, req: Req) -> None:
        self.check_fits(req)
        if req.rid in self.running or any(r.rid == req.rid for r in self.waiting):
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.finish(req, FinishReason.ABORT)
                return req
        req = self.running.get(rid)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- memory ------------------------------------------------------------------------
    def _try_admit(self, req: Req) -> bool:
        pages = self.kv_pool.pages_for(req.reserved_len)
        if pages > self.kv_pool.num_free_pages or self.req_pool.num_free == 0:
            return False
        if self.state_pool is not None:
            if self.state_pool.num_free == 0:
                return False
            req.state_slot = self.state_pool.alloc()
        req.req_pool_idx = self.req_pool.alloc()
        req.kv_pages = self.kv_pool.alloc_pages(pages)
        n = req.reserved_len
        slots = self.kv_pool.slots_for(req.kv_pages, 0, n)
        device = self.req_pool.req_to_token.device
        if device.type == "cuda":  # a pageable copy would wait for the queued steps
            slots = slots.pin_memory().to(device, non_blocking=True)
        self.req_pool.req_to_token[req.req_pool_idx, :n] = slots.to(device)
        req.status = ReqStatus.RUNNING
        self.running[req.rid] = req
        return True

    def admit(self) -> None:
        """FIFO admission; the head waits for memory rather than being overtaken, so a large
        request is never starved by a stream of small ones."""
        while self.waiting and len(self.running) < self.config.max_running_requests:
            if not self._try_admit(self.waiting[0]):
                break
            self.waiting.popleft()

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """End a request for any reason; its request slot and KV pages return at once."""
        req.finish_reason = reason
        req.error = error
        req.status = ReqStatus.FINISHED
        req.inflight = 0  # a result still queued for it is dropped
        req.state.drop_inflight()
        self.running.pop(req.rid, None)
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        if req.kv_pages:
            self.kv_pool.free_pages(req.kv_pages)
            req.kv_pages = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None

    def check_memory(self) -> None:
        """Accounting: every page and request slot is either free or held by a running
        request, exactly once. Raises ``AssertionError`` on a leak or double-free."""
        held = [p for r in self.running.values() for p in r.kv_pages]
        assert len(held) == len(set(held)), "a KV page is held twice"
        assert len(held) + self.kv_pool.num_free_pages == self.kv_pool.num_usable_pages, (
            f"KV pages leaked: {self.kv_pool.num_usable_pages} usable, "
            f"{self.kv_pool.num_free_pages} free, {len(held)} held")
        slots = [r.req_pool_idx for r in self.running.values()]
        assert len(slots) + self.req_pool.num_free == self.req_pool.max_reqs, "request slots leaked"
        if self.state_pool is not None:
            states = [r.state_slot for r in self.running.values()]
            assert None not in states and len(states) == len(set(states)), (
                "a running request without its state slot, or a slot held twice")
            assert len(states) + self.state_pool.num_free == self.state_pool.num_slots, (
                f"state slots leaked: {self.state_pool.num_slots} usable, "
                f"{self.state_pool.num_free} free, {len(states)} held")

    # ---- shared steps ------------------------------------------------------------------
    def chunk_prefill(self, target: Callable[[Req], int], granule: int) -> list[tuple[Req, int, int]]:
        """Prompt chunks ``(req, start, end)`` for this step's prefill forward: admitted
        requests in order, each advanced from its ``prefilled_len`` towards ``target(req)`` in
        multiples of ``granule`` tokens (a block), within ``max_prefill_tokens`` (at least one
        granule always fits)."""
        self.admit()
        budget = self.config.max_prefill_tokens
        rows: list[tuple[Req, int, int]] = []
        for req in self.running.values():
            goal = target(req)
            if req.prefilled_len >= goal:
                continue
            room = budget // granule * granule
            if room == 0:
                if rows:
                    break
                room = granule
            end = min(goal, req.prefilled_len + room)
            rows.append((req, req.prefilled_len, end))
            budget -= end - req.prefilled_len
            if budget < granule:
                break
        return rows

    def row_owner(self, batch: ScheduledBatch, i: int) -> Req | None:
        """The running request row ``i`` was built for; None once it finished (a new request
        may since run under the same id)."""
        req = self.running.get(batch.rids[i])
        if req is None or (batch.rows and batch.rows[i].req is not req):
            return None
        return req

    def apply_rows(self, batch: ScheduledBatch, apply_row: Callable[[int, Req], bool]
                   ) -> list[Req]:
        """Apply a step's result row by row: ``apply_row(i, req)`` updates one running request
        and says whether its output changed. A row that raises finishes only its own request
        (with an error): no exception leaves here once a row has been applied, so the engine
        never re-runs a batch that was partly applied."""
        changed = []
        for i, rid in enumerate(batch.rids):
            req = self.row_owner(batch, i)
            if req is None:
                continue
            if req.inflight:  # this forward's result is no longer in flight
                req.inflight -= 1
            try:
                if apply_row(i, req):
                    changed.append(req)
            except Exception as exc:  # noqa: BLE001 - isolate the failing request
                logger.exception("request %s failed while applying its step", rid)
                self.finish(req, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                changed.append(req)
        return changed

    def commit_traced(self, req: Req, tokens: list[int], editable: list[bool]) -> bool:
        """``commit_tokens`` of a resolved block's editable positions, recording their
        log-probabilities for a traced request."""
        positions = [i for i, e in enumerate(editable) if e]
        before = len(req.output_ids)
        ended = self.commit_tokens(req, [tokens[i] for i in positions])
        if req.trace is not None:
            req.trace.commit(req.output_ids[before:], positions)
        return ended

    def commit_tokens(self, req: Req, new_tokens: list[int]) -> bool:
        """Apply the stop rules to newly final tokens; returns True if the request ended."""
        res = self.stop_checker.check(req, new_tokens)
        req.output_ids.extend(res.keep)
        req.stop_matched = res.matched
        if res.finish_reason is not None:
            self.finish(req, res.finish_reason)
            return True
        return False
