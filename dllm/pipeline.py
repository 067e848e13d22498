"""How the engine runs what the scheduler plans: the overlap schedule and per-request failure
isolation, each in one place.

* ``Isolation.run(batch)``: run a batch and apply its result; if it fails, run it again
  request by request (``Scheduler.split``) so that only the failing request ends, with an
  error. A request writes only its own KV slots and a result is applied row by row, each row
  isolated (``Scheduler.apply_rows``), so an exception there means nothing was applied and a
  retry is safe — for KV, which a retry overwrites with the same values. Not for recurrent
  state (hybrid models): a forward that fails after some Mamba layers ran has already
  advanced the state of every row that writes it, and a retry would advance it again. So a
  failed batch ends every row that writes state (``ScheduledBatch.state_writers``: a prefill
  chunk, a decode step, a commit forward) with an error, and retries only the rows that write
  none (block-diffusion denoise steps) one by one.
* ``OverlapPipeline``: under the overlap schedule a step's overlappable forwards are queued
  first and the previous step's results are read and applied while the device runs them; the
  next step builds on results not yet read through ``Scheduler.launched``. Outputs are the
  same as without overlap; a result reaches the caller one step later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.request import FinishReason, Req
from dllm.runner.forward_batch import ScheduledBatch
from dllm.runner.memory import ReqToTokenPool
from dllm.runner.model_runner import ModelRunner
from dllm.scheduler import Scheduler

logger = logging.getLogger(__name__)

# The error suffix of a request ended because its batch failed while writing its state.
STATE_WRITTEN = (" (its batch failed in a forward that writes this request's recurrent "
                 "state, which may be partly advanced: it cannot be retried)")


@dataclass
class Launched:
    """A queued forward whose result the host has not applied yet."""

    batch: ScheduledBatch
    output: Any


class Isolation:
    """``check_peers``: called first when a batch fails; ends the process when a
    tensor-parallel rank is gone (its collectives fail on every rank; nothing to retry).
    ``retry`` False (data-parallel ranks, whose forwards must line up with their peers'): a
    failed batch ends its requests with the error instead of being run again one by one."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, req_pool: ReqToTokenPool,
                 check_peers: Callable[[], None] = lambda: None, retry: bool = True):
        self.retry_ok = retry
        self.runner = runner
        self.scheduler = scheduler
        self.req_pool = req_pool
        self.check_peers = check_peers

    def launch(self, batch: ScheduledBatch, overlapped: bool) -> Launched:
        """Queue one forward and its post-step; record what the next step may build on and,
        when ``overlapped``, start copying the part the host reads."""
        batch.table_version = self.req_pool.version
        output = self.runner.forward(batch)
        fetched = self.runner.read(batch, output) if overlapped else output
        # last: nothing after it may fail (a retry would count the launch twice)
        self.scheduler.launched(batch, output)
        return Launched(batch, fetched)

    def run(self, batch: ScheduledBatch) -> list[Req]:
        """Run and apply ``batch``, retrying it request by request if it fails."""
        try:
            job = self.launch(batch, overlapped=False)
            return self.scheduler.update(job.batch, job.output)
        except Exception as exc:  # noqa: BLE001 - isolate the failing request
            self.check_peers()
            units = self.scheduler.split(batch)
            if self.retry_ok and (len(units) > 1 or batch.state_writers()):
                return self.retry(batch, exc, units)
            return self._fail(batch, exc)

    def retry(self, batch: ScheduledBatch, exc: Exception,
              units: list[ScheduledBatch] | None = None) -> list[Req]:
        """After ``batch`` failed with ``exc``: end the requests whose rows write recurrent
        state (module docstring), and run the others request by request, skipping requests
        that have ended meanwhile."""
        changed = []
        for unit in units if units is not None else self.scheduler.split(batch):
            if not all(self.scheduler.row_owner(unit, i) is not None
                       for i in range(unit.batch_size)):
                continue
            if unit.state_writers():
                changed.extend(self._fail(unit, exc, STATE_WRITTEN))
            else:
                changed.extend(self.run(unit))
        return changed

    def _fail(self, batch: ScheduledBatch, exc: Exception, why: str = "") -> list[Req]:
        failed, seen = [], set()
        for i, rid in enumerate(batch.rids):  # one request (a CFG request has two rows)
            req = self.scheduler.row_owner(batch, i)
            if req is not None and rid not in seen:
                seen.add(rid)
                logger.exception("request %s failed%s", rid, why)
                self.scheduler.finish(req, FinishReason.ERROR,
                                      f"{type(exc).__name__}: {exc}{why}")
                failed.append(req)
        return failed


class OverlapPipeline:
    """``pending``: the previous step's forwards whose results are not applied yet."""

    def __init__(self, isolation: Isolation, enabled: bool):
        self.isolation = isolation
        self.scheduler = isolation.scheduler
        self.enabled = enabled
        self.pending: list[Launched] = []
        self._queued: list[Launched] = []

    def overlaps(self, batch: ScheduledBatch) -> bool:
        return self.enabled and self.isolation.runner.overlappable(batch)

    def launch(self, batch: ScheduledBatch) -> list[Req]:
        """Queue ``batch``; if that fails, apply the results in flight first (launch order:
        the batch was built before them, so requests they finish drop out of the retry) and
        retry it request by request."""
        try:
            self._queued.append(self.isolation.launch(batch, overlapped=True))
            return []
        except Exception as exc:  # noqa: BLE001 - retried request by request
            self.isolation.check_peers()
            logger.warning("a batch failed (%s: %s); retrying it request by request",
                           type(exc).__name__, exc)
            return self.drain() + self.isolation.retry(batch, exc)

    def drain(self) -> list[Req]:
        """Apply the results still in flight."""
        pending, self.pending = self.pending, []
        return [req for job in pending for req in self.scheduler.update(job.batch, job.output)]

    def end_step(self) -> list[Req]:
        """Apply the previous step's results; this step's queued forwards become pending."""
        changed = self.drain()
        self.pending, self._queued = self._queued, []
        return changed
