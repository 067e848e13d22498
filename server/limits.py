"""Bounds on the work a request body may ask for, checked on the parsed JSON before the
request models validate it: a count or a length over a limit is one 400 naming the field, and
pydantic never walks a million-item list (its errors alone took seconds to build).

What is checked here is only what the size of a list or a string gives away; types and
values are the request models' and ``SamplingParams``' job. A prompt text longer than any
text of the context's length is refused here too, so that a large body's prompt need not
leave the process that parsed it (``dllm.server.body_worker``); that module's workers import
this one, hence no import of the engine's configuration here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dllm.server.protocol import bad_request

if TYPE_CHECKING:
    from dllm.server.args import Limits

Obj = dict[str, Any]
# Prompt-carrying fields of each route, and where the sampling fields sit.
PROMPT_FIELDS = {"/v1/completions": ("prompt",), "/v1/embeddings": ("input",),
                 "/generate": ("text", "input_ids"), "/v1/chat/completions": ()}


def check_body(route: str, body: Obj, limits: Limits, context_length: int,
               max_prompt_chars: int | None = None) -> None:
    """400 for the first count or length in ``body`` over a limit; a prompt text of more than
    ``max_prompt_chars`` characters (``Serving.max_prompt_chars``: no text that long fits the
    context) is one too."""
    for name in PROMPT_FIELDS.get(route, ()):
        _check_prompts(name, body.get(name), limits, context_length)
        if max_prompt_chars is not None:
            _check_prompt_chars(name, body.get(name), max_prompt_chars, context_length)
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > context_length:
            raise bad_request(f"messages: {len(messages)} messages cannot fit in the context "
                              f"length of {context_length} tokens", "messages")
        if isinstance(messages, list) and max_prompt_chars is not None:
            n = sum(_content_chars(m.get("content")) for m in messages if isinstance(m, dict))
            if n > max_prompt_chars:
                raise _too_many_chars("messages", n, context_length, "messages")
    sampling = body.get("sampling_params") if route == "/generate" else body
    if isinstance(sampling, dict):
        _check_stops(sampling, limits)
    if route == "/generate" and isinstance(body.get("rid"), str):
        rid = body["rid"]
        if len(rid) > limits.max_rid_length:
            raise bad_request(f"rid must be 1 to {limits.max_rid_length} printable ASCII "
                              "characters without spaces", "rid")


def _check_prompts(name: str, value: Any, limits: Limits, context_length: int) -> None:
    if not isinstance(value, list):
        return
    if value and isinstance(value[0], (list, str)):  # a list of prompts
        if len(value) > limits.max_prompts_per_request:
            raise bad_request(f"{name}: {len(value)} prompts in one request; this server takes "
                              f"at most {limits.max_prompts_per_request} "
                              "(--max-prompts-per-request)", name)
        for i, item in enumerate(value):
            if isinstance(item, list) and len(item) > context_length:
                raise _too_long(f"{name}.{i}", len(item), context_length, name)
    elif len(value) > context_length:  # one prompt of token ids
        raise _too_long(name, len(value), context_length, name)


def _check_prompt_chars(name: str, value: Any, max_chars: int, context_length: int) -> None:
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for i, text in enumerate(texts):
        if isinstance(text, str) and len(text) > max_chars:
            where = name if isinstance(value, str) else f"{name}.{i}"
            raise _too_many_chars(where, len(text), context_length, name)


def _content_chars(content: Any) -> int:
    """The characters of a chat message's content (a string, or text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_many_chars(where: str, n: int, context_length: int, param: str):
    return bad_request(f"{where}: a prompt of {n} characters exceeds the context length of "
                       f"{context_length} tokens", param)


def _too_long(where: str, n: int, context_length: int, param: str):
    return bad_request(f"{where}: {n} token ids exceed the context length of {context_length}",
                       param)


def _check_stops(sampling: Obj, limits: Limits) -> None:
    stop = sampling.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise bad_request(f"stop: {len(stop)} stop strings; this server takes at most "
                              f"{limits.max_stop_strings} (--max-stop-strings)", "stop")
        for s in stop:
            if isinstance(s, str) and len(s) > limits.max_stop_length:
                raise bad_request(f"stop: a stop string of {len(s)} characters; this server "
                                  f"takes at most {limits.max_stop_length} "
                                  "(--max-stop-length)", "stop")
    ids = sampling.get("stop_token_ids")
    if isinstance(ids, list) and len(ids) > limits.max_stop_strings:
        raise bad_request(f"stop_token_ids: {len(ids)} ids; this server takes at most "
                          f"{limits.max_stop_strings} (--max-stop-strings)", "stop_token_ids")
    dllm = sampling.get("dllm")
    if isinstance(dllm, dict):
        for key in ("steps_per_block", "steps", "max_post_edit_steps"):
            value = dllm.get(key)
            if isinstance(value, int) and not isinstance(value, bool) \
                    and value > limits.max_dllm_steps:
                raise bad_request(f"dllm.{key} = {str(value)[:40]}: this server runs at most "
                                  f"{limits.max_dllm_steps} (--max-dllm-steps)", "dllm")
