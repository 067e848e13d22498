"""The ``dllm`` command. Subcommands register themselves in ``COMMANDS``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from dllm.cli_args import add_engine_args


def _cmd_generate(args: argparse.Namespace) -> int:
    from dllm.generate_cmd import run_generate

    return run_generate(args)


def _add_generate(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("prompt", nargs="?", help="a prompt to complete (streamed to the terminal)")
    p.add_argument("--input", help="JSONL input: {prompt}, {messages} or OpenAI batch lines")
    p.add_argument("--output", help="JSONL output in the OpenAI batch output shape (appended; "
                                    "custom_ids already there are skipped)")
    p.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    g = p.add_argument_group("sampling (defaults for input lines that do not set them)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: 128, capped by the context length")
    g.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--dllm", type=json.loads, default=None,
                   help='per-request diffusion settings as JSON, e.g. \'{"threshold": 0.9}\'')


def _cmd_serve(args: argparse.Namespace) -> int:
    from dllm.server.launch import serve_from_args

    return serve_from_args(args)


def _add_serve(p: argparse.ArgumentParser) -> None:
    from dllm.server.args import add_server_args

    add_engine_args(p)
    add_server_args(p)


def _cmd_chat(args: argparse.Namespace) -> int:
    from dllm.chat_cmd import run_chat

    return run_chat(args)


def _add_chat(p: argparse.ArgumentParser) -> None:
    from dllm.chat_cmd import add_chat_args

    add_engine_args(p)
    add_chat_args(p)


def _cmd_eval(args: argparse.Namespace) -> int:
    from dllm.evaluate import run_eval

    return run_eval(args)


def _add_eval(p: argparse.ArgumentParser) -> None:
    from dllm.evaluate import add_eval_args

    add_engine_args(p)
    add_eval_args(p)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate completions for a prompt or a JSONL file", _add_generate,
                 _cmd_generate),
    "serve": ("serve a model over HTTP (OpenAI-compatible API)", _add_serve, _cmd_serve),
    "chat": ("chat with a model (the built-in one by default): one message, or interactive",
             _add_chat, _cmd_chat),
    "eval": ("exact-match accuracy and parallelism on the built-in task families", _add_eval,
             _cmd_eval),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm", description="Serve diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
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
