"""The server's own flags and config (light: no FastAPI import, so ``dllm --help`` stays fast).
The engine flags are ``dllm.cli_args.add_engine_args``.

Each ``ServerConfig`` field below is one flag: its spelling, type, default and help come from
the field, so ``--help`` cannot drift from the config. The request limits (``Limits``) are
shared with ``dllm generate``, which runs the same validation in-process."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from dllm.config import EngineConfig

DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20


@dataclass(frozen=True)
class Limits:
    """Bounds on the work one request, and all requests together, may ask for. Checked
    before anything is tokenized or reaches the engine; a request over one gets a 400 (429
    for the queue) naming it."""

    max_prompts_per_request: int = field(default=64, metadata={
        "help": "prompts one request may carry (a prompt list, /generate's text or input_ids "
                "list)"})
    max_stop_strings: int = field(default=32, metadata={
        "help": "stop strings, and separately stop token ids, one request may give"})
    max_stop_length: int = field(default=256, metadata={
        "help": "characters of one stop string"})
    max_dllm_steps: int = field(default=4096, metadata={
        "help": "largest value of the dllm loop counts: steps_per_block, steps and "
                "max_post_edit_steps"})
    max_rid_length: int = field(default=256, metadata={
        "help": "characters of a request id (/generate's rid, X-Request-Id, /abort_request); "
                "ids are printable ASCII without spaces"})
    max_queued_tokens: int = field(default=0, metadata={
        "help": "prompt + max_tokens of all the requests the server holds at once (running "
                "or waiting); a request that would go over gets a 429 with Retry-After "
                "(0: four times the KV cache's tokens)"})
    tokenizer_workers: int = field(default=2, metadata={
        "help": "threads that tokenize prompts, off the engine lock"})
    body_workers: int = field(default=2, metadata={
        "help": "processes that parse request bodies over 256 KiB, so that the server's "
                "interpreter lock (its event loop: /health, every stream) is not held while "
                "they are (0: parse them in a thread of the server)"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in ("max_queued_tokens", "body_workers") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{f.name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = field(default="127.0.0.1", metadata={
        "help": "address to bind (0.0.0.0: all)"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1/*, /generate and /abort_request"})
    api_key_metrics: bool = field(default=False, metadata={
        "help": "with --api-key, /metrics needs the key too"})
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata={
        "help": "larger request bodies get a 413 (default: 10 MiB)"})
    log_level: str = field(default="info", metadata={
        "choices": ["critical", "error", "warning", "info", "debug"], "help": "log level"})
    limit_concurrency: int = field(default=512, metadata={
        "help": "open connections at once; a connection over it gets a 503 and is closed "
                "at once"})
    max_header_bytes: int = field(default=16384, metadata={
        "help": "bytes of a request's line and headers; over it: 400 and the connection "
                "closes"})
    max_headers: int = field(default=100, metadata={
        "help": "headers of one request; over it: 431"})
    header_timeout: float = field(default=10.0, metadata={
        "help": "seconds a connection may take to send a request's headers (from when it "
                "opened or its last response ended); then it is closed (408 if it sent "
                "part of them)"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request may take to send its body once its headers are in; then "
                "408 and the connection closes"})
    timeout_keep_alive: float = field(default=5.0, metadata={
        "help": "seconds an idle keep-alive connection stays open"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "on SIGTERM or SIGINT: seconds until the process has exited; the requests "
                "running may take all but the last 1.5 s of it (at most half of it) to finish, "
                "then the rest end with an error (503 / an error event and [DONE])"})
    strict_fields: bool = field(default=False, metadata={
        "help": "answer a request that has fields this server does not know (a typo such as "
                "'temperture', or a field it does not implement such as min_p) with a 400 "
                "naming them; without it they are ignored and logged at warning level"})
    log_stats_interval: float = field(default=10.0, metadata={
        "help": "seconds between the log lines of running and waiting requests, KV-cache "
                "use and throughput, written only while there is work (0: none)"})
    allowed_origins: tuple[str, ...] = field(default=(), metadata={
        "help": "CORS: origins a browser page may call the API from, e.g. "
                "http://localhost:3000, or * for any; also as a JSON list, vLLM's form "
                "('[\"*\"]') (default: none, CORS off)"})
    allowed_methods: tuple[str, ...] = field(default=("*",), metadata={
        "help": "CORS: the methods allowed (with --allowed-origins)"})
    allowed_headers: tuple[str, ...] = field(default=("*",), metadata={
        "help": "CORS: the request headers allowed (with --allowed-origins)"})
    allow_credentials: bool = field(default=False, metadata={
        "help": "CORS: allow cookies and authorization headers (with --allowed-origins)"})
    no_web_ui: bool = field(default=False, metadata={
        "help": "serve no page at / (the page shows a prompt's block as it denoises, over "
                "the API; it asks for the key under --api-key)"})
    engine_nice: int = field(default=0, metadata={
        "help": "run the engine thread (and its torch threads) and the body workers this "
                "much nicer than the HTTP event loop (0-19): when the CPU is short, the "
                "loop (/health, every new request) runs first, and the engine's steps (every "
                "stream's pace) wait behind the loop's work (0: the same priority)"})
    engine_cpu_threads: int | None = field(default=None, metadata={
        "type": int,
        "help": "torch threads of an engine on the CPU (default: one per core but one, the "
                "core left for the HTTP event loop, at least 1; 0: torch's default, one per "
                "core)"})
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        for name in ("limit_concurrency", "max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "timeout_keep_alive",
                     "shutdown_timeout"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if isinstance(self.engine_nice, bool) or not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in [0, 19], got {self.engine_nice}")
        if self.engine_cpu_threads is not None and (
                isinstance(self.engine_cpu_threads, bool) or self.engine_cpu_threads < 0):
            raise ValueError("engine_cpu_threads must be 0 (torch's default) or positive, got "
                             f"{self.engine_cpu_threads}")
        if not 0 <= self.log_stats_interval < float("inf"):
            raise ValueError("log_stats_interval must be 0 (off) or a number of seconds, got "
                             f"{self.log_stats_interval}")


_NOT_FLAGS = ("engine", "limits")


def _add_fields(g: argparse._ArgumentGroup, cls: type) -> None:
    for f in dataclasses.fields(cls):
        if f.name in _NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if isinstance(f.default, bool):
            kw["action"] = "store_true"
        elif isinstance(f.default, tuple):
            kw.update(nargs="+", type=_list_item)
        elif f.default is not None and not isinstance(f.default, str):
            kw["type"] = type(f.default)
        elif "type" in f.metadata:  # a default of None: the value's type is named
            kw["type"] = f.metadata["type"]
        if kw.get("type") in (int, float) or "choices" in kw:
            kw["help"] += " (default: %(default)s)" if "default:" not in kw["help"] else ""
        g.add_argument(flag, **kw)


def _list_item(text: str) -> list[str]:
    """One value of a list flag: a plain value, or a JSON list of strings (vLLM's form)."""
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f"{text[:100]!r} is not a JSON list of strings; give values one by one "
                """(--allowed-origins http://a http://b) or a JSON list ('["*"]')""")
        return value
    return [text]


def add_server_args(p: argparse.ArgumentParser) -> None:
    _add_fields(p.add_argument_group("server"), ServerConfig)
    add_limit_args(p)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    _add_fields(p.add_argument_group("request limits"), Limits)


def limits_from_args(args: argparse.Namespace) -> Limits:
    return Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)
                     if hasattr(args, f.name)})


def server_config_from_args(args: argparse.Namespace, engine: EngineConfig) -> ServerConfig:
    values = {}
    for f in dataclasses.fields(ServerConfig):
        if f.name in _NOT_FLAGS:
            continue
        value = getattr(args, f.name)
        if isinstance(f.default, tuple) and value is not f.default:  # lists of items
            value = tuple(v for item in value for v in item)
        values[f.name] = value
    return ServerConfig(engine=engine, limits=limits_from_args(args), **values)
