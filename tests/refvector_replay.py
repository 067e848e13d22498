"""Replay of the reference vectors (``tests/data/refvectors/*.json``, written by
``scripts/refvectors/``): rebuild the tiny checkpoint the official generator ran on, check its
weights are the same (``check_factory_weights``), and run the same prompts through ``LLM.generate``.

A family's test module maps the reference function's own settings (``vector["settings"]``)
to engine arguments and ``SamplingParams``; that mapping is a rule per reference function,
never per case, so vectors made later from the same references on other prompts and settings
replay through it unchanged."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from dllm import LLM, SamplingParams
from dllm.testing import make_tiny_checkpoint
from dllm.testing.factory import profile_mismatch, weights_digest, weights_profile

DATA = Path(__file__).parent / "data" / "refvectors"
# The weights' profiles of every vector's checkpoint, keyed by the digest the vector records
# (scripts/refvectors/profiles.py): on a machine whose math library rounds the factory's laws
# differently from the one that made the vectors, the profile says the weights are the same.
PROFILES = DATA / "weights_profiles.json"


@cache
def _profiles() -> dict[str, Any]:
    return json.loads(PROFILES.read_text(encoding="utf-8"))


def check_factory_weights(path: Path, checkpoint: dict[str, Any], label: str) -> None:
    """Fails if the factory no longer makes the checkpoint a vector was made on: the same
    bytes as recorded (``weights_sha256``), or else the recorded profile within
    ``PROFILE_RTOL`` (the last bits of ``randn``/``exp`` differ between machines)."""
    want = checkpoint["weights_sha256"]
    if weights_digest(path) == want:
        return
    profile = _profiles().get(want)
    bad = (["(no profile recorded for this digest)"] if profile is None
           else profile_mismatch(weights_profile(path), profile))
    assert not bad, (f"{label}: the factory's weights changed since the vector was made "
                     f"({', '.join(bad[:4])}); re-run scripts/refvectors")


def load_vectors(prefix: str) -> list[dict[str, Any]]:
    """Every vector whose file name starts with ``prefix``, sorted by name."""
    out = []
    for path in sorted(DATA.glob(f"{prefix}*.json")):
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
    return out


def vector_ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


_ROOT: list[Path] = []


def set_checkpoint_root(path: Path) -> None:
    _ROOT[:] = [path]


@cache
def _checkpoint(architecture: str, seed: int, overrides_json: str) -> Path:
    key = hashlib.sha256(f"{architecture}|{seed}|{overrides_json}".encode()).hexdigest()[:16]
    path = _ROOT[0] / f"{architecture}-{key}"
    make_tiny_checkpoint(architecture, path, seed=seed, **json.loads(overrides_json))
    return path


def checkpoint_for(vector: dict[str, Any]) -> Path:
    """The vector's checkpoint, built once per session; fails if the factory drifted."""
    c = vector["checkpoint"]
    path = _checkpoint(c["architecture"], c["seed"], json.dumps(c["overrides"], sort_keys=True))
    check_factory_weights(path, c, f"{vector['name']} ({c['architecture']})")
    return path


@cache
def engine_for(path: Path, engine_args_json: str) -> LLM:
    """Separate commit forwards unless the args say otherwise: the references run one store
    forward per block, and the forward counts are compared with theirs
    (``tests/test_merged_commit.py`` replays the vectors with merged commits)."""
    args = {"merged_commit": False, **json.loads(engine_args_json)}
    return LLM(str(path), device="cpu", dtype="float32", **args)


def get_llm(vector: dict[str, Any], engine_args: dict[str, Any]) -> LLM:
    return engine_for(checkpoint_for(vector), json.dumps(engine_args, sort_keys=True))


@dataclass
class Replay:
    """What one vector asks of the engine: per row, its prompt ids, its params, and the
    tokens it must produce (the reference's generated ids, cut where dllm's output ends)."""

    engine_args: dict[str, Any]
    prompts: list[list[int]]
    params: list[SamplingParams]
    expected: list[list[int]]
    num_forwards: int | None = None  # the reference's, where the engine's structure is its
    notes: list[str] = field(default_factory=list)


def first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"first difference at generated position {i}: got {a}, reference {b}"
    return f"lengths differ: got {len(got)}, reference {len(want)}"


def check_outputs(outs: list, replay: Replay, name: str) -> None:
    for row, (out, want) in enumerate(zip(outs, replay.expected, strict=True)):
        got = list(out.token_ids)
        assert got == want, (f"{name} row {row}: {first_difference(got, want)}\n"
                             f"got       {got}\nreference {want}")


def run_together(vector: dict[str, Any], replay: Replay) -> list:
    """The vector's rows in one ``generate`` call."""
    return get_llm(vector, replay.engine_args).generate(replay.prompts, replay.params)


def run_between(vector: dict[str, Any], replay: Replay, other_prompt: list[int],
                other_params: SamplingParams) -> list:
    """The vector's rows in one batch between two copies of an unrelated request; the
    vector's outputs only."""
    llm = get_llm(vector, replay.engine_args)
    outs = llm.generate([other_prompt, *replay.prompts, other_prompt],
                        [other_params, *replay.params, other_params])
    return outs[1:-1]
