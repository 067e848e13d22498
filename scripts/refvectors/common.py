"""Shared plumbing of the reference-vector scripts (run under a reference virtual environment).

Each family script imports the official generator from a local checkout (``--ref-root``),
builds the tiny checkpoint with dllm's own factory (imported from this repository by path:
the factory needs only torch, safetensors and tokenizers, and the reference environment has
the same torch build, so the weights are the same bytes), runs the official generate
function on CPU in float32, and writes one JSON file per case with :func:`write_vector`.
Nothing of the reference code is copied here; only the ids it produced are committed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dllm.testing.factory import make_tiny_checkpoint, weights_digest  # noqa: E402

FORMAT_VERSION = 1


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--ref-root", required=True, type=Path,
                   help="folder holding the reference checkouts (one subfolder per repository)")
    p.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "refvectors")
    p.add_argument("--work", type=Path, default=Path("/tmp/dllm-refvectors"),
                   help="scratch folder for the tiny checkpoints")
    p.add_argument("--only", default=None, help="run only the cases whose name contains this")
    return p.parse_args()


def build_checkpoint(architecture: str, path: str | Path, seed: int = 0,
                     **overrides: Any) -> dict[str, Any]:
    """Write the factory's tiny checkpoint and return its description for the vector file."""
    path = Path(path)
    make_tiny_checkpoint(architecture, path, seed=seed, **overrides)
    return {"architecture": architecture, "seed": seed, "overrides": overrides,
            "weights_sha256": weights_digest(path)}


def commit_of(checkout: Path) -> str:
    """The commit of a reference checkout: its ``COMMIT`` file, else ``git rev-parse``."""
    marker = checkout / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class ForwardRecorder:
    """Counts the forwards of a model and keeps the ``input_ids`` fed to each."""

    def __init__(self) -> None:
        self.inputs: list[list[list[int]]] = []

    @contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator[ForwardRecorder]:
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.inputs.append(ids.tolist() if ids is not None else [])

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    @property
    def count(self) -> int:
        return len(self.inputs)


def run_recorded(model: torch.nn.Module, fn: Callable[[], Any]) -> tuple[Any, ForwardRecorder]:
    rec = ForwardRecorder()
    with rec.attach(model), torch.no_grad():
        out = fn()
    return out, rec


def write_vector(out_dir: Path, name: str, *, reference: str, reference_commit: str,
                 checkpoint: dict[str, Any], settings: dict[str, Any],
                 prompts: list[list[int]], outputs: list[list[int]], num_forwards: int,
                 forward_inputs: list[Any], notes: str = "",
                 extra: dict[str, Any] | None = None) -> Path:
    """One case. ``reference``: ``"owner/repo path::function"``; ``settings``: the reference
    function's own argument names and values (everything but the model and the prompt);
    ``outputs``: what the reference returned, per row, as it returned it (prompt included
    when it returns the whole canvas); ``forward_inputs``: the ids of each forward."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "format": FORMAT_VERSION,
        "name": name,
        "reference": reference,
        "reference_commit": reference_commit,
        "checkpoint": checkpoint,
        "settings": settings,
        "prompts": prompts,
        "outputs": outputs,
        "num_forwards": num_forwards,
        "forward_inputs": forward_inputs,
        "notes": notes,
        **(extra or {}),
    }
    path = out_dir / f"{name}.json"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, separators=(",", ":"))
        f.write("\n")
    return path
