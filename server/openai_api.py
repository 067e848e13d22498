"""The OpenAI routes' logic, shared by the HTTP server and ``dllm generate``: a JSON body in,
a completion / chat.completion object (or an async iterator of chunk objects) out.

A request with several prompts (``prompt: [..]``) runs them together; each is a choice.
Streaming yields one chunk per committed block of any choice (the chunk's ``index`` says
which), and with ``stream_options.include_usage`` a last chunk with the usage (and with
``continuous_usage_stats`` the usage so far on every chunk, as vLLM does).
``stream_options.denoise_steps`` adds a named ``denoise_step`` event per denoise forward
(``dllm.server.trace_format``); ``logprobs`` / ``top_logprobs`` are the committed tokens'
log-probabilities (``dllm.trace``), in the OpenAI shapes.
``/v1/embeddings`` needs an engine started with ``task="embed"``."""

from __future__ import annotations

import base64
import dataclasses
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dllm.engine import embed_inputs
from dllm.outputs import RequestOutput
from dllm.sampling_params import SamplingParams
from dllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
    bad_request,
    clip,
    reject_unsupported,
    validate,
)
from dllm.server.serving import RunningGroup, Serving, shutting_down
from dllm.server.trace_format import chat_logprobs, completion_logprobs, step_event
from dllm.trace import MAX_TOP_LOGPROBS

