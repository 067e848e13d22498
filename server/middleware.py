"""Plain ASGI middleware: API-key auth, the header and content-type checks, and the request
body size limit (all answer before the body is parsed, with the OpenAI error shape), and the
turn every request starts in (``dllm.server.turns``)."""

from __future__ import annotations

import hmac
import json

from dllm.server.protocol import APIError
from dllm.server.turns import LoopTurns

PROTECTED_PREFIXES = ("/v1/", "/generate", "/abort_request")


async def send_error(send, exc: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(exc.to_dict()).encode()
    await send({"type": "http.response.start", "status": exc.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on the API routes (``/v1/*``, ``/generate``,
    ``/abort_request``, and ``/metrics`` when ``metrics``); ``/health`` and the docs stay
    open."""

    def __init__(self, app, api_key: str, metrics: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.prefixes = PROTECTED_PREFIXES + (("/metrics",) if metrics else ())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not any(
                scope["path"] == p.rstrip("/") or scope["path"].startswith(p)
                for p in self.prefixes):
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(got, self.expected):
            await send_error(send, APIError(
                401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                "authentication_error", None, "invalid_api_key"),
                [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class RequestGuardMiddleware:
    """431 for more than ``max_headers`` headers; 415 for a POST whose ``Content-Type`` is
    not ``application/json`` (a web page can send a cross-origin form or text/plain POST
    without asking first; it cannot send JSON that way)."""

    def __init__(self, app, max_headers: int):
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_headers:
            await send_error(send, APIError(
                431, f"the request has {len(headers)} headers; this server takes at most "
                f"{self.max_headers}", "invalid_request_error", None, "too_many_headers"),
                [(b"connection", b"close")])
            return
        if scope.get("method") == "POST":
            ctype = dict(headers).get(b"content-type", b"")
            media = ctype.split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                shown = ctype[:100].decode("latin-1") or "none"
                await send_error(send, APIError(
                    415, f"the request body must be JSON, sent with 'Content-Type: "
                    f"application/json' (got {shown!r})", "invalid_request_error", None,
                    "unsupported_media_type"))
                return
        await self.app(scope, receive, send)


# Where ``BodyLimitMiddleware`` leaves the whole body in the request's scope.
BODY_KEY = "dllm.body"


def take_body(scope: dict) -> bytearray | None:
    """The body ``BodyLimitMiddleware`` read (None without it), taken out of the scope: the
    request's next ASGI message is then its disconnect, not the body again."""
    return scope.pop(BODY_KEY, None)


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: by its Content-Length, else while it streams in.
    The body is read here, into one growing buffer as its pieces arrive (so no step of the
    event loop copies a whole 10 MB body at once, let alone twice as joining the pieces and
    Starlette's ``request.body()`` would), and left in ``scope[BODY_KEY]`` for ``take_body``;
    an app that reads it the ASGI way is given it again (as bytes, a copy), so it never sees
    a partial one."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of "
                        f"{self.max_bytes} bytes", "invalid_request_error", None,
                        "request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = 0
            if declared > self.max_bytes:
                await send_error(send, self._too_large(), [(b"connection", b"close")])
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            if len(body) + len(chunk) > self.max_bytes:
                await send_error(send, self._too_large(), [(b"connection", b"close")])
                return
            body += chunk
            if not message.get("more_body", False):
                break
        scope[BODY_KEY] = body
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                if scope.get(BODY_KEY) is body:  # not taken by the app (``take_body``)
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class TurnMiddleware:
    """Every HTTP request but ``GET /health`` starts in its turn (``LoopTurns``): a burst of
    requests cannot hold the event loop for longer than ``per_turn`` starts at a time, and a
    health check is answered between them."""

    def __init__(self, app, turns: LoopTurns):
        self.app = app
        self.turns = turns

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            await self.turns.take()
        await self.app(scope, receive, send)
