"""Start the server: ``dllm serve --model DIR`` and ``python -m dllm.server --model DIR``.

The model is loaded first and the port bound after, so a bad model ends the command with one
line and nothing ever listened; once listening, one line says what is served where.

On SIGTERM or SIGINT the server stops accepting connections, lets the requests running finish
for up to ``--shutdown-timeout`` seconds, then ends the rest with an OpenAI-shaped error (a
503 body, or an error event and ``[DONE]`` in a stream), and exits 0. A second SIGINT quits
at once."""

from __future__ import annotations

import argparse
import gc
import logging
import queue
import resource
import signal
import sys
from logging.handlers import QueueHandler, QueueListener
from types import FrameType

import uvicorn

from dllm.async_llm import AsyncLLM
from dllm.checkpoint import resolve_model_path
from dllm.cli_args import engine_config_from_args
from dllm.server.app import ServerState, build_app, health_answer
from dllm.server.args import ServerConfig, server_config_from_args
from dllm.server.connections import RateLimitFilter, protocol_class
from dllm.server.priority import engine_thread_init

logger = logging.getLogger("dllm.server")
# File descriptors kept free beyond the connection limit (the model, logs, the engine).
SPARE_FDS = 64
# uvicorn's own grace comes after ours: by then every request has ended.
UVICORN_GRACE_S = 10.0
SWITCH_INTERVAL_S = 0.001


class DllmServer(uvicorn.Server):
    """uvicorn's server, with the shutdown above: its signal handler does not re-raise the
    signal after a clean shutdown (that made the exit status 143 or 130, with a
    ``KeyboardInterrupt`` traceback)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            logger.info("ready: %s", self.state.describe(self.url()))

    def url(self) -> str:
        c = self.config
        host = f"[{c.host}]" if ":" in c.host else c.host
        port = c.port
        if port == 0 and self.servers:  # the port the system picked
            port = self.servers[0].sockets[0].getsockname()[1]
        return f"http://{host}:{port}"

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.state.begin_shutdown(self.shutdown_timeout)
        await super().shutdown(sockets)


def _raise_fd_limit(connections: int) -> int:
    """Raise the soft open-files limit to fit ``connections`` (up to the hard limit), so the
    server refuses connections itself instead of failing ``accept`` over and over; returns
    the connection limit that fits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fit = max(1, soft - SPARE_FDS)
        logger.warning("--limit-concurrency %d lowered to %d: the open-files limit is %d",
                       connections, fit, soft)
        return fit
    return connections


def freeze_startup_objects() -> None:
    """Move every object alive now (the model's modules, torch, transformers, the app: some
    350,000 of them) out of the garbage collector's reach. They live as long as the server,
    and a full collection walks them all while holding the interpreter lock: under load one
    took 0.3 to 1 s, and the event loop (``/health``, every stream) stood still meanwhile.
    Collections then walk only what the requests allocate."""
    gc.collect()
    gc.freeze()


def log_from_a_thread() -> QueueListener:
    """Route the root logger's records through a queue to a thread that formats and writes
    them (the standard library's ``QueueHandler``): the event loop only enqueues a record.
    Written from the loop, the 64 lines of 64 requests that end in one engine step held it
    for one write each. Returns the listener, started; ``stop()`` writes what is left."""
    root = logging.getLogger()
    records: queue.SimpleQueue = queue.SimpleQueue()
    listener = QueueListener(records, *root.handlers, respect_handler_level=True)
    root.handlers = [QueueHandler(records)]
    listener.start()
    return listener


def run_server(config: ServerConfig) -> int:
    """Load the model, then serve until interrupted. A model that does not load raises here,
    before any port is bound."""
    resolve_model_path(config.engine.model)  # a wrong path fails at once
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dllm.engine import Engine

    engine = Engine(config.engine)
    llm = AsyncLLM(engine=engine, thread_init=engine_thread_init(
        config.engine_nice, config.engine_cpu_threads, engine.device.type))
    limiter = RateLimitFilter()
    for name in ("dllm.server", "uvicorn.error", "asyncio"):
        logging.getLogger(name).addFilter(limiter)
    connections = _raise_fd_limit(config.limit_concurrency)
    # The event loop (every connection, /health) waits at most this long for the engine
    # thread's Python code to hand over the interpreter lock (the default is 5 ms).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = build_app(config, llm)
    state: ServerState = app.state.dllm
    freeze_startup_objects()
    server = DllmServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        http=protocol_class(connections, config.header_timeout, config.body_timeout,
                            lambda: health_answer(state), config.max_headers),
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=config.timeout_keep_alive,
        timeout_graceful_shutdown=config.shutdown_timeout + UVICORN_GRACE_S,
        access_log=config.log_level == "debug"), state, config.shutdown_timeout)

    def stop() -> None:
        server.should_exit = True

    state.on_load_error = stop
    writer = log_from_a_thread()
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C during the shutdown
        pass
    finally:
        writer.stop()
        logging.getLogger().handlers = list(writer.handlers)  # what is logged after, directly
    return 1 if state.load_error is not None else 0


def serve_from_args(args: argparse.Namespace) -> int:
    return run_server(server_config_from_args(args, engine_config_from_args(args)))


def main(argv: list[str] | None = None) -> int:
    """``python -m dllm.server ARGS``: the same as ``dllm serve ARGS``."""
    from dllm.server.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])