Chunk = dict[str, Any]
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
logger = logging.getLogger("dllm.server")
MAX_NAMED_FIELDS = 10  # unknown fields named in one log line or error
_MASK63 = 2**63 - 1


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample ``j`` of a request with ``n > 1``: sample 0 keeps the request's
    seed, the others get distinct seeds mixed from it (splitmix64); without a seed every
    sample draws its own."""
    if seed is None or j == 0:
        return seed
    z = (seed + j * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & _MASK63


def unknown_fields(req: Any) -> list[str]:
    """The top-level fields of a request that its model does not declare (typos included)."""
    return sorted(req.model_extra or {})


class OpenAIServing:
    def __init__(self, serving: Serving):
        self.serving = serving

    # ---- /v1/completions -----------------------------------------------------------------
    async def completions(self, body: dict[str, Any] | CompletionRequest,
                          request_id: str | None = None
                          ) -> Chunk | AsyncIterator[Chunk]:
        arrival = time.monotonic()
        req = body if isinstance(body, CompletionRequest) else validate(CompletionRequest, body)
        prompts = completion_prompts(req.prompt)
        gid = request_id or f"cmpl-{uuid.uuid4().hex}"
        group = await self._start(req, gid, prompts, req.max_tokens, "max_tokens", arrival,
                                  req.logprobs)
        n = len(prompts) * (req.n or 1)
        echo = [self._echo_text(p) for p in prompts for _ in range(req.n or 1)] \
            if req.echo else None
        if req.stream:
            return self._stream(group, "text_completion", n, req.include_usage,
                                req.continuous_usage, echo, req.denoise_steps)
        return self._full(await collect(group, n), gid, "text_completion", echo)

    # ---- /v1/chat/completions ------------------------------------------------------------
    async def chat(self, body: dict[str, Any] | ChatCompletionRequest,
                   request_id: str | None = None) -> Chunk | AsyncIterator[Chunk]:
        arrival = time.monotonic()
        req = body if isinstance(body, ChatCompletionRequest) else validate(
            ChatCompletionRequest, body)
        messages = [chat_message(m, i) for i, m in enumerate(req.messages)]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        gid = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        group = await self._start(req, gid, [messages], max_tokens, name, arrival,
                                  (req.top_logprobs or 0) if req.logprobs else None,
                                  "top_logprobs")
        n = req.n or 1
        if req.stream:
            return self._stream(group, "chat.completion.chunk", n, req.include_usage,
                                req.continuous_usage, None, req.denoise_steps)
        return self._full(await collect(group, n), gid, "chat.completion")

    # ---- /v1/embeddings ------------------------------------------------------------------
    async def embeddings(self, body: dict[str, Any] | EmbeddingRequest) -> Chunk:
        req = body if isinstance(body, EmbeddingRequest) else validate(EmbeddingRequest, body)
        self.serving.check_model(req.model)
        if self.serving.task != "embed":
            raise bad_request(f"the model {self.serving.model_name!r} is served for text "
                              "generation, not embeddings; start the server with --task embed "
                              "(a sentence-transformers checkpoint is detected by itself)")
        inputs = embed_inputs(req.input)
        if not inputs:
            raise bad_request("input must not be empty", "input")
        try:
            outs = await self.serving.llm.embed(inputs, req.dimensions)
        except ValueError as exc:
            param = "dimensions" if str(exc).startswith("dimensions") else "input"
            raise bad_request(str(exc), param) from None
        except RuntimeError as exc:  # the request failed in the engine, or it shut down
            raise APIError(500, f"embedding failed: {exc}", "server_error", None,
                           "internal_error") from None
        n = sum(o.prompt_tokens for o in outs)
        return {"object": "list", "data": [
            {"object": "embedding", "index": i,
             "embedding": encode_embedding(o.embedding, req.encoding_format)}
            for i, o in enumerate(outs)],
            "model": self.serving.model_name, "usage": {"prompt_tokens": n, "total_tokens": n}}

    # ---- one batch line (``dllm generate``) ----------------------------------------------
    async def handle(self, url: str, body: dict[str, Any]) -> tuple[int, str, Chunk]:
        """(status code, request id, response body) of a non-streaming call, errors
        included: one line of a batch file."""
        rid = f"{'chatcmpl' if url.endswith('/chat/completions') else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if url == "/v1/completions":
                return 200, rid, await self.completions({**body, "stream": False}, rid)
            if url == "/v1/chat/completions":
                return 200, rid, await self.chat({**body, "stream": False}, rid)
            raise APIError(404, f"unknown url {url[:100]!r}; use one of {', '.join(ENDPOINTS)}",
                           param="url", code="unknown_url")
        except APIError as exc:
            return exc.status, rid, exc.to_dict()

    # ---- shared --------------------------------------------------------------------------
    def check_fields(self, req: Any, gid: str) -> None:
        """Fields the request's model does not declare: a 400 naming them under
        ``--strict-fields``, else one warning for the request (vLLM's behaviour)."""
        unknown = unknown_fields(req)
        if not unknown:
            return
        names = ", ".join(repr(clip(n, 40)) for n in unknown[:MAX_NAMED_FIELDS])
        if len(unknown) > MAX_NAMED_FIELDS:
            names += f" and {len(unknown) - MAX_NAMED_FIELDS} more"
        if self.serving.strict_fields:
            raise bad_request(f"unknown field{'s' if len(unknown) > 1 else ''} {names} (this "
                              "server is started with --strict-fields)", clip(unknown[0], 40))
        logger.warning("request %s: ignored unknown field%s %s", gid,
                       "s" if len(unknown) > 1 else "", names.encode("ascii", "replace")
                       .decode())

    async def _start(self, req: SamplingFields, gid: str, prompts: list, max_tokens: int | None,
                     max_name: str, arrival: float, logprobs: int | None = None,
                     logprobs_name: str = "logprobs") -> RunningGroup:
        """``logprobs``: the top alternatives asked for (None: no log-probabilities), from
        the field ``logprobs_name``."""
        self.check_fields(req, gid)
        reject_unsupported(req)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"{logprobs_name} must be between 0 and {MAX_TOP_LOGPROBS}, got "
                              f"{logprobs}", logprobs_name)
        self.serving.check_model(req.model)
        if req.n is not None and req.n < 1:
            raise bad_request(f"n must be at least 1, got {req.n}", "n")
        n = req.n or 1
        if len(prompts) * n > self.serving.limits.max_prompts_per_request:
            raise bad_request(f"n: {len(prompts)} prompt(s) x n={n} samples in one request; this "
                              f"server takes at most {self.serving.limits.max_prompts_per_request}",
                              "n")
        params = self.serving.sampling_params({
            "max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos, "seed": req.seed, "dllm": req.dllm,
            "logprobs": logprobs, "denoise_steps": req.denoise_steps or None,
        }, max_name)
        each: list[SamplingParams] = [dataclasses.replace(params, seed=choice_seed(params.seed, j))
                                      for j in range(n)]
        reqs = await self.serving.make(gid, [p for p in prompts for _ in range(n)],
                                       [sp for _ in prompts for sp in each],
                                       max_tokens is not None, max_name)
        return await self.serving.start(gid, reqs, arrival, max_name)

    def _echo_text(self, prompt: Any) -> str:
        """``echo``: the prompt as text (token ids decoded)."""
        if isinstance(prompt, str):
            return prompt
        return self.serving.llm.engine.tokenizer.decode(prompt)

    def _decode(self, ids: list[int]) -> str:
        return self.serving.decode(ids)

    def _logprobs(self, lps: list | None, obj: str, offset: int = 0) -> Chunk | None:
        if lps is None:
            return None
        if obj.startswith("chat"):
            return chat_logprobs(lps, self._decode)
        return completion_logprobs(lps, self._decode, offset)

    def _full(self, outs: list[RequestOutput], gid: str, obj: str,
              echo: list[str] | None = None) -> Chunk:
        choices = []
        for i, out in enumerate(outs):
            choice: Chunk = {"index": i}
            if obj == "chat.completion":
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = (echo[i] if echo else "") + out.text
            choice.update(logprobs=self._logprobs(out.logprobs, obj, len(echo[i]) if echo
                                                  else 0),
                          finish_reason=out.finish_reason)
            choices.append(choice)
        return {"id": gid, "object": obj, "created": int(time.time()),
                "model": self.serving.model_name, "choices": choices, "usage": usage(outs)}

    async def _stream(self, group: RunningGroup, obj: str, n: int, include_usage: bool,
                      continuous_usage: bool = False, echo: list[str] | None = None,
                      denoise_steps: bool = False) -> AsyncIterator[Chunk]:
        created = int(time.time())
        chat = obj == "chat.completion.chunk"
        finals: list[RequestOutput | None] = [None] * n
        counts = [(0, 0)] * n  # (prompt, completion) tokens of each choice so far
        offsets = [len(e) for e in echo] if echo else [0] * n  # text offsets (logprobs)

        def chunk(choices: list[Chunk], **extra: Any) -> Chunk:
            c = {"id": group.gid, "object": obj, "created": created,
                 "model": self.serving.model_name, "choices": choices}
            if include_usage:
                c["usage"] = None
            c.update(extra)
            return c

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for i in range(n)])
            elif echo:
                yield chunk([{"index": i, "text": echo[i], "logprobs": None,
                              "finish_reason": None} for i in range(n)])
            async for i, part in group:
                out = part.output
                if out is not None and out.finish_reason == "error":
                    yield generation_failed(out).to_dict()
                    return
                if out is not None and out.finish_reason == "abort" and group.shut_down:
                    yield shutting_down().to_dict()
                    return
                if denoise_steps:
                    for ev in part.steps:
                        yield step_event(ev, group.gid, i, self._decode)
                if not (part.finished or part.delta_text or part.delta_token_ids):
                    continue  # a chunk of step events only
                choice: Chunk = {"index": i}
                if chat:
                    choice["delta"] = {"content": part.delta_text} if part.delta_text else {}
                else:
                    choice["text"] = part.delta_text
                choice.update(logprobs=self._logprobs(part.delta_logprobs, obj, offsets[i]),
                              finish_reason=part.finish_reason)
                if part.delta_logprobs is not None and not chat:
                    offsets[i] += sum(len(t) for t in choice["logprobs"]["tokens"])
                if continuous_usage:
                    counts[i] = (part.prompt_tokens, part.completion_tokens)
                    prompt, done = sum(c[0] for c in counts), sum(c[1] for c in counts)
                    yield chunk([choice], usage={"prompt_tokens": prompt,
                                                 "completion_tokens": done,
                                                 "total_tokens": prompt + done})
                else:
                    yield chunk([choice])
                if out is not None:
                    finals[i] = out
            if include_usage:
                yield chunk([], usage=usage([o for o in finals if o is not None]))
        finally:
            await group.aclose()


