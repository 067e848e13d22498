"""``AsyncLLM``: the engine on a background thread, with async streaming per committed block.

Requests and aborts cross into the engine thread through a locked inbox; results come back
to each caller's event loop with ``call_soon_threadsafe``. Nothing here blocks the loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dllm.config import EngineConfig
from dllm.engine import Engine, Prompt, embed_inputs
from dllm.outputs import EmbeddingOutput, RequestOutput, StreamChunk
from dllm.request import FinishReason, Req, ReqStatus
from dllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    req: Req
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_text: str = ""
    sent_tokens: int = 0
    rejected: bool = False  # never entered the engine: leaving must not abort its rid


@dataclass(frozen=True)
class EngineStats:
    """What the engine thread saw at the end of its last loop turn: read by anyone, without
    the engine lock (``AsyncLLM.stats``)."""

    running: int = 0
    waiting: int = 0
    kv_used_pages: int = 0
    kv_total_pages: int = 0
    steps: int = 0
    # The prefix cache: prompt tokens of the admitted requests (looked up), those it served
    # (hits), and the KV pages it holds (in kv_used_pages only while a request uses them).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_pages: int = 0


class RequestStream:
    """The chunks of one request handed to the engine (``AsyncLLM.open_stream``): one per
    committed block, the last with ``finished=True``. ``aclose()`` before the end aborts the
    request, whether or not it was ever iterated."""

    def __init__(self, llm: AsyncLLM, stream: _Stream):
        self._llm = llm
        self._stream = stream
        self._done = False
        self.finished = False

    @property
    def rid(self) -> str:
        return self._stream.req.rid

    @property
    def rejected(self) -> bool:
        """The engine refused the request (it never ran)."""
        return self._stream.rejected

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = self.finished = True
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            if not self._stream.rejected:
                self._llm.abort(self.rid)


class AsyncLLM:
    def __init__(self, model: str | None = None, engine: Engine | None = None,
                 thread_init: Callable[[], None] | None = None, **engine_args: Any):
        """``thread_init`` runs first in the engine thread (the server lowers that thread's
        CPU priority and sets its torch threads there); an exception in it is logged and the
        engine runs anyway."""
        self.engine = engine or Engine(EngineConfig(model=model, **engine_args))
        self._thread_init = thread_init
        self.tokenizer = self.engine.tokenizer
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        # The engine lock guards the engine (held for a whole step); ``_cv`` guards only the
        # inbox, so handing a request over never waits for a step to end.
        self._engine_lock = threading.Lock()
        self._busy = False  # the engine had work after its last step (engine thread only)
        self.stats = self._stats()  # replaced (never mutated) by the engine thread
        self._thread = threading.Thread(target=self._loop, name="dllm-engine", daemon=True)
        self._thread.start()

    # ---- public --------------------------------------------------------------------------
    def make_request(self, prompt: Prompt, params: SamplingParams | None = None,
                     rid: str | None = None) -> Req:
        """Validate on the caller's side, so bad input is a ``ValueError`` here."""
        with self._engine_lock:  # the engine thread also uses the tokenizer and rid counter
            return self.engine.make_request(prompt, params, rid)

    def make_request_from_ids(self, ids: list[int], params: SamplingParams, rid: str) -> Req:
        """``make_request`` for a prompt already tokenized, with its id given, without the
        engine lock: for token ids the request factory reads only what never changes after
        the engine is built (its layout, the pool sizes for ``check_fits``) and its seed
        generator, never the tokenizer or the rid counter, so a request is built without
        waiting for an engine step to end."""
        return self.engine.make_request(ids, params, rid)

    def open_stream(self, req: Req) -> RequestStream:
        """Hand ``req`` to the engine now, and return its chunks. The hand-over is posted
        before this returns, so an ``abort`` posted afterwards always finds the request
        (the engine applies its inbox in order)."""
        stream = _Stream(req, asyncio.get_running_loop(), asyncio.Queue())
        self._post("add", stream)
        return RequestStream(self, stream)

    async def generate_stream(self, prompt: Prompt | Req,
                              sampling_params: SamplingParams | None = None,
                              rid: str | None = None) -> AsyncIterator[StreamChunk]:
        """Yield one chunk per committed block; the last has ``finished=True``. Leaving the
        iteration early (client gone) aborts the request and frees its memory."""
        req = prompt if isinstance(prompt, Req) else await asyncio.to_thread(
            self.make_request, prompt, sampling_params, rid)  # the engine lock, off the loop
        stream = self.open_stream(req)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def generate(self, prompt: Prompt | Req, sampling_params: SamplingParams | None = None,
                       rid: str | None = None) -> RequestOutput:
        last = None
        async for chunk in self.generate_stream(prompt, sampling_params, rid):
            last = chunk
        return last.output

    async def embed(self, texts: str | list[int] | Sequence[str | list[int]],
                    dimensions: int | None = None, normalize: bool | None = None
                    ) -> list[EmbeddingOutput]:
        """Pooled embeddings, one per text, as ``LLM.embed`` (``task="embed"`` engines). Bad
        input is a ``ValueError`` before anything runs; cancelling aborts what is unfinished."""
        batch = embed_inputs(texts)
        reqs = await asyncio.to_thread(self._make_embed_requests, batch, dimensions, normalize)
        runs = [asyncio.ensure_future(self.generate(req)) for req in reqs]
        try:
            for run in runs:
                await run
        finally:
            for run in runs:
                run.cancel()  # a cancelled run aborts its request (``generate_stream``)
            await asyncio.gather(*runs, return_exceptions=True)
        return [self.engine.embedding_of(req) for req in reqs]

    def _make_embed_requests(self, batch: list[str | list[int]], dimensions: int | None,
                             normalize: bool | None) -> list[Req]:
        reqs = []
        for text in batch:
            with self._engine_lock:
                reqs.append(self.engine.make_embed_request(text, dimensions, normalize))
        return reqs

    def abort(self, rid: str) -> None:
        self._post("abort", (rid, None))

    def abort_and_confirm(self, rids: Sequence[str]) -> Awaitable[bool]:
        """Abort ``rids`` (posted before this returns); the result is True if the engine
        held any of them unfinished (and so ended it with ``finish_reason="abort"``), False
        if they had all finished or never existed."""
        loop = asyncio.get_running_loop()
        futures = []
        for rid in rids:
            future = loop.create_future()
            self._post("abort", (rid, (loop, future)))
            futures.append(future)
        return asyncio.ensure_future(_any(futures))

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def call_in_engine(self, fn) -> Any:
        """Run ``fn(engine)`` between engine steps (for stats, memory checks)."""
        with self._engine_lock:
            return fn(self.engine)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- engine thread -------------------------------------------------------------------
    def _post(self, kind: str, item: Any) -> None:
        with self._cv:
            self._inbox.append((kind, item))
            self._cv.notify_all()

    def _loop(self) -> None:
        if self._thread_init is not None:
            try:
                self._thread_init()
            except Exception:  # noqa: BLE001 - a setting that did not apply is not fatal
                logger.exception("the engine thread's setup failed")
        while True:
            with self._cv:
                while not self._stopped and not self._inbox and not self._busy:
                    self._cv.wait()
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
            with self._engine_lock:
                for kind, item in inbox:
                    self._handle(kind, item)
                try:
                    changed = self.engine.step() if self.engine.has_work else []
                except Exception as exc:  # noqa: BLE001 - the loop must survive
                    logger.exception("engine step failed")
                    changed = self._fail_all(exc)
                self._busy = self.engine.has_work
                self.stats = self._stats()
            for req in changed:
                self._emit(req)
        for stream in list(self._streams.values()):
            self._fail(stream, RuntimeError("engine shut down"))

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "add":
            stream: _Stream = item
            rid = stream.req.rid
            try:
                if rid in self._streams:  # the running request keeps its stream
                    raise ValueError(f"request id {rid!r} is already in use")
                self.engine.add_request(stream.req)
            except ValueError as exc:
                stream.rejected = True
                self._fail(stream, exc)
                return
            self._streams[rid] = stream
        elif kind == "abort":
            rid, reply = item
            req = self.engine.abort(rid)
            if req is not None:
                self._emit(req)
            if reply is not None:
                loop, future = reply
                try:
                    loop.call_soon_threadsafe(_resolve, future, req is not None)
                except RuntimeError:  # the caller's loop is closed
                    pass

    def _stats(self) -> EngineStats:
        s, kv, cache = self.engine.scheduler, self.engine.kv_pool, self.engine.prefix_cache
        # Cached pages no request uses are as good as free (evicted when a request needs them).
        idle = cache.evictable_pages if cache is not None else 0
        return EngineStats(len(s.running), len(s.waiting), kv.num_used_pages - idle,
                           kv.num_usable_pages, self.engine.step_count,
                           s.num_admitted_prompt_tokens, s.num_cached_prompt_tokens,
                           cache.num_pages if cache is not None else 0)

    def _fail_all(self, exc: Exception) -> list[Req]:
        reqs = list(self.engine.scheduler.running.values()) + list(self.engine.scheduler.waiting)
        self.engine.scheduler.waiting.clear()
        for req in reqs:
            self.engine.scheduler.finish(req, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        # data parallel: rank 0's shadows of the requests other ranks run end with them
        remote = [req for req, _ in self.engine.remote.values()]
        self.engine.remote.clear()
        for req in remote:
            req.finish_reason, req.status = FinishReason.ERROR, ReqStatus.FINISHED
            req.error = f"{type(exc).__name__}: {exc}"
        return reqs + remote

    def _fail(self, stream: _Stream, exc: BaseException) -> None:
        self._send(stream, exc)

    @staticmethod
    def _send(stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def _emit(self, req: Req) -> None:
        stream = self._streams.get(req.rid)
        if stream is None:
            return
        chunk = self._chunk(stream)
        if chunk.finished:
            self._streams.pop(req.rid, None)
        if chunk.finished or chunk.delta_text or chunk.delta_token_ids or chunk.steps:
            self._send(stream, chunk)

    def _chunk(self, stream: _Stream) -> StreamChunk:
        req = stream.req
        checker = self.engine.scheduler.stop_checker
        finished = req.finished
        if finished:  # the exact text, decoded whole once
            text = checker.output_text(req)
        else:
            text = _stable_prefix(checker.text_of(req).update(req.output_ids), req.params.stop)
        delta_text = text[len(stream.sent_text):] if text.startswith(stream.sent_text) else ""
        if finished and not text.startswith(stream.sent_text):
            logger.warning("request %s: the streamed text is not a prefix of the final text",
                           req.rid)
        if delta_text:
            stream.sent_text = text
        delta_ids = req.output_ids[stream.sent_tokens:]
        trace = req.trace
        delta_logprobs = (trace.logprobs[stream.sent_tokens:len(req.output_ids)]
                          if trace is not None and trace.top is not None else None)
        stream.sent_tokens = len(req.output_ids)
        return StreamChunk(
            rid=req.rid, delta_text=delta_text, delta_token_ids=delta_ids, finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
            output=self.engine.output_of(req) if finished else None,
            steps=trace.take_events() if trace is not None else [],
            delta_logprobs=delta_logprobs,
        )


async def _any(futures: list[asyncio.Future]) -> bool:
    return any(await asyncio.gather(*futures))


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _stable_prefix(text: str, stops: list[str]) -> str:
    """Text safe to stream now: without a trailing partial UTF-8 character and without a
    suffix that could grow into a stop string in the next block."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]
