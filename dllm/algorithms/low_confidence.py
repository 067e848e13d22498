"""Fixed-quota low-confidence remasking (LLaDA, SDAR, LLaDA2), SDAR's dynamic variant and
SDAR's sequential order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.rng import Stream, position_uniform
from dllm.algorithms.sampling import log_confidence, sample_tokens
from dllm.algorithms.selection import (
    finish,
    llada_quota,
    masked_positions,
    rank_positions,
    select_top,
)

_RANDOM = 1  # index of "random" in KEY_SPECS["remasking"].choices


def step_quota(x: DenoiseInput, masked: Tensor) -> Tensor:
    """This step's quota: ``get_num_transfer_tokens(block length, steps)[step]`` (LLaDA, SDAR,
    LLaDA2: the schedule divides the block's length, prompt positions inside it included),
    capped by the masks left. A block that shares positions with the prompt therefore takes
    fewer steps; a step past the schedule, or of a schedule longer than the block, has
    quota 0 (zero-token steps, as in the references)."""
    quota = llada_quota(x.schedule_len, x.config["steps_per_block"], x.step)
    return torch.minimum(quota, masked.sum(dim=-1))


def schedule_done(x: DenoiseInput, masked_after: Tensor) -> Tensor:
    """``[bs]`` bool: the block ends after this step when no mask is left, or (``all_steps``
    unset) never later than the last scheduled step; with ``all_steps`` (LLaDA's
    ``generate``) exactly at the last scheduled step, zero-token steps included. A position
    whose proposal was the mask token itself stays masked (the references keep the mask id
    in the vocabulary); it stays so when the schedule ends."""
    last = x.step + 1 >= x.config["steps_per_block"]
    empty = ~masked_after.any(dim=-1)
    return torch.where(x.config["all_steps"], last, empty | last)


class _Scheduled(UnmaskingAlgorithm):
    """The algorithms of ``step_quota``'s schedule: the block ends at its last scheduled step
    at the latest (``schedule_done``)."""

    # Whether a step never fills more than its quota (the dynamic rule may fill more).
    at_most_quota: ClassVar[bool] = True

    def surely_done(self, config: Mapping[str, Any], step: int) -> bool:
        return step + 1 >= config["steps_per_block"]

    def surely_continues(self, config: Mapping[str, Any], step: int, block_len: int) -> bool:
        """Before the last step: always with ``all_steps``; else while the quotas so far
        leave a mask (a step fills at most its quota: masks remain)."""
        steps = config["steps_per_block"]
        if step + 1 >= steps:
            return False
        if config["all_steps"]:
            return True
        filled = (block_len // steps) * (step + 1) + min(step + 1, block_len % steps)
        return self.at_most_quota and filled < block_len


class LowConfidenceStatic(_Scheduled):
    """Fixed quota per step, highest confidence first.

    Reference: LLaDA ``generate.py`` (``get_num_transfer_tokens``, ``low_confidence`` /
    ``random`` remasking), SDAR ``generate.py`` / ``huggingface_bd3.py``
    (``low_confidence_static``) and LLaDA2 ``generate`` with ``threshold`` 1.

    Keys: ``steps_per_block`` (int >= 0, default 0 = block size; more steps than positions
    give zero-token steps); ``remasking`` (``"low_confidence"`` | ``"random"``, default
    ``"low_confidence"``): rank masked positions by the confidence of their sampled token, or
    by a counter-RNG uniform (LLaDA's ``torch.rand`` remasking); ``gumbel_fp64`` (bool,
    default False): LLaDA's float64 ``exp(l) / (-log u) ** T`` draw with plain-softmax
    confidence (LLaDA parity); False uses the shared sampler, whose confidence is the
    tempered, filtered softmax (SDAR parity); ``all_steps`` (bool, default False): run every
    scheduled step even after the block has no mask left (LLaDA's loop; the engine sets it
    for the LLaDA family); ``rank_unfiltered`` (bool, default False): rank by the tempered
    softmax before top-k / top-p (SDAR's evaluation wrapper ``huggingface_bd3.py``; its
    ``generate.py`` ranks the filtered one, the default).

    The quota (``step_quota``) splits the block length over the steps, capped by the masks
    left. The mask token is part of the vocabulary: a position whose proposal is the mask id
    stays masked and is ranked again (``schedule_done``). Softmax float32 over the whole
    vocabulary, ranked by log-probability (``sampling``). Ties: lower position first.
    """

    name = "low_confidence_static"
    defaults = {"steps_per_block": 0, "remasking": "low_confidence", "gumbel_fp64": False,
                "all_steps": False, "rank_unfiltered": False}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step,
                               gumbel_fp64=x.config["gumbel_fp64"],
                               unfiltered_confidence=x.config["rank_unfiltered"])
        random = position_uniform(x.sampling.seed, x.step, x.positions, Stream.POSITION)
        score = torch.where(
            (x.config["remasking"] == _RANDOM)[:, None], random, log_confidence(sample)
        )
        transfer = select_top(score, masked, step_quota(x, masked))
        return _finish_scheduled(x, sample.x0, transfer, masked, sample.confidence)


def _finish_scheduled(x: DenoiseInput, x0: Tensor, transfer: Tensor, masked: Tensor,
                      confidence: Tensor) -> DenoiseOutput:
    out = finish(x, x0, transfer, masked, confidence=confidence)
    out.done = schedule_done(x, (out.tokens == x.mask_id) & x.editable)
    return out


class LowConfidenceDynamic(_Scheduled):
    """Every masked position whose confidence is above ``threshold`` when at least the
    quota of them are, otherwise the top-quota.

    Reference: SDAR ``generate.py`` / ``huggingface_bd3.py`` (``low_confidence_dynamic``)
    and LLaDA2 ``generate`` (its ``threshold`` rule).

    Keys: ``threshold`` (float in [0, 1], default 0.85, SDAR's), compared strictly
    (``conf > threshold``, as both references); ``steps_per_block`` (int >= 0, default 0 =
    block size) for :func:`step_quota`, the static rule's quota; ``all_steps`` and
    ``rank_unfiltered`` as for :class:`LowConfidenceStatic`.

    Confidence: tempered, filtered softmax of the sampled token (float32, whole vocabulary,
    ranked by log-probability). Ties: lower position first.
    """

    name = "low_confidence_dynamic"
    defaults = {"threshold": 0.85, "steps_per_block": 0, "all_steps": False,
                "rank_unfiltered": False}
    at_most_quota = False

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step,
                               unfiltered_confidence=x.config["rank_unfiltered"])
        quota = step_quota(x, masked)
        high = masked & (sample.confidence > x.config["threshold"][:, None])
        enough = (high.sum(dim=-1) >= quota)[:, None]
        transfer = torch.where(enough, high, select_top(log_confidence(sample), masked, quota))
        return _finish_scheduled(x, sample.x0, transfer, masked, sample.confidence)


class Sequential(_Scheduled):
    """The quota of masked positions nearest the block start, left to right.

    Reference: SDAR ``generate.py`` (``remasking_strategy="sequential"``: the
    ``num_transfer_tokens[step]`` positions from the first mask on).

    Keys: ``steps_per_block`` (int >= 0, default 0 = block size) for :func:`step_quota`.
    The sampled token (tempered, filtered, whole vocabulary) fills each chosen position.
    """

    name = "sequential"
    defaults = {"steps_per_block": 0, "all_steps": False}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step)
        order = torch.arange(x.tokens.shape[-1], device=x.tokens.device, dtype=torch.float32)
        rank = rank_positions(order.expand_as(x.tokens), masked, descending=False)
        transfer = (rank < step_quota(x, masked)[:, None]) & masked
        return _finish_scheduled(x, sample.x0, transfer, masked, sample.confidence)