# ---- helpers (also used by the native API) ------------------------------------------------
async def collect(group: RunningGroup, n: int) -> list[RequestOutput]:
    """Run a group to the end; a failed generation is a 500."""
    outs: list[RequestOutput | None] = [None] * n
    try:
        async for i, part in group:
            if part.output is not None:
                outs[i] = part.output
    finally:
        await group.aclose()
    if group.shut_down and any(o is None or o.finish_reason == "abort" for o in outs):
        raise shutting_down()
    for out in outs:
        if out is None or out.finish_reason == "error":
            raise generation_failed(out)
    return outs  # type: ignore[return-value]


def generation_failed(out: RequestOutput | None) -> APIError:
    why = out.error if out is not None else "no output"
    return APIError(500, f"generation failed: {why}", "server_error", None, "internal_error")


def usage(outs: list[RequestOutput]) -> Chunk:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    # As OpenAI reports it: the prompt tokens served by the prefix cache (not prefilled).
    cached = sum(o.cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def completion_prompts(prompt: str | list) -> list:
    """A string, a list of strings, a list of ids or a list of id lists -> one prompt each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def chat_message(m: ChatMessage, i: int) -> dict[str, str]:
    """A message as the chat template wants it: string role and content (text parts joined)."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages.{i}.content: only text parts are supported, got "
                                  f"type {part.type[:100]!r}", "messages")
            texts.append(part.text)
        content = "".join(texts)
    return {"role": m.role, "content": content or ""}
