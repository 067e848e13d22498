"""The scheduler's shared half: the waiting queue, admission bounded by memory, finishing,
memory accounting and the prefix cache's bookkeeping (``dllm.prefix_cache``: match at
admission, insert once KV is written, unlock at finish). Each generation kind (block
diffusion, autoregressive, ...) subclasses it and says which forwards one engine step runs
(``schedule``), how their results apply (``update``) and how much of a prompt may come from
the cache (``match_limit``)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.prefix_cache import PrefixCache
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
    track: int = 0  # the track slot the row writes its state into (0: none)
    # A merged commit row: the resolved block whose final tokens the row's first half runs
    # (its KV, and a hybrid's committed state, are written there); ``block`` is the next
    # block, whose first denoise step the second half is.
    commit: BlockState | None = None
    # The commit half of a merged commit in two rows: ``block`` is the resolved block (its
    # final tokens write their KV), and the next row is the same request's next block, whose
    # first denoise step reads that KV in the same forward. Not a forward of its own: the
    # request counts one forward, and one forward in flight, for the pair.
    commit_half: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    block_size: int = 1  # tokens of a block (1 for autoregressive models)
    mask_token_id: int | None = None
    # Hybrid models with the prefix cache: forwards ending on a multiple of ``track_grid``
    # tokens snapshot their state; each request holds ``num_track_slots`` track slots.
    track_grid: int = 0
    num_track_slots: int = 0


class Scheduler(ABC):
    def __init__(self, config: SchedulerConfig, req_pool: ReqToTokenPool,
                 kv_pool: TokenToKVPool, stop_checker: StopChecker,
                 state_pool: MambaStatePool | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.config = config
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.state_pool = state_pool  # hybrid models: one committed state slot per request
        self.prefix_cache = prefix_cache
        # Hybrid models track their state for the cache (else a hit has no state to restore).
        self.tracking = (prefix_cache is not None and state_pool is not None
                         and config.track_grid > 0 and config.num_track_slots > 0)
        self.stop_checker = stop_checker
        # Prompt tokens of the admitted requests, and those the prefix cache served (metrics).
        self.num_admitted_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
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
    def match_limit(self, req: Req) -> int:
        """The most prompt tokens this request may take from the prefix cache (0: none); the
        rest is prefilled. The default takes none."""
        return 0

    def _states_per_req(self) -> int:
        return 0 if self.state_pool is None else 1 + (
            self.config.num_track_slots if self.tracking else 0)

    def _make_room(self, pages: int, states: int) -> bool:
        """Whether ``pages`` KV pages and ``states`` state slots are free, evicting
        unreferenced prefix-cache nodes if that makes them so."""
        cache, sp = self.prefix_cache, self.state_pool
        if cache is not None:
            free_pages = self.kv_pool.num_free_pages + cache.evictable_pages
            free_states = 0 if sp is None else sp.num_free + cache.evictable_states
            if pages <= free_pages and (sp is None or states <= free_states):
                cache.evict(pages, states)
        return (pages <= self.kv_pool.num_free_pages
                and (sp is None or states <= sp.num_free))

    def _try_admit(self, req: Req) -> bool:
        if self.req_pool.num_free == 0:
            return False
        cache, node = self.prefix_cache, None
        limit = self.match_limit(req) if cache is not None else 0
        if limit > 0:
            node = cache.match(req.prompt_ids, limit, need_state=self.state_pool is not None)
            node = None if node is cache.root else node
            if node is not None:
                cache.lock(node)  # before any eviction below
        cached = node.end if node is not None else 0
        pages = self.kv_pool.pages_for(req.reserved_len) - cached // self.kv_pool.page_size
        if not self._make_room(pages, self._states_per_req()):
            if node is not None:
                cache.unlock(node)
            return False
        if self.state_pool is not None:
            req.state_slot = self.state_pool.alloc()
            if node is not None and node.state is not None:  # restore the snapshot
                self.state_pool.copy_slot(node.state, req.state_slot)
            if self.tracking:
                req.track_slots = [self.state_pool.alloc()
                                   for _ in range(self.config.num_track_slots)]
        req.req_pool_idx = self.req_pool.alloc()
        shared = cache.pages_of(node) if node is not None else []
        req.kv_pages = shared + self.kv_pool.alloc_pages(pages)
        req.prefix_node, req.tree_pages = node, set(shared)
        req.prefilled_len = req.cached_tokens = cached
        n = req.reserved_len
        slots = self.kv_pool.slots_for(req.kv_pages, 0, n)
        device = self.req_pool.req_to_token.device
        if device.type == "cuda":  # a pageable copy would wait for the queued steps
            slots = slots.pin_memory().to(device, non_blocking=True)
        self.req_pool.req_to_token[req.req_pool_idx, :n] = slots.to(device)
        req.status = ReqStatus.RUNNING
        self.running[req.rid] = req
        self.num_admitted_prompt_tokens += req.prompt_len
        self.num_cached_prompt_tokens += cached
        return True

    def admit(self) -> None:
        """FIFO admission; the head waits for memory rather than being overtaken, so a large
        request is never starved by a stream of small ones."""
        while self.waiting and len(self.running) < self.config.max_running_requests:
            if not self._try_admit(self.waiting[0]):
                break
            self.waiting.popleft()

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """End a request for any reason; its request slot and KV pages return at once (the
        pages the prefix cache holds stay there, unlocked)."""
        if (self.prefix_cache is not None and req.status is ReqStatus.RUNNING
                and reason in (FinishReason.STOP, FinishReason.LENGTH)):
            self.cache_finished(req)
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
            self.kv_pool.free_pages([p for p in req.kv_pages if p not in req.tree_pages])
            req.kv_pages, req.tree_pages = [], set()
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
        for slot in req.track_slots:
            self.state_pool.free(slot)
        req.track_slots, req.track_busy = [], set()

    # ---- prefix cache ------------------------------------------------------------------
    def cache_finished(self, req: Req) -> None:
        """A request ending normally: cache what its KV holds beyond what is cached
        already (the default: nothing more)."""
        return None

    def cache_prefix(self, req: Req, end: int, track: int = 0) -> None:
        """The KV of the request's first ``end`` tokens is written (its forward's result was
        applied): insert their whole chunks into the prefix cache and lock them for the
        request. ``track``: the track slot that forward wrote the state after ``end`` tokens
        into (0: none), donated to the node ending there; the request gets a fresh one."""
        cache = self.prefix_cache
        if track:
            req.track_busy.discard(track)
        if cache is None or req.req_pool_idx is None:
            return
        n = end // cache.chunk * cache.chunk
        if n == 0 or (n <= (req.prefix_node.end if req.prefix_node else 0) and not track):
            return
        p = req.prompt_len
        tokens = req.prompt_ids[:n] if n <= p else req.prompt_ids + req.output_ids[: n - p]
        states = {end: track} if track and end == n else None
        node, pages, donated = cache.insert(tokens, req.kv_pages[: n // self.kv_pool.page_size],
                                            states)
        req.tree_pages |= pages
        cache.lock(node)
        if req.prefix_node is not None:
            cache.unlock(req.prefix_node)
        req.prefix_node = node
        for slot in donated:  # the tree owns it now: take a fresh track slot
            req.track_slots.remove(slot)
            if self._make_room(0, 1):
                req.track_slots.append(self.state_pool.alloc())

    def track_slot(self, req: Req, end: int) -> int:
        """The track slot of a row of ``req`` ending after ``end`` tokens: a free one of its
        track slots when ``end`` is on the track grid, else 0 (the row keeps no snapshot).
        The slot is busy until the row's result is applied (``cache_prefix``)."""
        if not self.tracking or end == 0 or end % self.config.track_grid:
            return 0
        node = req.prefix_node
        if node is not None and node.end >= end:
            return 0  # cached already
        for slot in req.track_slots:
            if slot not in req.track_busy:
                req.track_busy.add(slot)
                return slot
        return 0

    def check_memory(self) -> None:
        """Accounting: every page, request slot and state slot is free, held by a running
        request, or held by the prefix cache, exactly once. Raises ``AssertionError`` on a
        leak or double-free."""
        cache = self.prefix_cache
        tree_pages, tree_states = cache.held() if cache is not None else ([], [])
        tree = set(tree_pages)
        assert len(tree) == len(tree_pages), "a KV page is held twice by the prefix cache"
        held = [p for r in self.running.values() for p in r.kv_pages if p not in r.tree_pages]
        assert all(r.tree_pages <= tree for r in self.running.values()), (
            "a request uses a page the prefix cache no longer holds")
        assert len(held) == len(set(held)) and not tree & set(held), "a KV page is held twice"
        assert (len(held) + len(tree) + self.kv_pool.num_free_pages
                == self.kv_pool.num_usable_pages), (
            f"KV pages leaked: {self.kv_pool.num_usable_pages} usable, "
            f"{self.kv_pool.num_free_pages} free, {len(held)} held, {len(tree)} cached")
        slots = [r.req_pool_idx for r in self.running.values()]
        assert len(slots) + self.req_pool.num_free == self.req_pool.max_reqs, "request slots leaked"
        if self.state_pool is not None:
            states = [r.state_slot for r in self.running.values()]
            assert None not in states, "a running request without its state slot"
            states += [s for r in self.running.values() for s in r.track_slots] + tree_states
            assert len(states) == len(set(states)), "a state slot held twice"
            assert len(states) + self.state_pool.num_free == self.state_pool.num_slots, (
                f"state slots leaked: {self.state_pool.num_slots} usable, "
                f"{self.state_pool.num_free} free, {len(states)} held")

    # ---- shared steps ------------------------------------------------------------------
    def chunk_prefill(self, target: Callable[[Req], int], granule: int) -> list[tuple[Req, int, int]]:
        """Prompt chunks ``(req, start, end)`` for this step's prefill forward: admitted
        requests in order, each advanced from its ``prefilled_len`` towards ``target(req)`` in
        multiples of ``granule`` tokens (a block), within ``max_prefill_tokens`` (at least one
        granule always fits). A hybrid model that tracks its state stops a chunk at the last
        point of the track grid inside the prompt (the rest follows the next step), so the
        longest cacheable prefix gets a state snapshot."""
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
            if self.tracking:
                grid = goal // self.config.track_grid * self.config.track_grid
                if req.prefilled_len < grid < end:
                    end = grid
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
            if req.inflight and not (batch.rows and batch.rows[i].commit_half):
                req.inflight -= 1  # this forward's result is no longer in flight
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
