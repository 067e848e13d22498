"""The unmasking-algorithm contract: what the engine hands an algorithm after each denoise
forward, what it gets back, and how per-request settings are validated and stacked.

An algorithm's ``step`` is pure tensor code on the logits' device: no ``.item()``,
``.tolist()``, ``.cpu()``, ``bool(tensor)``, Python branches on tensor values or
data-dependent shapes, so the engine can capture it in a CUDA graph together with the
forward. Everything a step needs arrives as ``[bs]`` or ``[bs, B]`` tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor


@dataclass
class SamplingTensors:
    """Per-request sampling settings, one row per request, on the logits' device."""

    temperature: Tensor  # [bs] float32, 0 = greedy
    top_k: Tensor  # [bs] int64, 0 = off
    top_p: Tensor  # [bs] float32, 1.0 = off
    seed: Tensor  # [bs] int64
    # Host-side facts about the whole batch (part of a captured graph's identity). False
    # lets the step skip work no row needs; True is always correct.
    may_sample: bool = True  # some row may have temperature > 0 (else: no noise hashing)
    may_filter: bool = True  # some sampled row may use top-k / top-p (else: no vocab sort)
    may_filter_any: bool = True  # some row, sampled or greedy, sets top-k / top-p (Dream)


@dataclass
class DenoiseInput:
    logits: Tensor  # [bs, B, V] aligned: logits[r, i] predicts block position i (any float dtype)
    tokens: Tensor  # [bs, B] int64 current block tokens, == mask_id where still masked
    editable: Tensor  # [bs, B] bool, False at prompt positions inside the block (never changed)
    mask_id: int
    step: Tensor  # [bs] int64 denoise forwards already taken on this block (0 at the first)
    num_initial_masks: Tensor  # [bs] int64 masked positions when the block started
    positions: Tensor  # [bs, B] int64 absolute positions (RNG counters)
    sampling: SamplingTensors
    config: dict[str, Tensor]  # per-request settings stacked to [bs] tensors (stack_configs)
    state: dict[str, Tensor]  # per-row state kept across steps of one block; zeros at block start
    # [bs] int64 positions of the block that a step schedule divides (prompt positions inside
    # the block included: SDAR and LLaDA2 split the block length); None: the block width
    block_len: Tensor | None = None

    @property
    def schedule_len(self) -> Tensor:
        if self.block_len is not None:
            return self.block_len
        return torch.full_like(self.step, self.tokens.shape[-1])


@dataclass
class DenoiseOutput:
    tokens: Tensor  # [bs, B] int64 new block tokens
    done: Tensor  # [bs] bool block resolved (no masks left and any edit phase finished)
    state: dict[str, Tensor]
    num_transferred: Tensor  # [bs] int64 mask -> token transfers this step
    # [bs, B] float32 the algorithm's own score of each position's proposal (reported in
    # step events, never read by the engine), or a function computing it on demand; None:
    # the engine reports the proposal's probability
    confidence: Tensor | Callable[[], Tensor] | None = None


# Every per-request key any dllm component reads. A request may carry keys of other
# algorithms (and engine keys such as ``block_size``); only keys outside this set are errors.
KNOWN_KEYS: frozenset[str] = frozenset(
    {
        "algorithm",
        "threshold",
        "steps_per_block",
        "edit_threshold",
        "max_post_edit_steps",
        "eb_gamma",
        "block_size",
        "steps",
        "cfg_scale",
        "cache_mode",
        "alg_temp",
        "sub_block_size",
        "factor",
        "remasking",
        "gumbel_fp64",
        "all_steps",
        "rank_unfiltered",
    }
)

_BLOCK = "block_size"  # an upper bound equal to the request's block size


@dataclass(frozen=True)
class KeySpec:
    """Type and range of one algorithm key. Strings are stacked as their index in ``choices``."""

    kind: type
    low: float | None = None
    high: float | str | None = None
    low_inclusive: bool = True
    choices: tuple[str, ...] = ()
    zero_means_block: bool = False  # 0 stands for "the block size"

    @property
    def dtype(self) -> torch.dtype:
        return {int: torch.int64, float: torch.float32, bool: torch.bool, str: torch.int64}[
            self.kind
        ]

    def check(self, key: str, value: Any, block_size: int) -> Any:
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{key!r} must be a bool, got {value!r}")
            return value
        if self.kind is str:
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"{key!r} must be one of {list(self.choices)}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key!r} must be a number, got {value!r}")
        if self.kind is int:
            if not isinstance(value, int):
                raise ValueError(f"{key!r} must be an integer, got {value!r}")
        else:
            try:
                value = float(value)
            except OverflowError:  # an integer beyond the float range
                value = math.inf
            if not math.isfinite(value):
                raise ValueError(f"{key!r} must be finite, got {value!r}")
        if self.zero_means_block and value == 0:
            value = block_size
        high = block_size if self.high == _BLOCK else self.high
        low_ok = self.low is None or (value >= self.low if self.low_inclusive else value > self.low)
        if not low_ok or (high is not None and value > high):
            lo = "-inf" if self.low is None else f"{self.low}"
            bracket = "[" if self.low_inclusive else "("
            raise ValueError(
                f"{key!r} = {value!r} is out of range {bracket}{lo}, "
                f"{'inf' if high is None else high}]"
            )
        return value


