"""The HTTP shapes of a traced request (``dllm.trace``): step events as named SSE events,
and log-probabilities in the OpenAI shapes (legacy completions, chat) and SGLang's.

A step event is sent as ``event: denoise_step`` followed by ``data: {...}`` (the README's
"Watch it denoise" section documents its fields), before the ordinary chunk of the same
engine step; clients that did not ask receive none of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dllm.trace import StepEvent, TokenLogprob

Obj = dict[str, Any]
Decode = Callable[[list[int]], str]


class NamedEvent(dict):
    """A JSON object sent as a named SSE event (``event: <name>``) rather than a plain
    ``data:`` message."""

    def __init__(self, event: str, data: Obj):
        super().__init__(data)
        self.event = event


def step_event(ev: StepEvent, rid: str, index: int, decode: Decode) -> NamedEvent:
    return NamedEvent("denoise_step", {
        "object": "denoise.step", "id": rid, "index": index,
        "block": {"index": ev.block_index, "offset": ev.block_offset, "size": ev.block_size},
        "step": ev.step, "forward": ev.forward, "masked": list(ev.masked),
        "committed": [{"position": c.position, "token_id": c.token_id,
                       "text": decode([c.token_id]), "confidence": _num(c.confidence),
                       "logprob": _num(c.logprob), "edit": c.edit} for c in ev.committed],
        "done": ev.done,
        "given": [{"position": i, "token_id": t, "text": decode([t])} for i, t in ev.given],
    })


def _num(x: float | None) -> float | None:
    """JSON has no NaN or infinity: a log-probability of ``-inf`` is sent as -9999.0 (what
    OpenAI sends for a token of probability 0)."""
    if x is None or x != x:
        return None
    return max(x, -9999.0) if x != float("inf") else None


def completion_logprobs(lps: list[TokenLogprob], decode: Decode, offset: int = 0) -> Obj:
    """Legacy completions ``logprobs``: tokens, their log-probabilities, the top
    alternatives of each (a dict ``{token: logprob}``), and each token's text offset from
    ``offset`` on."""
    tokens = [decode([t.token_id]) for t in lps]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [_num(t.logprob) for t in lps],
            "top_logprobs": [_top_dict(t.top, decode) for t in lps], "text_offset": offsets}


def _top_dict(top: tuple[tuple[int, float], ...], decode: Decode) -> dict[str, float | None]:
    """``{text: logprob}`` best first; ids that decode to the same text (byte pieces of
    one character) keep the best one's value."""
    out: dict[str, float | None] = {}
    for i, v in top:
        out.setdefault(decode([i]), _num(v))
    return out


def chat_logprobs(lps: list[TokenLogprob], decode: Decode) -> Obj:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], ...}``."""
    def entry(token_id: int, lp: float | None) -> Obj:
        s = decode([token_id])
        return {"token": s, "logprob": _num(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps],
            "refusal": None}


def native_logprobs(lps: list[TokenLogprob]) -> Obj:
    """SGLang's ``meta_info`` fields: ``output_token_logprobs`` ``[[logprob, id, None]]``
    and ``output_top_logprobs`` (per token a list of the same triples)."""
    return {"output_token_logprobs": [[_num(t.logprob), t.token_id, None] for t in lps],
            "output_top_logprobs": [[[_num(v), i, None] for i, v in t.top] for t in lps]}
