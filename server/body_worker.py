"""Large request bodies parsed in worker processes, so that the server's interpreter lock is
not held while they are.

``json.loads`` is C code that never lets go of the interpreter lock: a 9.5 MB prompt held it
for about 60 ms (100 ms with the surrogate check), a body of a million small objects for
about 400 ms, and meanwhile the event loop (``/health``, every stream) could not run, whatever
thread did the parsing. A worker process parses such a body, applies the bounds of
``dllm.server.limits`` (a prompt too long for the context is refused there, so it never comes
back) and returns the parsed object, or the 400 to answer; unpickling it here is a copy.

The workers (``--body-workers``, started with the server) import only this module, the
limits and the request models: no engine, no torch. Each serves one body at a time; a body
that finds every worker busy waits for one. A worker that dies is replaced, and the body it
had is parsed in a thread of the server instead (the answer is the same, only slower to
come)."""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any, BinaryIO

from dllm.server.priority import lower_priority

logger = logging.getLogger("dllm.server")
_HEADER = struct.Struct("<Q")


def _send(out: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)))
    out.write(data)
    out.flush()


def _receive(inp: BinaryIO) -> Any:
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    size = _HEADER.unpack(head)[0]
    data = inp.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def parse_and_check(raw: bytes, route: str, limits: Any, context_length: int,
                    max_prompt_chars: int | None) -> dict[str, Any]:
    """The body as a dict, or ``APIError``: what the server does for a body of any size."""
    from dllm.server.limits import check_body
    from dllm.server.protocol import parse_json_object

    body = parse_json_object(raw)
    check_body(route, body, limits, context_length, max_prompt_chars)
    return body


def _serve() -> None:
    """A worker's loop (``python -m dllm.server.body_worker``): requests on stdin, answers
    on the stdout it started with (the descriptor 1 then goes to stderr, so that nothing
    printed can break the stream). Ends at the end of stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    from dllm.server.protocol import APIError

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    while True:
        try:
            raw, route, limits, context_length, max_prompt_chars = _receive(inp)
        except EOFError:
            return
        try:
            body = parse_and_check(raw, route, SimpleNamespace(**limits), context_length,
                                   max_prompt_chars)
            answer: tuple = ("ok", body)
        except APIError as exc:
            answer = ("error", exc.status, exc.message, exc.type, exc.param, exc.code)
        except Exception as exc:  # noqa: BLE001 - the server parses it itself then
            answer = ("failed", f"{type(exc).__name__}: {exc}"[:200])
        try:
            _send(out, answer)
        except (RecursionError, pickle.PicklingError):  # nested too deeply to pickle
            _send(out, ("failed", "the parsed body could not be sent back"))


class _Worker:
    def __init__(self, nice: int = 0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dllm.server.body_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lower_priority(self.proc.pid, nice)  # after the event loop, as the engine
        for pipe in (self.proc.stdin, self.proc.stdout):
            _widen(pipe.fileno())

    def ask(self, request: tuple) -> tuple:
        _send(self.proc.stdin, request)
        return _receive(self.proc.stdout)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class BodyWorkers:
    """``workers`` processes that parse bodies (``parse``: call it from a thread; it blocks
    until a worker is free and has answered)."""

    def __init__(self, workers: int, nice: int = 0):
        self._nice = nice
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(workers):
            self._idle.put(_Worker(nice))

    def parse(self, raw: bytes, route: str, limits: Any, context_length: int,
              max_prompt_chars: int | None) -> dict[str, Any]:
        """What ``parse_and_check`` returns or raises, worked out in a worker."""
        from dllm.server.protocol import APIError

        request = (raw, route, _plain(limits), context_length, max_prompt_chars)
        worker = self._idle.get()
        try:
            answer = worker.ask(request)
        except (OSError, EOFError, pickle.UnpicklingError):
            answer = ("failed", f"the body worker {worker.proc.pid} ended")
            worker.close()
            worker = None if self._closed else _Worker(self._nice)
        finally:
            if worker is not None and self._closed:
                worker.close()
            elif worker is not None:
                self._idle.put(worker)
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "error":
            raise APIError(*answer[1:])
        logger.warning("a body was parsed in the server itself: %s", answer[1])
        return parse_and_check(raw, route, limits, context_length, max_prompt_chars)

    def close(self) -> None:
        """End the workers (each finishes the body it has)."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


def _widen(fd: int) -> None:
    """Make a pipe hold as much as the system lets it (``/proc/sys/fs/pipe-max-size``, 1 MiB
    by default, instead of 64 KiB): a 10 MB body then crosses in 10 hand-overs between the
    two processes, not 160, each of which waits for the other to be scheduled."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = int(f.read())
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), min(size, 16 * 2**20))
    except (OSError, ValueError, ImportError):  # not Linux: the default size
        pass


def _plain(limits: Any) -> dict[str, Any]:
    """The limits as a dict (the worker reads them as attributes, without importing the
    server's arguments module)."""
    return {k: v for k, v in vars(limits).items() if isinstance(v, (int, float, str, bool))
            or v is None}


if __name__ == "__main__":
    _serve()
