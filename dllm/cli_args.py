"""Command-line flags generated from ``EngineConfig``: each field's flag spelling, type,
default, choices and help come from the dataclass (its annotation, its default and its
``metadata``), so the engine flags of every command that loads a model cannot drift from the
config. The commands import this module; it imports none of them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Any

from dllm.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The ``EngineConfig`` fields as flags (shared by every subcommand that loads a model)."""
    g = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        g.add_argument(flag, *f.metadata.get("aliases", ()), dest=f.name,
                       **_flag_kwargs(f, hints[f.name]))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.field_names()
    if getattr(args, "trust_remote_code", False):
        print("dllm: note: --trust-remote-code is not needed: dllm runs no code from "
              "checkpoints (every architecture is implemented here)", file=sys.stderr)
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value, or an error that shows the expected form."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{text[:100]!r} is not JSON; give a JSON object with the keys in double quotes, "
            """e.g. '{"threshold": 0.9}'""") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text[:100]!r} is not a JSON object; give one, e.g. '{{\"threshold\": 0.9}}'")
    return value


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), "config.json"))


def take_positional_model(args: argparse.Namespace, words: list[str],
                          text_name: str | None) -> str | None:
    """The vLLM habit ``dllm serve MODEL``: a positional model, the same as ``--model``.

    ``serve`` and ``eval`` (``text_name`` None) take one positional, the model. ``generate``
    and ``chat`` also take a prompt (``text_name``: what it is called): with two positionals
    the first is the model and the second the prompt; with one, it is the model when it is a
    checkpoint directory (it holds ``config.json``) and ``--model`` is not given, else the
    prompt. Sets ``args.model`` and returns the prompt (``None``: none given)."""
    limit = 1 if text_name is None else 2
    if len(words) > limit:
        what = "MODEL" if text_name is None else f"[MODEL] {text_name.upper()}"
        raise ValueError(f"{len(words)} positional arguments, {words[limit][:40]!r} and after; "
                         f"this command takes {what} (quote a {text_name or 'path'} that has "
                         "spaces)")
    model = text = None
    if text_name is None:
        model = words[0] if words else None
    elif len(words) == 2:
        model, text = words
    elif len(words) == 1:
        if args.model is None and is_checkpoint_dir(words[0]):
            model = words[0]
        else:
            text = words[0]
    if model is not None:
        if args.model is not None and args.model != model:
            raise ValueError(f"two models given: {model[:100]} and --model {args.model[:100]}; "
                             "give one")
        args.model = model
    return text


def _flag_kwargs(f: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    """argparse keywords for one field; its value type picks the conversion: a bool is a
    switch, a tuple takes one or more values, a dict is JSON."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    kw: dict[str, Any] = {"default": default, "help": f.metadata.get("help")}
    if "choices" in f.metadata:
        kw["choices"] = f.metadata["choices"]
    value = _strip_optional(annotation)
    if value is bool:
        return {**kw, "action": "store_const", "const": f.metadata.get("const", True)}
    if typing.get_origin(value) is tuple:
        return {**kw, "type": typing.get_args(value)[0], "nargs": "+"}
    if typing.get_origin(value) is dict:
        return {**kw, "type": json_object}
    if value in (int, float):
        return {**kw, "type": value}
    if value is str:
        return kw
    raise TypeError(f"EngineConfig.{f.name}: no command-line form for {annotation!r}")


def _strip_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def check_output_path(path: str, what: str) -> None:
    """Refuse an output path before the model loads: a directory, or one in a directory that
    does not exist. ``what`` says what the file should be (e.g. "a JSON file")."""
    if os.path.isdir(path):
        raise ValueError(f"--output {path} is a directory; give the path of {what}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--output {path}: no such directory: {parent}")
