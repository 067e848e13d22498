"""Running requests on an ``AsyncLLM`` for the HTTP routes and ``dllm generate``: validation
into engine requests (400s before anything runs), request ids the client can abort by,
streams of several prompts merged into one, the server's queue bound, and the per-request
metrics.

Prompts are tokenized once, in a small thread pool of their own (each thread with its own
copy of the tokenizer), never under the engine lock and never on the event loop; a prompt
too long for the context is refused from its length before it is tokenized whole."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

from dllm.algorithms import get_algorithm
from dllm.async_llm import AsyncLLM, RequestStream
from dllm.engine import Prompt
from dllm.outputs import StreamChunk
from dllm.request import Req
from dllm.sampling_params import DLLM_KEYS, SamplingParams
from dllm.server.args import Limits
from dllm.server.metrics import ServerMetrics
from dllm.server.protocol import APIError, bad_request, clip
from dllm.server.turns import LoopTurns
from dllm.tokenizer import check_chat_template

logger = logging.getLogger("dllm.server")
DEFAULT_MAX_TOKENS = SamplingParams().max_new_tokens  # when the request gives none
_FIELDS = {"temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "seed",
           "prompt"}
_DONE = object()
# The dllm keys the engine reads itself (the algorithm reads the rest).
_ENGINE_KEYS = {"algorithm", "block_size", "cache_mode", "cfg_scale"}
# A prompt text over this many characters is counted in pieces of this size first, and
# refused as soon as the count passes the context (a cut can change the count of the
# tokens beside it: each piece is allowed that many tokens more).
COUNT_PIECE_CHARS = 16384
COUNT_PIECE_SLACK = 16
# A token covers at most ``max_token_chars`` characters of the normalized text; a
# normalizer may compose characters (NFC: up to about 4 into 1), hence the factor.
NORMALIZE_FACTOR = 4
RETRY_AFTER_S = 1


def queue_full(queued: int, limit: int) -> APIError:
    return APIError(429, f"the server's queue is full ({queued} of {limit} tokens held by "
                    "requests running or waiting); retry later", "rate_limit_error", None,
                    "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "service_unavailable_error", None,
                    "server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclasses.dataclass
class _Group:
    """One API request's engine requests, from validation to its end."""

    rids: list[str]
    tokens: int = 0  # prompt + max_new_tokens of its requests (the queue bound)
    streams: list[RequestStream] | None = None  # set when handed to the engine
    abort_rids: set[str] = dataclasses.field(default_factory=set)  # asked while building
    aborted: asyncio.Future | None = None  # the engine's answer to those aborts
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    shut_down: bool = False  # ended by the server's shutdown, not by the client


