"""``python -m dllm.testing ARCHITECTURE DIR [--seed N] [--shards N] [--dtype D] [KEY=JSON ...]``
writes a tiny random checkpoint (see ``dllm.testing.factory``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from dllm.testing.factory import make_tiny_checkpoint, supported_architectures


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _fail(message: str) -> int:
    print(f"python -m dllm.testing: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm.testing",
                                     description="Write a tiny random checkpoint.")
    parser.add_argument("architecture", choices=supported_architectures())
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("overrides", nargs="*", type=_override, metavar="KEY=JSON",
                        help="config.json overrides, e.g. num_hidden_layers=3")
    args = parser.parse_intermixed_args(argv)
    if os.path.exists(args.path) and not os.path.isdir(args.path):
        return _fail(f"{args.path} is an existing file, not a directory; give a directory "
                     "path (created if missing)")
    try:
        path = make_tiny_checkpoint(args.architecture, args.path, seed=args.seed,
                                    shards=args.shards, dtype=args.dtype, **dict(args.overrides))
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
