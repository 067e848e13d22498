"""Start the server: ``dllm serve --model DIR`` and ``python -m dllm.server --model DIR``."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from dllm.checkpoint import resolve_model_path
from dllm.cli_args import add_engine_args, engine_config_from_args
from dllm.server.app import build_app
from dllm.server.args import ServerConfig, add_server_args, server_config_from_args


def run_server(config: ServerConfig) -> int:
    """Serve until interrupted; 1 if the model failed to load."""
    resolve_model_path(config.engine.model)  # a wrong path fails here, before binding a port
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=5, access_log=config.log_level == "debug"))
    state = app.state.dllm

    def stop() -> None:
        server.should_exit = True

    state.on_load_error = stop
    server.run()
    return 1 if state.load_error is not None else 0


def serve_from_args(args: argparse.Namespace) -> int:
    return run_server(server_config_from_args(args, engine_config_from_args(args)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm.server",
                                     description="Serve a diffusion language model over HTTP.")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        return serve_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dllm: error: {exc}", file=sys.stderr)
        return 2
