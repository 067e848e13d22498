"""Running requests on an ``AsyncLLM`` for the HTTP routes and ``dllm generate``: validation
into engine requests (400s before anything runs), request ids the client can abort by,
streams of several prompts merged into one, and the per-request metrics.

Tokenizing and validating (``AsyncLLM.make_request`` takes the engine lock, held for a whole
engine step) run in a worker thread, never on the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from dllm.async_llm import AsyncLLM
from dllm.engine import Prompt
from dllm.outputs import StreamChunk
from dllm.request import Req
from dllm.sampling_params import DLLM_KEYS, SamplingParams
from dllm.server.metrics import ServerMetrics
from dllm.server.protocol import APIError, bad_request, clip

DEFAULT_MAX_TOKENS = SamplingParams().max_new_tokens  # when the request gives none
_FIELDS = {"temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "seed",
           "prompt"}
_DONE = object()


class Serving:
    """One served model: the engine handle, its public name, and the requests in flight."""

    def __init__(self, llm: AsyncLLM, model_name: str | None = None,
                 metrics: ServerMetrics | None = None):
        engine = llm.engine
        self.llm = llm
        self.model_path: str = engine.info.path
        self.model_name = model_name or default_model_name(self.model_path)
        self.task: str = engine.task  # "generate" or "embed"
        self.context_length: int = engine.context_length
        self.metrics = metrics
        self.created = int(time.time())
        self._groups: dict[str, list[str]] = {}  # client-visible id -> engine rids

    # ---- model names ---------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is the served name or the checkpoint path (or is absent)."""
        if name is None or name == self.model_name:
            return
        if os.path.abspath(os.path.expanduser(name)) == os.path.abspath(self.model_path):
            return
        raise APIError(404, f"the model {clip(name)!r} does not exist; this server serves "
                       f"{self.model_name!r}", "invalid_request_error", "model",
                       "model_not_found")

    # ---- building requests ---------------------------------------------------------------
    def sampling_params(self, fields: dict[str, Any], max_name: str) -> SamplingParams:
        """``SamplingParams`` from request fields (``None`` = the library default);
        ``max_new_tokens`` absent means the default, fitted to the prompt in ``make``."""
        if fields.get("max_new_tokens") is not None and fields["max_new_tokens"] < 1:
            raise bad_request(f"{max_name} must be at least 1, got {fields['max_new_tokens']}",
                              max_name)
        kwargs = {k: v for k, v in fields.items() if v is not None}
        kwargs.setdefault("max_new_tokens", 1)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise self._invalid(exc, max_name) from None

    async def make(self, gid: str, prompts: Sequence[Prompt], params: SamplingParams,
                   explicit_max: bool, max_name: str = "max_tokens") -> list[Req]:
        """Validate every prompt into an engine request (rid ``gid``, or ``gid-i`` for a list
        of prompts) and reserve ``gid`` for ``abort``. Raises ``APIError`` (400)."""
        if self.task != "generate":
            raise bad_request(f"the model {self.model_name!r} is served for embeddings "
                              "(task 'embed'); use /v1/embeddings")
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        rids = [gid] if len(prompts) == 1 else [f"{gid}-{i}" for i in range(len(prompts))]
        in_flight = {rid for group in self._groups.values() for rid in group}
        if gid in self._groups or in_flight.intersection(rids):
            raise bad_request(f"request id {clip(gid)!r} is already in use")
        self._groups[gid] = rids
        try:
            return [await asyncio.to_thread(self._make_one, p, params, rid, explicit_max,
                                            max_name)
                    for p, rid in zip(prompts, rids, strict=True)]
        except BaseException:
            self._groups.pop(gid, None)
            raise

    def _make_one(self, prompt: Prompt, params: SamplingParams, rid: str, explicit_max: bool,
                  max_name: str) -> Req:
        try:
            if not explicit_max:  # the default, fitted to this prompt before the request is
                # laid out (full-attention block sizes and steps depend on max_new_tokens)
                room = self.llm.call_in_engine(lambda e: e.max_new_tokens_room(prompt))
                params = dataclasses.replace(params, max_new_tokens=max(1, min(
                    DEFAULT_MAX_TOKENS, room)))
            return self.llm.make_request(prompt, params, rid)
        except (ValueError, TypeError) as exc:
            raise self._invalid(exc, max_name) from None

    @staticmethod
    def _invalid(exc: Exception, max_name: str) -> APIError:
        """A 400 from the library's ``ValueError``, naming the field it is about."""
        message = str(exc).replace("max_new_tokens", max_name)
        first = message.split(" ", 1)[0].strip("'")
        if "context length" in message or "KV cache" in message:
            param = max_name
        elif first in _FIELDS or first == max_name:
            param = first
        elif "token id" in message or "prompt" in message:
            param = "prompt"
        elif "chat message" in message:
            param = "messages"
        elif "dllm" in message or "algorithm" in message or first in DLLM_KEYS:
            param = "dllm"
        else:
            param = None
        return bad_request(message, param)

    # ---- running -------------------------------------------------------------------------
    async def start(self, gid: str, reqs: list[Req], arrival: float,
                    max_name: str = "max_tokens") -> RunningGroup:
        """Hand the requests to the engine and wait for the first chunk, so that a request
        the scheduler refuses (more KV than the pool holds) is still a 400."""
        group = RunningGroup(self, gid, _merge([self._stream_one(r, arrival) for r in reqs]))
        try:
            group.first = await anext(group.it)
        except ValueError as exc:
            await group.aclose()
            raise self._invalid(exc, max_name) from None
        except RuntimeError as exc:  # the engine shut down
            await group.aclose()
            raise APIError(503, str(exc), "service_unavailable_error", None,
                           "engine_unavailable") from None
        except BaseException:
            await group.aclose()
            raise
        return group

    async def _stream_one(self, req: Req, arrival: float) -> AsyncIterator[StreamChunk]:
        m = self.metrics
        seen: StreamChunk | None = None
        try:
            async with aclosing(self.llm.generate_stream(req)) as chunks:
                async for chunk in chunks:
                    if m is not None and seen is None:
                        m.on_first_chunk(time.monotonic() - arrival)
                    seen = chunk
                    if chunk.finished and m is not None:
                        m.on_finish(chunk.output, time.monotonic() - arrival)
                    yield chunk
        finally:
            if m is not None and seen is not None and not seen.finished:
                m.on_abandoned(req.prompt_len, seen.completion_tokens,
                               time.monotonic() - arrival)

    def abort(self, rid: str) -> bool:
        """Abort a request by its client-visible id (or one engine rid of a batch)."""
        rids = self._groups.get(rid)
        for r in rids or [rid]:
            self.llm.abort(r)
        return rids is not None or any(rid in g for g in self._groups.values())

    def _release(self, gid: str) -> None:
        self._groups.pop(gid, None)


class RunningGroup:
    """The merged chunks ``(prompt index, StreamChunk)`` of one API request. Closing it early
    aborts whatever is still running (and frees its memory)."""

    def __init__(self, serving: Serving, gid: str,
                 it: AsyncIterator[tuple[int, StreamChunk]]):
        self._serving = serving
        self.gid = gid
        self.it = it
        self.first: tuple[int, StreamChunk] | None = None

    def __aiter__(self) -> RunningGroup:
        return self

    async def __anext__(self) -> tuple[int, StreamChunk]:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return await anext(self.it)

    async def aclose(self) -> None:
        """Always call this when done (``finally``): it releases the id and aborts any
        request of the group that has not finished."""
        self._serving._release(self.gid)
        await self.it.aclose()


async def _merge(streams: list[AsyncIterator[StreamChunk]]
                 ) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Interleave several streams as their chunks arrive. Closing this closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for chunk in only:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StreamChunk]) -> None:
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    queue.put_nowait((i, chunk))
            queue.put_nowait((i, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # a cancelled stream aborts its request (AsyncLLM.generate_stream)
        await asyncio.gather(*tasks, return_exceptions=True)


def default_model_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or path
