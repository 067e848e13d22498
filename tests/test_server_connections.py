"""``dllm.server.connections``: whether a connection holds a request the event loop has not
read yet (an idle keep-alive connection with one is not closed by its timer)."""

from __future__ import annotations

import asyncio

from dllm.server.connections import _bytes_waiting


def test_bytes_waiting_sees_unread_bytes_only():
    async def main() -> list[bool]:
        transports: list[asyncio.Transport] = []

        class Paused(asyncio.Protocol):
            def connection_made(self, transport):
                transport.pause_reading()  # the loop does not read: the bytes stay queued
                transports.append(transport)

        loop = asyncio.get_running_loop()
        server = await loop.create_server(Paused, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        seen = []
        _, quiet = await asyncio.open_connection("127.0.0.1", port)
        _, talker = await asyncio.open_connection("127.0.0.1", port)
        while len(transports) < 2:
            await asyncio.sleep(0.01)
        talker.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await talker.drain()
        await asyncio.sleep(0.2)
        seen += [_bytes_waiting(transports[0]), _bytes_waiting(transports[1])]
        quiet.close()
        await asyncio.sleep(0.2)
        seen.append(_bytes_waiting(transports[0]))  # closed by the client: nothing to serve
        talker.close()
        server.close()
        return seen

    assert asyncio.run(main()) == [False, True, False]


def _exchange(sends: list[bytes], health_answer=(200, {}, b'{"status":"ok"}')) -> tuple[
        list[bytes], list[str]]:
    """Serve one connection with ``protocol_class`` over a small ASGI app that names the paths
    it was called for; send each of ``sends`` after the answer to the one before; return
    what came back after each, and the paths the app saw."""
    import uvicorn
    from uvicorn.server import ServerState

    from dllm.server.connections import protocol_class

    seen: list[str] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append(scope["path"] + ("?" + scope["query_string"].decode()
                                     if scope["query_string"] else ""))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"3")]})
        await send({"type": "http.response.body", "body": b"app"})

    async def main() -> list[bytes]:
        cls = protocol_class(10, 5.0, 5.0, lambda: health_answer, max_headers=4)
        config = uvicorn.Config(app, http=cls, log_level="warning", lifespan="off")
        config.load()
        state = ServerState()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: cls(config=config, server_state=state, app_state={}), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for data in sends:
            writer.write(data)
            await writer.drain()
            got = b""
            while True:  # until the answers stop coming for a moment
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), 0.3)
                except asyncio.TimeoutError:
                    break
                got += chunk
                if not chunk:
                    break
            answers.append(got)
        writer.close()
        server.close()
        return answers

    return asyncio.run(main()), seen


def _bodies(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in ``raw``."""
    import h11

    conn, out = h11.Connection(h11.CLIENT), []
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    status, body = None, b""
    while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            out.append((status, body))
            body = b""
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                break
            conn.start_next_cycle()
            conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
            conn.send(h11.EndOfMessage())
    return out


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_health_is_answered_by_the_connection_and_keeps_it_usable():
    answers, seen = _exchange([
        HEALTH, HEALTH,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",  # the same connection, next request
        HEALTH,
        b"GET /health?full=1 HTTP/1.1\r\nHost: x\r\n\r\n",  # not exactly /health: the app
        b"GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://a.example\r\n\r\n",  # CORS: app
        HEALTH + HEALTH,  # pipelined: the app's path, in order
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ])
    ok = (200, b'{"status":"ok"}')
    assert [_bodies(a) for a in answers] == [
        [ok], [ok], [(200, b"app")], [ok], [(200, b"app")], [(200, b"app")],
        [(200, b"app"), (200, b"app")], [ok]]
    assert seen == ["/v1/models", "/health?full=1", "/health", "/health", "/health"]
    assert answers[-1].lower().count(b"connection: close") == 1


def test_health_answer_carries_the_apps_status_and_headers():
    answers, seen = _exchange([HEALTH, b"GET /health HTTP/1.1\r\n" + b"".join(
        b"X-%d: 1\r\n" % i for i in range(5)) + b"Host: x\r\n\r\n"],
        health_answer=(503, {"Retry-After": "5"}, b'{"error":{}}'))
    assert _bodies(answers[0]) == [(503, b'{"error":{}}')]
    assert b"retry-after: 5\r\n" in answers[0].lower()
    assert _bodies(answers[1]) == [(200, b"app")]  # more headers than max_headers: the app
    assert seen == ["/health"]
