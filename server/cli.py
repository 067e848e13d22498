"""The ``dllm`` command (the console script): the subcommands of ``COMMANDS``, each taking
the engine flags (``dllm.cli_args``) and its own.

It lives in ``server/`` because ``serve`` and ``generate`` run server code and imports go
``server → dllm``, never back: the library's commands (``chat``, ``eval``) come from ``dllm``.
The command modules are light; FastAPI and uvicorn are imported only to serve."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from dllm.chat_cmd import add_chat_args, run_chat
from dllm.cli_args import add_engine_args
from dllm.evaluate import add_eval_args, run_eval
from dllm.server.args import add_server_args
from dllm.server.generate_cmd import add_generate_args, run_generate


def _serve(args: argparse.Namespace) -> int:
    from dllm.server.launch import serve_from_args

    return serve_from_args(args)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate completions for a prompt or a JSONL file", add_generate_args,
                 run_generate),
    "serve": ("serve a model over HTTP (OpenAI-compatible API)", add_server_args, _serve),
    "chat": ("chat with a model (the built-in one by default): one message, or interactive",
             add_chat_args, run_chat),
    "eval": ("exact-match accuracy and parallelism on the built-in task families", add_eval_args,
             run_eval),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm", description="Serve diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_engine_args(p)
        add(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> Any:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
