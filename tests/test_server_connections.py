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
