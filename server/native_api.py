"""SGLang-style ``POST /generate``.

Body: ``text`` (a string or a list) or ``input_ids`` (a list of ids or a list of lists),
``sampling_params`` {max_new_tokens, temperature, top_p, top_k, stop, stop_token_ids,
ignore_eos, seed, dllm}, ``stream``, optional ``rid``, ``return_logprob`` (with
``top_logprobs_num``: ``meta_info.output_token_logprobs`` / ``output_top_logprobs``) and
``stream_options.denoise_steps`` (named ``denoise_step`` events, as on the OpenAI routes). Answer per prompt:
``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"finish_reason": {"type", "matched"}, ...}}`` (a list for a list of prompts). Streaming (one
prompt) sends that object after each committed block, with the text and ids so far (SGLang's
cumulative form), then ``data: [DONE]``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dllm.outputs import RequestOutput, StreamChunk
from dllm.request import Req
from dllm.server.openai_api import collect, generation_failed
from dllm.server.protocol import (
    GenerateRequest,
    bad_request,
    check_rid,
    reject_unsupported,
    validate,
)
from dllm.server.serving import RunningGroup, Serving, shutting_down
from dllm.server.trace_format import native_logprobs, step_event
from dllm.trace import MAX_TOP_LOGPROBS

Obj = dict[str, Any]


class NativeServing:
    def __init__(self, serving: Serving):
        self.serving = serving

    async def generate(self, body: Obj | GenerateRequest
                       ) -> Obj | list[Obj] | AsyncIterator[Obj]:
        arrival = time.monotonic()
        req = body if isinstance(body, GenerateRequest) else validate(GenerateRequest, body)
        reject_unsupported(req)
        if req.rid is not None:
            check_rid(req.rid, "rid", self.serving.limits.max_rid_length)
        prompts, batched = _prompts(req)
        if batched and req.stream:
            raise bad_request("streaming a list of prompts is not supported; send one request "
                              "per prompt", "stream")
        sp = req.sampling_params
        if req.top_logprobs_num is not None and not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}, got "
                              f"{req.top_logprobs_num}", "top_logprobs_num")
        steps = req.stream and bool(req.stream_options and req.stream_options.denoise_steps)
        params = self.serving.sampling_params(
            {**{k: getattr(sp, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k",
                                            "stop", "stop_token_ids", "ignore_eos", "seed",
                                            "dllm")},
             "logprobs": (req.top_logprobs_num or 0) if req.return_logprob else None,
             "denoise_steps": steps or None}, "max_new_tokens")
        gid = req.rid or f"gen-{uuid.uuid4().hex}"
        reqs = await self.serving.make(gid, prompts, params, sp.max_new_tokens is not None,
                                       "max_new_tokens")
        group = await self.serving.start(gid, reqs, arrival, "max_new_tokens")
        if req.stream:
            return self._stream(group, reqs[0], arrival)
        outs = await collect(group, len(reqs))
        results = [result(r, o, time.monotonic() - arrival) for r, o in zip(reqs, outs,
                                                                             strict=True)]
        return results if batched else results[0]

    async def _stream(self, group: RunningGroup, req: Req, arrival: float
                      ) -> AsyncIterator[Obj]:
        text, ids = "", []
        try:
            async for _, part in group:
                for ev in part.steps:
                    yield step_event(ev, req.rid, 0, self.serving.decode)
                if part.output is not None:
                    if part.output.finish_reason == "error":
                        yield generation_failed(part.output).to_dict()
                        return
                    if part.output.finish_reason == "abort" and group.shut_down:
                        yield shutting_down().to_dict()
                        return
                    yield result(req, part.output, time.monotonic() - arrival)
                    return
                if not (part.delta_text or part.delta_token_ids):
                    continue  # step events only
                text += part.delta_text
                ids += part.delta_token_ids
                yield {"text": text, "output_ids": list(ids), "meta_info": _progress(req, part)}
        finally:
            await group.aclose()


def result(req: Req, out: RequestOutput, seconds: float) -> Obj:
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": {
        "id": out.rid, "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
        "finish_reason": finish_reason(out, req),
        "num_forward_passes": out.num_forward_passes,
        "num_denoise_forwards": out.num_denoise_forwards,
        "num_blocks": out.num_blocks,
        "e2e_latency": round(seconds, 6),
        **(native_logprobs(out.logprobs) if out.logprobs is not None else {}),
    }}


def finish_reason(out: RequestOutput, req: Req) -> Obj:
    # The request object is final once its last chunk arrived: the engine set
    # ``stop_matched`` before it emitted that chunk.
    reason: Obj = {"type": out.finish_reason,
                   "matched": req.stop_matched if out.finish_reason == "stop" else None}
    if out.finish_reason == "length":
        reason["length"] = out.completion_tokens
    return reason


def _progress(req: Req, part: StreamChunk) -> Obj:
    return {"id": req.rid, "prompt_tokens": part.prompt_tokens,
            "completion_tokens": part.completion_tokens, "finish_reason": None}


def _prompts(req: GenerateRequest) -> tuple[list, bool]:
    """The prompts and whether the body held a list of them."""
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'", "text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [req.text], False
        return list(req.text), True
    ids = req.input_ids
    if ids and isinstance(ids[0], list):
        return list(ids), True
    return [ids], False
