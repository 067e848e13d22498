"""Turns of the server's event loop: heavy steps of many requests spread over several turns,
so that what arrives meanwhile (a health check, a stream's next chunk) is not kept waiting
behind all of them."""

from __future__ import annotations

import asyncio
from collections import deque


class LoopTurns:
    """At most ``per_turn`` callers pass ``take()`` in one turn of the event loop; the others
    wait, in arrival order, for later turns.

    A request's start (routing, body parsing, validation, the chat template), its hand-over
    to the engine once tokenized, its answer's rendering and each of a stream's chunks are
    synchronous work on the event loop. When 64 requests arrive together, or get their
    chunks or finish in the same engine step, their work ran in one loop turn
    (about 3 ms each on a slow CPU: some 200 ms), and a ``/health`` (or any stream's next
    chunk) that arrived meanwhile waited for all of it. Taken in turns, the same work runs
    in slices of ``per_turn`` with the loop's I/O between them: nothing is refused and the
    total work is unchanged."""

    def __init__(self, per_turn: int):
        if per_turn < 1:
            raise ValueError(f"per_turn must be at least 1, got {per_turn}")
        self.per_turn = per_turn
        self._used = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._reset_due = False

    async def take(self) -> None:
        if self._used < self.per_turn and not self._waiters:
            self._used += 1
            self._schedule_reset()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._schedule_reset()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # woken, then cancelled: pass it on
                self._wake(1)
            raise

    def _schedule_reset(self) -> None:
        if not self._reset_due:
            self._reset_due = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        """Runs at the start of the next turn: a new budget, the first waiters woken with
        it (they run in the turn after, which this budget then covers)."""
        self._reset_due = False
        self._used = 0
        self._wake(self.per_turn)

    def _wake(self, n: int) -> None:
        while n > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._used += 1
                n -= 1
        if self._used:
            self._schedule_reset()