class Serving:
    """One served model: the engine handle, its public name, and the requests in flight."""

    def __init__(self, llm: AsyncLLM, model_name: str | Sequence[str] | None = None,
                 metrics: ServerMetrics | None = None, limits: Limits | None = None,
                 strict_fields: bool = False, turns: LoopTurns | None = None):
        """``turns``: the event loop's turns, taken once a request's prompts are tokenized
        (its next steps, up to the engine, are work on the loop; ``dllm.server.turns``)."""
        engine = llm.engine
        self.llm = llm
        self.model_path: str = engine.info.path
        names = [model_name] if isinstance(model_name, str) else list(model_name or [])
        # Every name is accepted in requests; the first is the one responses report.
        self.model_names: list[str] = names or [default_model_name(self.model_path)]
        self.model_name = self.model_names[0]
        self.strict_fields = strict_fields
        self.turns = turns
        self.task: str = engine.task  # "generate" or "embed"
        self.context_length: int = engine.context_length
        self.vocab_size: int = engine.info.vocab_size
        self.metrics = metrics
        self.limits = limits or Limits()
        self.created = int(time.time())
        kv_tokens = engine.kv_pool.num_usable_pages * engine.kv_pool.page_size
        self.max_queued_tokens = self.limits.max_queued_tokens or 4 * kv_tokens
        self.queued_tokens = 0
        self.prompt_tokens_done = 0  # prompts of requests that produced a first block
        self.generated_tokens = 0  # committed output tokens (the throughput log line)
        self.closing = False  # shutting down: no new requests
        self.ending = False  # the shutdown's grace is over: everything ends now
        self._groups: dict[str, _Group] = {}  # client-visible id -> its requests
        self._pool = ThreadPoolExecutor(self.limits.tokenizer_workers,
                                        thread_name_prefix="dllm-tokenize")
        self._local = threading.local()
        self._primed = self._prime_tokenizers()
        self.max_token_chars = max([len(t) for t in engine.tokenizer.get_vocab()] or [1])
        self.max_prompt_chars = NORMALIZE_FACTOR * self.context_length * self.max_token_chars

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- model names ---------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is a served name or the checkpoint path (or is absent)."""
        if name is None or self.serves(name):
            return
        raise APIError(404, f"the model {clip(name)!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in self.model_names)}",
                       "invalid_request_error", "model", "model_not_found")

    def serves(self, name: str) -> bool:
        if name in self.model_names:
            return True
        return os.path.abspath(os.path.expanduser(name)) == os.path.abspath(self.model_path)

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
            params = SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise self._invalid(exc, max_name) from None
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"stop_token_ids: token id {bad} is outside the vocabulary of "
                              f"{self.vocab_size} tokens", "stop_token_ids")
        self._check_dllm_keys(params.dllm)
        return params

    def _check_dllm_keys(self, dllm: dict[str, Any]) -> None:
        """400 naming the ``dllm`` keys that the request's algorithm would ignore."""
        engine = self.llm.engine
        if not dllm or engine.mask_token_id is None:  # autoregressive: the factory refuses
            return
        name = dllm.get("algorithm") or engine.algorithm_name
        try:
            algorithm = get_algorithm(name)
        except ValueError as exc:
            raise bad_request(f"dllm.algorithm: {exc}", "dllm") from None
        used = set(algorithm.defaults) | _ENGINE_KEYS
        if engine.full_attention and used & {"steps", "steps_per_block"}:
            used.add("steps")  # the total over the canvas (dllm.full_diffusion)
        ignored = sorted(set(dllm) - used)
        if ignored:
            raise bad_request(
                f"dllm: the algorithm {name!r} does not use {', '.join(ignored)}; it reads "
                f"{', '.join(sorted(algorithm.defaults)) or 'no keys'}", "dllm")

    async def make(self, gid: str, prompts: Sequence[Prompt],
                   params: SamplingParams | Sequence[SamplingParams], explicit_max: bool,
                   max_name: str = "max_tokens") -> list[Req]:
        """Validate every prompt into an engine request (rid ``gid``, or ``gid-i`` for a list
        of prompts; ``params`` one for all or one each) and reserve ``gid`` for ``abort``.
        Raises ``APIError`` (400, 429, 503)."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if self.task != "generate":
            raise bad_request(f"the model {self.model_name!r} is served for embeddings "
                              "(task 'embed'); use /v1/embeddings")
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        if len(prompts) > self.limits.max_prompts_per_request:
            raise bad_request(f"prompt: {len(prompts)} prompts in one request; this server "
                              f"takes at most {self.limits.max_prompts_per_request}", "prompt")
        if self.closing:
            raise shutting_down()
        if self.queued_tokens >= self.max_queued_tokens:
            raise queue_full(self.queued_tokens, self.max_queued_tokens)
        rids = [gid] if len(prompts) == 1 else [f"{gid}-{i}" for i in range(len(prompts))]
        in_flight = {rid for group in self._groups.values() for rid in group.rids}
        if gid in self._groups or in_flight.intersection(rids):
            raise bad_request(f"request id {clip(gid)!r} is already in use")
        group = self._groups[gid] = _Group(rids)
        try:
            loop = asyncio.get_running_loop()
            reqs = list(await asyncio.gather(*(
                loop.run_in_executor(self._pool, self._make_one, p, sp, rid, explicit_max,
                                     max_name)
                for p, sp, rid in zip(prompts, each, rids, strict=True))))
            if self.turns is not None:
                await self.turns.take()
            tokens = sum(r.prompt_len + r.params.max_new_tokens for r in reqs)
            if self.queued_tokens + tokens > self.max_queued_tokens:
                raise queue_full(self.queued_tokens, self.max_queued_tokens)
            group.tokens = tokens
            self.queued_tokens += tokens
            return reqs
        except BaseException:
            self._release(gid)
            raise

    def _prime_tokenizers(self) -> list[Any]:
        """Give every pool thread its tokenizer copy now, in the background, not on its first
        request (a deep copy: long for a large vocabulary). The tasks wait for each other, so
        each runs on a thread of its own; returns their futures."""
        n = self.limits.tokenizer_workers
        all_started = threading.Barrier(n)

        def prime() -> None:
            self._tokenizer()
            try:
                all_started.wait(timeout=60)
            except threading.BrokenBarrierError:  # a thread did not start in time: fine
                pass

        return [self._pool.submit(prime) for _ in range(n)]

    def _tokenizer(self) -> Any:
        """This pool thread's own tokenizer (a fast tokenizer is not meant to be shared
        between threads while the engine thread decodes with it)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.llm.engine.tokenizer)
        return tok

    def decode(self, ids: list[int]) -> str:
        """The text of a few token ids (a traced request's tokens), with the calling
        thread's own tokenizer."""
        return self._tokenizer().decode(ids)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, as the engine's request factory would make them (a pool
        thread: this is the one tokenization of the request)."""
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError("each chat message needs a string 'role' and 'content'")
            self._check_chars(sum(len(m["content"]) for m in prompt))
            check_chat_template(self._tokenizer())
            text = self._tokenizer().apply_chat_template(prompt, tokenize=False,
                                                          add_generation_prompt=True)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text = prompt
        else:
            return prompt  # token ids: the factory checks them
        self._check_chars(len(text))
        tok = self._tokenizer()
        if len(text) > COUNT_PIECE_CHARS:
            self._count_pieces(text, tok)
        return tok.encode(text, add_special_tokens=False)

    # ---- /tokenize, /detokenize ----------------------------------------------------------
    async def tokenize(self, req: Any) -> dict[str, Any]:
        """``/tokenize``: the prompt's ids as a generation request would tokenize them."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", "prompt")
        prompt: Prompt
        if req.messages is not None:
            prompt = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                       else "".join(p.text or "" for p in m.content or [])}
                      for m in req.messages]
        else:
            prompt = req.prompt

        def run() -> tuple[list[int], list[str] | None]:
            ids = self.prompt_ids(prompt)
            if req.add_special_tokens and isinstance(prompt, str):
                ids = self._tokenizer().encode(prompt, add_special_tokens=True)
            strs = (self._tokenizer().convert_ids_to_tokens(ids) if req.return_token_strs
                    else None)
            return ids, strs

        try:
            ids, strs = await asyncio.get_running_loop().run_in_executor(self._pool, run)
        except ValueError as exc:
            raise bad_request(str(exc), "messages" if req.messages is not None
                              else "prompt") from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.context_length,
                               "tokens": ids}
        if strs is not None:
            out["token_strs"] = strs
        return out

    async def detokenize(self, req: Any) -> dict[str, Any]:
        """``/detokenize``: the text of token ids (each inside the vocabulary)."""
        self.check_model(req.model)
        if len(req.tokens) > self.context_length:
            raise bad_request(f"tokens: {len(req.tokens)} ids, more than the context length of "
                              f"{self.context_length}", "tokens")
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary of "
                              f"{self.vocab_size} tokens", "tokens")
        text = await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: self._tokenizer().decode(req.tokens))
        return {"prompt": text}

    def _check_chars(self, n: int) -> None:
        if n > self.max_prompt_chars:
            raise ValueError(
                f"prompt ({n} characters) exceeds the context length of {self.context_length} "
                f"tokens (a token of this tokenizer covers at most {self.max_token_chars} "
                "characters)")

    def _count_pieces(self, text: str, tok: Any) -> None:
        n = 0
        for start in range(0, len(text), COUNT_PIECE_CHARS):
            piece = text[start:start + COUNT_PIECE_CHARS]
            n += max(0, len(tok.encode(piece, add_special_tokens=False)) - COUNT_PIECE_SLACK)
            if n > self.context_length:
                raise ValueError(f"prompt (more than {n} tokens) exceeds the context length "
                                 f"of {self.context_length}")

    def _make_one(self, prompt: Prompt, params: SamplingParams, rid: str, explicit_max: bool,
                  max_name: str) -> Req:
        try:
            ids = self.prompt_ids(prompt)
            if not explicit_max:  # the default, fitted to this prompt before the request is
                # laid out (full-attention block sizes and steps depend on max_new_tokens)
                room = self.llm.engine.max_new_tokens_room(ids)
                params = dataclasses.replace(params, max_new_tokens=max(1, min(
                    DEFAULT_MAX_TOKENS, room)))
            return self.llm.make_request_from_ids(ids, params, rid)
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
        group = self._groups[gid]
        if self.ending:
            self._release(gid)
            raise shutting_down()
        # Handed over synchronously: an abort from now on finds them in the engine.
        group.streams = [self.llm.open_stream(r) for r in reqs]
        if group.abort_rids:
            group.aborted = self.llm.abort_and_confirm(sorted(group.abort_rids))
        group.ready.set()
        running = RunningGroup(self, gid, group, _merge(
            [self._stream_one(s, r, arrival) for s, r in zip(group.streams, reqs, strict=True)]))
        try:
            running.first = await anext(running.it)
        except ValueError as exc:
            await running.aclose()
            raise self._invalid(exc, max_name) from None
        except RuntimeError as exc:  # the engine shut down
            await running.aclose()
            raise APIError(503, str(exc), "service_unavailable_error", None,
                           "engine_unavailable") from None
        except BaseException:
            await running.aclose()
            raise
        return running

    async def _stream_one(self, stream: RequestStream, req: Req, arrival: float
                          ) -> AsyncIterator[StreamChunk]:
        m = self.metrics
        seen: StreamChunk | None = None
        first = True
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    # The first output (a chunk of step events alone is not: TTFT counts
                    # tokens, whether or not the request asked for steps).
                    if first and (chunk.delta_token_ids or chunk.finished):
                        first = False
                        self.prompt_tokens_done += req.prompt_len
                        if m is not None:
                            m.on_first_chunk(time.monotonic() - arrival)
                    self.generated_tokens += len(chunk.delta_token_ids)
                    seen = chunk
                    if chunk.finished:
                        if m is not None:
                            m.on_finish(chunk.output, time.monotonic() - arrival)
                        if chunk.output is not None:
                            logger.info("%s", access_line(chunk.output,
                                                          time.monotonic() - arrival))
                    yield chunk
        finally:
            if m is not None and not stream.rejected and not (seen and seen.finished):
                m.on_abandoned(req.prompt_len, seen.completion_tokens if seen else 0,
                               time.monotonic() - arrival)

    async def abort(self, rid: str) -> bool:
        """Abort a request by its client-visible id (or one engine rid of a batch): True if
        the engine ended something because of it. A request still being tokenized is
        aborted as it reaches the engine, before it runs a step."""
        group = self._groups.get(rid)
        rids = None if group is None else group.rids
        if group is None:
            group = next((g for g in self._groups.values() if rid in g.rids), None)
            if group is None:
                return False
            rids = [rid]
        if group.streams is None:  # still being built
            group.abort_rids.update(rids)
            await group.ready.wait()
            return bool(group.aborted is not None and await group.aborted)
        return await self.llm.abort_and_confirm(rids)

    def end_all(self) -> None:
        """The shutdown's grace is over: abort everything still running (each route then
        answers with a 503 error, or an error event in a stream) and refuse what is still
        being built."""
        self.closing = self.ending = True
        for group in self._groups.values():
            if group.streams is not None:
                group.shut_down = True
                for rid in group.rids:
                    self.llm.abort(rid)

    @property
    def num_in_flight(self) -> int:
        return len(self._groups)

    def _release(self, gid: str) -> None:
        group = self._groups.pop(gid, None)
        if group is not None:
            self.queued_tokens -= group.tokens
            group.tokens = 0
            group.ready.set()


