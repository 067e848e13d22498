"""Fixed-quota low-confidence remasking (LLaDA, SDAR) and SDAR's dynamic variant."""

from __future__ import annotations

import torch
from torch import Tensor

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.rng import Stream, position_uniform
from dllm.algorithms.sampling import log_confidence, sample_tokens
from dllm.algorithms.selection import (
    at_least_one,
    finish,
    llada_quota,
    masked_positions,
    select_top,
)

_RANDOM = 1  # index of "random" in KEY_SPECS["remasking"].choices


def step_quota(x: DenoiseInput, masked: Tensor) -> Tensor:
    """This step's quota: LLaDA's split of ``num_initial_masks`` over ``steps_per_block``;
    the last scheduled step (and any later one) takes every remaining mask; at least one."""
    steps = x.config["steps_per_block"]
    num_masked = masked.sum(dim=-1)
    quota = llada_quota(x.num_initial_masks, steps, x.step)
    quota = torch.where(x.step >= steps - 1, num_masked, quota)
    return at_least_one(quota, num_masked)


class LowConfidenceStatic(UnmaskingAlgorithm):
    """Fixed quota per step, highest confidence first.

    Reference: LLaDA ``generate.py`` (``get_num_transfer_tokens``, ``low_confidence`` /
    ``random`` remasking) and SDAR ``generate.py`` (``low_confidence_static``).

    Keys: ``steps_per_block`` (int, default 0 = block size): the quota of step ``i`` is
    ``n // steps + (i < n % steps)`` with ``n = num_initial_masks``; ``remasking``
    (``"low_confidence"`` | ``"random"``, default ``"low_confidence"``): rank masked
    positions by the confidence of their sampled token, or by a counter-RNG uniform
    (LLaDA's ``torch.rand`` remasking); ``gumbel_fp64`` (bool, default False): LLaDA's
    float64 ``exp(l) / (-log u) ** T`` draw with plain-softmax confidence (LLaDA parity);
    False uses the shared sampler, whose confidence is the tempered, filtered softmax
    (SDAR parity).

    Softmax float32 (ranked by log-probability, see ``sampling``). Ties: lower position
    first. The last scheduled step takes every remaining mask and every step at least one,
    so a block always finishes in ``steps_per_block`` steps.
    """

    name = "low_confidence_static"
    defaults = {"steps_per_block": 0, "remasking": "low_confidence", "gumbel_fp64": False}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(
            x.logits, x.sampling, x.positions, x.step,
            exclude_id=x.mask_id, gumbel_fp64=x.config["gumbel_fp64"],
        )  # fmt: skip
        random = position_uniform(x.sampling.seed, x.step, x.positions, Stream.POSITION)
        score = torch.where(
            (x.config["remasking"] == _RANDOM)[:, None], random, log_confidence(sample)
        )
        transfer = select_top(score, masked, step_quota(x, masked))
        return finish(x, sample.x0, transfer, masked)


class LowConfidenceDynamic(UnmaskingAlgorithm):
    """Every masked position whose confidence is above ``threshold`` when at least the
    quota of them are, otherwise the top-quota.

    Reference: SDAR ``generate.py`` (``low_confidence_dynamic``).

    Keys: ``threshold`` (float in [0, 1], default 0.85, SDAR's), compared strictly
    (``conf > threshold``); ``steps_per_block`` (int, default 0 = block size) for the
    LLaDA quota of :class:`LowConfidenceStatic`. SDAR splits the block length rather than
    the initial mask count; the two agree on blocks without prompt positions.

    Confidence: tempered, filtered softmax of the sampled token (float32, ranked by
    log-probability). Ties: lower position first.
    """

    name = "low_confidence_dynamic"
    defaults = {"threshold": 0.85, "steps_per_block": 0}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step, exclude_id=x.mask_id)
        quota = step_quota(x, masked)
        high = masked & (sample.confidence > x.config["threshold"][:, None])
        enough = (high.sum(dim=-1) >= quota)[:, None]
        transfer = torch.where(enough, high, select_top(log_confidence(sample), masked, quota))
        return finish(x, sample.x0, transfer, masked)
