"""``dllm chat``: answer one message, or chat on the terminal (history kept, Ctrl-D exits).

Without ``--model`` it runs the built-in model (``dllm/builtin_model/``). That model was trained
mostly on single questions (a tenth of its examples carry one or two earlier exchanges), so by
default it is shown only the last earlier exchange; the whole history is still kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from dllm.cli_args import json_object, take_positional_model
from dllm.watch import add_watch_flags

BUILTIN_HISTORY = 1  # earlier exchanges the built-in model is shown (accuracy drops with more)
BUILTIN_SCOPE = ("a 6.9M-parameter model that knows six kinds of question: adding and "
                 "subtracting numbers up to 3 digits, comparing two numbers, reversing a word, "
                 "sorting 3-5 words, counting a letter in a word; e.g. 'What is 17+25?', "
                 "'Reverse the word: planet'; it cannot answer anything else")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("words", nargs="*", metavar="[MODEL] MESSAGE",
                   help="a message to answer once (without it, chat interactively), after the "
                        "model's directory if it is not given by --model: with two arguments "
                        "the first is the model; with one, it is the model if it is a "
                        "checkpoint directory (holds config.json), else the message")
    p.add_argument("--system", default=None, help="a system message put first")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dllm", type=json_object, default=None,
                   help='per-request diffusion settings as JSON, e.g. \'{"threshold": 0.9}\'')
    p.add_argument("--history", type=int, default=None,
                   help="earlier exchanges the model sees (default: all; "
                        f"{BUILTIN_HISTORY} for the built-in model)")
    add_watch_flags(p, "show each answer as it denoises")
    p.add_argument("--stats", action="store_true",
                   help="after each answer, print its statistics on stderr: tokens, forwards, "
                        "tokens per forward, seconds, tokens per second")


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

    if hasattr(args, "words"):
        args.message = take_positional_model(args, args.words, "message")
    cfg = engine_config_from_args(args)
    llm = LLM(**{k: getattr(cfg, k) for k in cfg.field_names()})
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            dllm=args.dllm or {})
    keep = args.history if args.history is not None else (
        BUILTIN_HISTORY if args.model in (None, "builtin-hybrid") else None)

    watch = getattr(args, "watch", False)

    def reply(history: list[dict[str, Any]]) -> str:
        start = time.perf_counter()
        messages = prompt_messages(history, args.system, keep)
        if watch:
            from dllm.watch import Watcher

            out = Watcher(llm.engine, delay=args.watch_delay).run(messages, params)
            if out.error:
                raise RuntimeError(out.error)
            return out.text.strip()
        out = llm.chat(messages, params)[0]
        if out.error:
            raise RuntimeError(out.error)
        if getattr(args, "stats", False):
            print(answer_stats(out, time.perf_counter() - start), file=sys.stderr)
        return out.text.strip()

    if args.message is not None:
        answer = reply([{"role": "user", "content": args.message}])
        if not watch:  # the watch view has drawn it
            print(answer, flush=True)
        return 0
    return interactive(reply, llm.engine.info.path, args.model is None, echo=not watch)


def answer_stats(out: Any, seconds: float) -> str:
    """One answer's statistics (``dllm chat --stats``)."""
    n = out.completion_tokens
    per_forward = n / max(out.num_denoise_forwards, 1) if out.num_denoise_forwards else \
        out.tokens_per_forward
    return (f"[{out.prompt_tokens} prompt + {n} output tokens, {out.num_forward_passes} "
            f"forwards ({out.num_denoise_forwards} denoise, {out.num_blocks} blocks), "
            f"{per_forward:.2f} tokens/forward, {seconds:.2f} s, "
            f"{n / max(seconds, 1e-9):.1f} tokens/s]")


def interactive(reply, model_path: str, builtin: bool = False, echo: bool = True) -> int:
    """``echo``: print each answer (False: ``reply`` has shown it, ``--watch``)."""
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    print(f"dllm chat — {model_path}. Ctrl-D to exit.", file=sys.stderr)
    if builtin:
        print(f"The built-in model: {BUILTIN_SCOPE}.", file=sys.stderr)
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
        if echo:
            print(answer, flush=True)