class RunningGroup:
    """The merged chunks ``(prompt index, StreamChunk)`` of one API request. Closing it early
    aborts whatever is still running (and frees its memory)."""

    def __init__(self, serving: Serving, gid: str, group: _Group,
                 it: AsyncIterator[tuple[int, StreamChunk]]):
        self._serving = serving
        self._group = group
        self.gid = gid
        self.it = it
        self.first: tuple[int, StreamChunk] | None = None

    @property
    def shut_down(self) -> bool:
        """Ended by the server's shutdown (its abort is the server's, not the client's)."""
        return self._group.shut_down

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
        try:
            await self.it.aclose()
        finally:
            for stream in self._group.streams or []:
                await stream.aclose()  # one a merge task never started


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


def access_line(out: Any, seconds: float) -> str:
    """The info-level line logged when a request ends."""
    n = out.completion_tokens
    line = (f"request {out.rid}: {out.prompt_tokens} prompt + {n} output tokens, "
            f"{out.num_forward_passes} forwards ({out.tokens_per_forward:.2f} tokens/forward), "
            f"{seconds:.3f} s, {out.finish_reason}")
    return line + (f" ({clip(out.error)})" if out.error else "")


class StatsLogger:
    """Every ``interval`` seconds while there is work, one info line: requests running and
    waiting, KV-cache use, and the prompt and output tokens per second since the last line
    (read from counters the engine thread and the routes keep; no engine lock)."""

    def __init__(self, serving: Serving, interval: float):
        self.serving = serving
        self.interval = interval
        self._last = (time.monotonic(), serving.prompt_tokens_done, serving.generated_tokens)

    def line(self) -> str | None:
        """The line for now, or None when nothing ran or waited since the last one."""
        s = self.serving
        stats = s.llm.stats
        now = (time.monotonic(), s.prompt_tokens_done, s.generated_tokens)
        then, self._last = self._last, now
        if not (stats.running or stats.waiting or now[1] != then[1] or now[2] != then[2]):
            return None
        dt = max(now[0] - then[0], 1e-9)
        total = max(stats.kv_total_pages, 1)
        return (f"running {stats.running}, waiting {stats.waiting}, KV cache "
                f"{100 * stats.kv_used_pages / total:.1f}% ({stats.kv_used_pages}/"
                f"{stats.kv_total_pages} pages), {(now[2] - then[2]) / dt:.1f} output "
                f"tokens/s, {(now[1] - then[1]) / dt:.1f} prompt tokens/s")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            line = self.line()
            if line is not None:
                logger.info("%s", line)


def default_model_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or path
