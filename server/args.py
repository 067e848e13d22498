"""The server's own flags and config (light: no FastAPI import, so ``dllm --help`` stays fast).
The engine flags are ``dllm.cli_args.add_engine_args``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dllm.config import EngineConfig

DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /generate and "
                        "/abort_request")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get a 413 (default: 10 MiB)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def server_config_from_args(args: argparse.Namespace, engine: EngineConfig) -> ServerConfig:
    return ServerConfig(engine=engine, host=args.host, port=args.port, api_key=args.api_key,
                        max_request_bytes=args.max_request_bytes, log_level=args.log_level)
