"""Per-request generation settings (the library contract, DESIGN §10)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dllm.algorithms.base import KEY_SPECS, KNOWN_KEYS
from dllm.trace import MAX_TOP_LOGPROBS

# Per-request diffusion keys accepted inside ``SamplingParams.dllm`` (DESIGN §5).
DLLM_KEYS = KNOWN_KEYS
# Full-attention models (LLaDA, Dream): how the KV of a step is reused (``dllm.full_diffusion``).
CACHE_MODES = ("exact", "prefix", "dual")
# Integers land in int64 tensors (the step's seed and top-k buffers, token ids).
INT64_MAX = 2**63 - 1
# The block size a key's "at most the block" range is checked against before the request's
# block is known (the request factory checks it again against the real one).
_ANY_BLOCK = INT64_MAX


@dataclass
class SamplingParams:
    """How one request is generated.

    ``max_new_tokens`` caps the output; a block is still denoised whole (DESIGN §4) and the
    output is cut inside it. ``temperature == 0`` is greedy and deterministic. ``seed`` fixes
    the request's own random stream (independent of the batch it runs in). ``dllm`` holds
    per-request diffusion settings, e.g. ``{"algorithm": "threshold", "threshold": 0.9}``.

    Diffusion models only (``dllm.trace``): ``denoise_steps`` records one ``StepEvent`` per
    denoise forward (streamed with the chunks); ``logprobs`` (0 to 20) records each output
    token's log-probability under the forward that committed it, with that many top
    alternatives. Requests that set neither cost nothing extra.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    dllm: dict[str, Any] = field(default_factory=dict)
    denoise_steps: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.dllm = dict(self.dllm or {})
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        _check_int("max_new_tokens", self.max_new_tokens, lo=1)
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, lo=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if not isinstance(self.denoise_steps, bool):
            raise ValueError("denoise_steps must be a boolean")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        unknown = sorted(set(self.dllm) - DLLM_KEYS)
        if unknown:
            raise ValueError(f"unknown dllm setting(s): {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(DLLM_KEYS))}")
        check_dllm_values(self.dllm)

    @property
    def traced(self) -> bool:
        """The request asked for step events or log-probabilities."""
        return self.denoise_steps or self.logprobs is not None

    @property
    def effective_top_k(self) -> int:
        """0 means no top-k filtering (-1 is accepted as vLLM's spelling of the same)."""
        return max(self.top_k, 0)


def check_dllm_values(dllm: dict[str, Any]) -> None:
    """Type and range of every ``dllm`` key given, whichever algorithm reads it (the
    algorithm checks its own keys again, against the request's block size)."""
    algorithm = dllm.get("algorithm")
    if algorithm is not None and not isinstance(algorithm, str):
        raise ValueError(f"dllm.algorithm must be a string, got {algorithm!r}")
    for key, value in dllm.items():
        spec = KEY_SPECS.get(key)
        if spec is not None:
            try:
                spec.check(key, value, _ANY_BLOCK)
            except ValueError as exc:
                raise ValueError(f"dllm.{exc}") from None
            if spec.kind is int and value > INT64_MAX:
                raise ValueError(f"dllm.{key!r} = {value} is out of range (at most "
                                 f"{INT64_MAX})")
    check_engine_keys(dllm)


def check_engine_keys(dllm: dict[str, Any]) -> None:
    """Value checks of the ``dllm`` keys the engine reads itself (the algorithms check
    their own keys): ``block_size``, ``cache_mode``, ``cfg_scale``."""
    if "block_size" in dllm:
        _check_int("dllm.block_size", dllm["block_size"], lo=1)
    if "cache_mode" in dllm and dllm["cache_mode"] not in CACHE_MODES:
        raise ValueError(f"dllm.cache_mode must be one of {', '.join(CACHE_MODES)}; "
                         f"got {dllm['cache_mode']!r}")
    if "cfg_scale" in dllm:
        _check_number("dllm.cfg_scale", dllm["cfg_scale"], lo=0.0)


def _check_int(name: str, value: Any, lo: int | None = None, hi: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {str(value)[:40]}")


def _check_number(name: str, value: Any, lo: float | None = None,
                  hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be finite, got {str(value)[:40]}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
