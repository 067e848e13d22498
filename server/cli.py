"""The ``dllm`` command (the console script): the subcommands of ``COMMANDS``, each taking
the engine flags (``dllm.cli_args``) and its own.

It lives in ``server/`` because ``serve`` and ``generate`` run server code and imports go
``server → dllm``, never back: the library's commands (``chat``, ``eval``) come from ``dllm``.
The command modules are imported inside ``main`` (they import torch), so that a Ctrl-C at any
moment, and every mistake, ends in one line on stderr: ``dllm: error: ...`` and exit 2 for a
mistake, ``dllm: interrupted`` and exit 130 for Ctrl-C. ``--log-level debug`` shows the
traceback instead.

The model may be given as the first positional argument, as in ``vllm serve MODEL``
(``dllm.cli_args.take_positional_model`` says how ``generate`` and ``chat`` tell it from
their prompt)."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from typing import Any, NoReturn

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


class Parser(argparse.ArgumentParser):
    """argparse, with a close match for a misspelled flag (``suggest_on_error`` comes only
    with Python 3.14) and the subcommand's usage above an unknown flag's error."""

    def unknown_flags(self, extras: list[str]) -> NoReturn:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        words = []
        for extra in extras:
            name = extra.split("=", 1)[0]
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            words.append(f"{extra} (did you mean {close[0]}?)" if close and
                         name.startswith("-") else extra)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: unrecognized argument"
                     f"{'s' if len(words) > 1 else ''}: {', '.join(words)}; "
                     f"'{self.prog} --help' lists the flags\n")

    def error(self, message: str) -> NoReturn:
        # One line naming the flag; the usage is shown only for a flag argparse does not
        # know (unknown_flags) and for a missing subcommand.
        if "required: command" in message or "invalid choice" in message and " command" in \
                message:
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _serve(args: argparse.Namespace) -> int:
    from dllm.server.launch import serve_from_args

    return serve_from_args(args)


def _generate(args: argparse.Namespace) -> int:
    from dllm.server.generate_cmd import run_generate

    return run_generate(args)


def _chat(args: argparse.Namespace) -> int:
    from dllm.chat_cmd import run_chat

    return run_chat(args)


def _eval(args: argparse.Namespace) -> int:
    from dllm.evaluate import run_eval

    return run_eval(args)


def _commands() -> dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                                   Callable[[argparse.Namespace], int]]]:
    from dllm.chat_cmd import add_chat_args
    from dllm.evaluate import add_eval_args
    from dllm.server.args import add_server_args
    from dllm.server.generate_cmd import add_generate_args

    return {
        "generate": ("generate completions for a prompt or a JSONL file", add_generate_args,
                     _generate),
        "serve": ("serve a model over HTTP (OpenAI-compatible API)", add_server_args, _serve),
        "chat": ("chat with a model (the built-in one by default): one message, or "
                 "interactive", add_chat_args, _chat),
        "eval": ("exact-match accuracy and parallelism on the built-in task families",
                 add_eval_args, _eval),
    }


def build_parser() -> argparse.ArgumentParser:
    from dllm.cli_args import add_engine_args

    parser = Parser(prog="dllm", description="Serve diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, (help_text, add, run) in _commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("serve", "eval"):
            p.add_argument("model_arg", nargs="?", metavar="MODEL",
                           help="the checkpoint directory (the same as --model)")
        add_engine_args(p)
        add(p)
        if not any("--log-level" in a.option_strings for a in p._actions):
            p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                           help="log level; debug also shows the traceback of an error "
                                "(default: %(default)s)")
        p.set_defaults(func=run)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an unknown flag is reported by its subcommand's parser, with the
    closest flag it knows."""
    from dllm.cli_args import take_positional_model

    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].unknown_flags(extras)
    if args.command in ("serve", "eval"):
        take_positional_model(args, [args.model_arg] if args.model_arg else [], None)
    return args


def main(argv: list[str] | None = None) -> Any:
    args = None
    try:
        args = parse(argv)
        return args.func(args)
    except KeyboardInterrupt:
        if args is not None and getattr(args, "log_level", None) == "debug":
            raise
        note = getattr(args, "interrupt_note", None)
        print(f"dllm: interrupted{'; ' + note if note else ''}", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every mistake is one line, not a traceback
        if args is not None and getattr(args, "log_level", None) == "debug":
            raise
        if isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError,
                            IsADirectoryError, PermissionError)):
            print(f"dllm: error: {one_line(exc)}", file=sys.stderr)
        else:
            print(f"dllm: error: {type(exc).__name__}: {one_line(exc)} (--log-level debug "
                  "shows the traceback)", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
