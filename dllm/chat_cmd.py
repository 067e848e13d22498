"""``dllm chat``: answer one message, or chat on the terminal (history kept, Ctrl-D exits).

Without ``--model`` it runs the built-in model (``dllm/builtin_model/``). That model was trained
mostly on single questions (a tenth of its examples carry one or two earlier exchanges), so by
default it is shown only the last earlier exchange; the whole history is still kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

BUILTIN_HISTORY = 1  # earlier exchanges the built-in model is shown (accuracy drops with more)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("message", nargs="?",
                   help="a message to answer once; without it, chat interactively")
    p.add_argument("--system", default=None, help="a system message put first")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dllm", type=json.loads, default=None,
                   help='per-request diffusion settings as JSON, e.g. \'{"threshold": 0.9}\'')
    p.add_argument("--history", type=int, default=None,
                   help="earlier exchanges the model sees (default: all; "
                        f"{BUILTIN_HISTORY} for the built-in model)")


def prompt_messages(history: list[dict[str, str]], system: str | None,
                    keep: int | None) -> list[dict[str, str]]:
    """The messages sent to the model: the system message, then the last ``keep`` earlier
    exchanges (user + assistant) and the new user message at the end of ``history``."""
    if keep is not None:
        history = history[-(2 * keep + 1):]
    return ([{"role": "system", "content": system}] if system else []) + history


def run_chat(args: argparse.Namespace) -> int:
    from dllm.cli_args import engine_config_from_args
    from dllm.llm import LLM
    from dllm.sampling_params import SamplingParams

    cfg = engine_config_from_args(args)
    llm = LLM(**{k: getattr(cfg, k) for k in cfg.field_names()})
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            dllm=args.dllm or {})
    keep = args.history if args.history is not None else (
        BUILTIN_HISTORY if args.model in (None, "builtin-hybrid") else None)

    def reply(history: list[dict[str, Any]]) -> str:
        out = llm.chat(prompt_messages(history, args.system, keep), params)[0]
        if out.error:
            raise RuntimeError(out.error)
        return out.text.strip()

    if args.message is not None:
        print(reply([{"role": "user", "content": args.message}]))
        return 0
    return interactive(reply, llm.engine.info.path)


def interactive(reply, model_path: str) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    print(f"dllm chat — {model_path}. Ctrl-D to exit.", file=sys.stderr)
    history: list[dict[str, str]] = []
    while True:
        try:
            message = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # Ctrl-C drops the line, as a shell does
            print(file=sys.stderr)
            continue
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        try:
            answer = reply(history)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