KEY_SPECS: dict[str, KeySpec] = {
    "threshold": KeySpec(float, 0.0, 1.0),
    "edit_threshold": KeySpec(float, 0.0, 1.0),
    "steps_per_block": KeySpec(int, 0, None, zero_means_block=True),
    "steps": KeySpec(int, 0, None, zero_means_block=True),
    "max_post_edit_steps": KeySpec(int, 0, None),
    "eb_gamma": KeySpec(float, 0.0, None),
    "alg_temp": KeySpec(float, 0.0, None),
    "sub_block_size": KeySpec(int, 1, _BLOCK),
    "factor": KeySpec(float, 0.0, None, low_inclusive=False),
    "remasking": KeySpec(str, choices=("low_confidence", "random")),
    "gumbel_fp64": KeySpec(bool),
    "all_steps": KeySpec(bool),
    "rank_unfiltered": KeySpec(bool),
}
assert set(KEY_SPECS) <= KNOWN_KEYS


class UnmaskingAlgorithm(ABC):
    """One denoise-step rule. Subclasses set ``name``, ``defaults`` (the keys they read)
    and optionally ``state_keys`` (int64 ``[bs]`` tensors, zero at each block start)."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, int | float | bool | str]]
    state_keys: ClassVar[tuple[str, ...]] = ()
    # Whether the algorithm may change a mask-free block's tokens (token editing): the block
    # is final only when a step's output says so, so its commit forward stays a forward of
    # its own (``dllm.block_diffusion``: no merged commit).
    edits: ClassVar[bool] = False

    def surely_done(self, config: Mapping[str, Any], step: int) -> bool:
        """Whether the block is done after denoise step ``step`` (counted from 0) whatever
        the logits, known on the host from the validated ``config`` alone (a fixed schedule's
        last step). The overlap schedule merges a block's commit into the next block's first
        step only then (``dllm.block_diffusion``). Default: never known."""
        return False

    def surely_continues(self, config: Mapping[str, Any], step: int, block_len: int) -> bool:
        """Whether the block is certainly NOT done after denoise step ``step`` of a block of
        ``block_len`` masked positions, whatever the logits (the overlap schedule of
        full-attention diffusion queues the block's next step before reading this one's
        result only then: ``dllm.full_diffusion``). Default: never known."""
        return False

    def validate(self, config: Mapping[str, Any], block_size: int) -> dict:
        """Merge ``config`` over ``defaults`` and check it; ValueError names the bad key.

        Keys of other algorithms (any of ``KNOWN_KEYS``) are accepted and dropped."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"'block_size' must be a positive integer, got {block_size!r}")
        merged: dict[str, Any] = dict(self.defaults)
        for key, value in config.items():
            if key in self.defaults:
                merged[key] = value
            elif key not in KNOWN_KEYS:
                raise ValueError(
                    f"unknown key {key!r} for algorithm {self.name!r}; "
                    f"it reads {sorted(self.defaults)}"
                )
        return {key: KEY_SPECS[key].check(key, merged[key], block_size) for key in self.defaults}

    def stack_configs(self, configs: list[dict], device: torch.device | str) -> dict[str, Tensor]:
        """Validated per-request dicts -> one ``[bs]`` tensor per key (strings as indices)."""
        out: dict[str, Tensor] = {}
        for key in self.defaults:
            spec = KEY_SPECS[key]
            values = [c[key] for c in configs]
            if spec.kind is str:
                values = [spec.choices.index(v) for v in values]
            out[key] = torch.tensor(values, dtype=spec.dtype, device=device)
        return out

    def init_state(self, batch_size: int, device: torch.device | str) -> dict[str, Tensor]:
        """The zero state of a fresh block."""
        return {
            k: torch.zeros(batch_size, dtype=torch.int64, device=device) for k in self.state_keys
        }

    @abstractmethod
    def step(self, x: DenoiseInput) -> DenoiseOutput: ...
