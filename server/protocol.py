"""Request models of the HTTP API (OpenAI and the SGLang-style native ``/generate``) and the
error type every route answers with (DESIGN §10).

Models are strict (no ``"5"`` for an integer) and allow unknown fields, so OpenAI clients that
send fields we do not use keep working (the OpenAI routes log them, or refuse them under
``--strict-fields``); fields we cannot honour (``best_of`` other than ``n``, penalties, ...)
are refused with a 400 by ``reject_unsupported``."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_ECHO = 100  # characters of client input echoed back in an error message
MAX_MESSAGE = 500


def clip(text: str, limit: int = MAX_ECHO) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = clip(message, MAX_MESSAGE)
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_request")


def not_ready() -> APIError:
    return APIError(503, "the model is still loading; retry when /health answers 200",
                    "service_unavailable_error", None, "model_not_ready")


# ---- parsing ------------------------------------------------------------------------------
# A JSON ``\\uD800``-``\\uDFFF`` escape, an escaped backslash (so ``\\\\ud800`` is not taken
# for one), or a valid surrogate pair.
_SURROGATES = re.compile(rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                         rb"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_ANY_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _lone_surrogate(raw: bytes) -> bool:
    """Whether the body escapes half of a UTF-16 surrogate pair (``"\\ud800"``), which
    decodes to a string no UTF-8 encoder (the tokenizer, the response) can write."""
    if not _ANY_SURROGATE.search(raw):
        return False
    for m in _SURROGATES.finditer(raw):
        if len(m.group()) == 6:  # not an escaped backslash, not a pair
            return True
    return False


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying why not. Strict JSON: ``NaN`` and
    ``Infinity`` are refused, and so is an integer of more than 4,300 digits (Python's limit
    for converting one) and a lone UTF-16 surrogate."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid JSON: it is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # NaN / Infinity, or an integer too long to convert
        raise bad_request(f"the request body is not valid JSON: {clip(str(exc))}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if _lone_surrogate(raw):
        raise bad_request("the request body holds a lone UTF-16 surrogate escape (such as "
                          "\\ud800): it is not valid Unicode text")
    return body


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``model.model_validate(body)``, with pydantic's errors turned into one 400."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
    message = f"{loc}: {err['msg']}" if loc else err["msg"]
    if err.get("type") != "missing" and "input" in err:
        message += f" (got {clip(_short_repr(err['input']))})"
    more = exc.error_count() - 1
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return bad_request(message, loc.split(".")[0] if loc else None)


def _short_repr(value: Any) -> str:
    if isinstance(value, (list, dict)) and len(value) > MAX_ECHO:
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, str):
        value = value[: MAX_ECHO + 1]
    try:
        return json.dumps(value, ensure_ascii=False)[: MAX_ECHO + 1]
    except (TypeError, ValueError):
        return repr(value)[: MAX_ECHO + 1]


def check_rid(rid: str, name: str, max_length: int) -> str:
    """A request id as the client gave it: 1 to ``max_length`` printable ASCII characters
    without spaces (it is echoed in responses and written to logs)."""
    if not (0 < len(rid) <= max_length and rid.isascii() and rid.isprintable()
            and " " not in rid):
        raise bad_request(f"{name} must be 1 to {max_length} printable ASCII characters "
                          "without spaces", name)
    return rid


# ---- models -------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False
    # vLLM's extension: with ``include_usage``, every chunk carries the usage so far (token
    # counts arrive with each committed block, whether or not it decodes to text yet).
    continuous_usage_stats: bool = False
    # dllm's extension: one ``event: denoise_step`` per denoise forward (README, "Watch it
    # denoise"); streams without it are unchanged.
    denoise_steps: bool = False


class _Sampling(_Model):
    """The ``SamplingParams`` fields every generation route takes (``None``: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    dllm: dict[str, Any] | None = None  # per-request diffusion settings (SamplingParams.dllm)


class SamplingFields(_Sampling):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields accepted only at their no-op value (see ``reject_unsupported``).
    n: int | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def denoise_steps(self) -> bool:
        """Step events asked for (they exist only in a stream)."""
        return self.stream and bool(self.stream_options and self.stream_options.denoise_steps)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class EmbeddingRequest(_Model):
    """``/v1/embeddings``: ``dimensions`` truncates (Matryoshka) before normalisation;
    ``base64`` is the little-endian float32 bytes of each vector."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class NativeSamplingParams(_Sampling):
    max_new_tokens: int | None = None


class GenerateRequest(_Model):
    """SGLang's ``/generate``: ``text`` or ``input_ids`` (one prompt or a list of them)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    stream_options: StreamOptions | None = None  # only ``denoise_steps`` is read here
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int | None = None


class TokenizeRequest(_Model):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` (the chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class AbortRequest(_Model):
    rid: str


# ---- what we refuse -----------------------------------------------------------------------
def _unsupported(req: _Model) -> tuple[str, str] | None:
    """(field, reason) of the first field set to a value this server cannot honour."""
    get = lambda name: getattr(req, name, None)  # noqa: E731
    checks: list[tuple[str, bool, str]] = [
        ("best_of", get("best_of") not in (None, 1, get("n")),
         "best_of other than n is not supported"),
        ("top_logprobs", get("top_logprobs") is not None and get("logprobs") is not True,
         "top_logprobs needs logprobs: true"),
        ("top_logprobs_num", get("top_logprobs_num") is not None and not get("return_logprob"),
         "top_logprobs_num needs return_logprob: true"),
        ("echo", bool(get("echo")) and get("logprobs") is not None,
         "echo with logprobs (the prompt's log probabilities) is not supported"),
        ("suffix", bool(get("suffix")), "suffix is not supported"),
        ("presence_penalty", bool(get("presence_penalty")), "penalties are not supported"),
        ("frequency_penalty", bool(get("frequency_penalty")), "penalties are not supported"),
        ("logit_bias", bool(get("logit_bias")), "logit_bias is not supported"),
        ("tools", bool(get("tools")), "tools are not supported"),
        ("response_format",
         (get("response_format") or {"type": "text"}).get("type") != "text",
         "only the 'text' response_format is supported"),
    ]
    return next(((name, why) for name, bad, why in checks if bad), None)


def reject_unsupported(req: _Model) -> None:
    hit = _unsupported(req)
    if hit is not None:
        raise bad_request(f"{hit[0]}: {hit[1]}", hit[0])
