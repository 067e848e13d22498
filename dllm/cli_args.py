"""Command-line flags generated from ``EngineConfig``: each field's flag spelling, type,
default, choices and help come from the dataclass (its annotation, its default and its
``metadata``), so the engine flags of every command that loads a model cannot drift from the
config. The commands import this module; it imports none of them."""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


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
        return {**kw, "type": json.loads}
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
