"""Connections: uvicorn's h11 protocol (pinned: with ``httptools`` installed uvicorn would
prefer it, and it enforces no header limits), with a cap on open connections and deadlines for
reading a request.

- At most ``limit_concurrency`` connections are open at once; one more gets a 503 (the OpenAI
  error shape) and is closed at once, before anything of it is read.
- A connection must send a request's line and headers within ``header_timeout`` seconds of
  opening (or of its last response's end), and the body within ``body_timeout`` seconds of the
  headers; else it gets a 408 (when it sent part of a request) and is closed. An idle
  keep-alive connection is closed after ``timeout_keep_alive`` (uvicorn's own timer).
- The line and headers together are at most ``max_header_bytes`` (h11's limit; over it:
  400 and close); the number of headers is ``RequestGuardMiddleware``'s check.
- A ``GET /health`` that arrives alone on an idle connection is answered as soon as it is
  read (``health``: the route's own answer), without waiting for the app's turn: when 64
  requests arrive or finish together, the event loop runs their work before the task of a
  request read after them, and a health check (a load balancer's, Kubernetes') waited
  for it. Anything else about it (a body, a pipelined request, an ``Origin`` for CORS, too
  many headers) takes the app's path.

The warnings these print go through ``RateLimitFilter``: a flood of bad connections cannot
grow the log by more than one line per kind of event every few seconds."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dllm.server.protocol import APIError

logger = logging.getLogger("dllm.server")
LOG_EVERY_S = 10.0


def _error_bytes(exc: APIError) -> bytes:
    body = json.dumps(exc.to_dict()).encode()
    reason = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (exc.status, reason.get(exc.status, b"Error"),
                                             len(body)))
    return head + body


OVER_LIMIT = _error_bytes(APIError(503, "the server has too many open connections; retry "
                                   "later", "service_unavailable_error", None,
                                   "too_many_connections"))
TIMED_OUT = _error_bytes(APIError(408, "the request was not sent in time",
                                  "invalid_request_error", None, "request_timeout"))
INVALID = _error_bytes(APIError(400, "invalid HTTP request (malformed, or its line and "
                                "headers are too large)", "invalid_request_error", None,
                                "invalid_http_request"))


class RateLimitFilter(logging.Filter):
    """Passes a message (by its format string) at most once every ``every`` seconds, then
    says how many were dropped in between."""

    def __init__(self, every: float = LOG_EVERY_S):
        super().__init__()
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = str(record.msg)
        now = time.monotonic()
        last, dropped = self._last.get(key, (-float("inf"), 0))
        if now - last < self.every:
            self._last[key] = (last, dropped + 1)
            return False
        self._last[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.every:.0f} s)"
        return True


def protocol_class(limit_concurrency: int, header_timeout: float, body_timeout: float,
                   health: Callable[[], tuple[int, dict[str, str], bytes]] | None = None,
                   max_headers: int = 100) -> type[H11Protocol]:
    """The h11 protocol class of one server (uvicorn's ``Config(http=...)``); ``health``:
    ``GET /health``'s (status, headers, body), answered here (None: by the app)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._deadline: Any = None
            if len(self.server_state.connections) >= limit_concurrency:
                self.transport = transport
                transport.write(OVER_LIMIT)
                transport.close()
                logger.warning("refused a connection: %d connections are open "
                               "(--limit-concurrency)", limit_concurrency)
                return
            super().connection_made(transport)
            self._arm(header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.flow is None:  # refused in connection_made
                return
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.flow is None:
                return
            if health is not None and self._answer_health(data):
                return
            super().data_received(data)
            self._track()

        def _answer_health(self, data: bytes) -> bool:
            """Answer ``data`` here if it is exactly one bodiless ``GET /health`` on an idle
            connection (checked on a scratch parser first: this connection's parser is only
            fed what is answered here); False: the usual path takes it."""
            if not (data.startswith(b"GET /health ") and data.endswith(b"\r\n\r\n")):
                return False
            conn = self.conn
            if (conn.our_state is not h11.IDLE or conn.their_state is not h11.IDLE
                    or conn.trailing_data[0]
                    or (self.cycle is not None and not self.cycle.response_complete)):
                return False
            scratch = h11.Connection(h11.SERVER)
            try:
                scratch.receive_data(data)
                request, end, rest = (scratch.next_event(), scratch.next_event(),
                                      scratch.next_event())
            except h11.RemoteProtocolError:
                return False
            if not (isinstance(request, h11.Request) and request.target == b"/health"
                    and isinstance(end, h11.EndOfMessage) and rest is h11.NEED_DATA
                    and len(request.headers) <= max_headers
                    and not any(name in (b"origin", b"upgrade") for name, _ in request.headers)):
                return False
            status, headers, body = health()
            self._unset_keepalive_if_required()
            self._disarm()
            conn.receive_data(data)
            conn.next_event(), conn.next_event()  # the request and its end, as checked above
            head = [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *((k.encode(), v.encode()) for k, v in headers.items()),
                    *self.server_state.default_headers]
            self.transport.write(conn.send(h11.Response(status_code=status, headers=head))
                                 + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            self.server_state.total_requests += 1
            if conn.our_state is h11.MUST_CLOSE:  # ``Connection: close``, or HTTP/1.0
                self.transport.close()
                return True
            conn.start_next_cycle()
            self._arm(header_timeout)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)
            return True

        def handle_events(self) -> None:
            super().handle_events()
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(header_timeout)  # the next request's headers
                self._track()

        def timeout_keep_alive_handler(self) -> None:
            """uvicorn closes an idle keep-alive connection when its timer fires; a request
            that arrived just before, not read yet because the event loop was busy, would
            then be cut off (the client sees the connection drop). Such a connection stays
            open and its request is served."""
            if _bytes_waiting(self.transport):
                self.timeout_keep_alive_task = None
                return
            super().timeout_keep_alive_handler()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(INVALID)
            self.transport.close()

        # ---- deadlines -------------------------------------------------------------------
        def _track(self) -> None:
            """Move the deadline along with what the client has sent of this request."""
            state = self.conn.their_state
            if state is h11.SEND_BODY and self._phase == "headers":
                self._arm(body_timeout, "body")
            elif state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()

        def _arm(self, seconds: float, phase: str = "headers") -> None:
            self._disarm()
            self._phase = phase
            self._deadline = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
                self._deadline = None
            self._phase = None

        def _timed_out(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            responding = self.cycle is not None and self.cycle.response_started
            sent_part = self._phase == "body" or bool(self.conn.trailing_data[0])
            if sent_part and not responding:  # a silent or idle socket is just closed
                self.transport.write(TIMED_OUT)
            logger.warning("closed a connection that did not send its request in time "
                           "(--header-timeout / --body-timeout)")
            self.transport.close()

    return GuardedH11Protocol


def _bytes_waiting(transport: Any) -> bool:
    """Whether the connection's socket holds received bytes the event loop has not read."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as peek:
            return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing there (EAGAIN), or the connection is gone
        return False
