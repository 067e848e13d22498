"""Confidence-threshold parallel decoding (Fast-dLLM, SGLang ``LowConfidence``) and
Fast-dLLM's factor-based rule."""

from __future__ import annotations

import torch

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.sampling import log_confidence, sample_tokens
from dllm.algorithms.selection import finish, masked_positions, rank_positions, select_top

# Steps per block position after which a threshold rule gives up on positions that keep
# proposing the mask token (see Threshold).
MAX_STEPS_PER_POSITION = 4


def bounded(out: DenoiseOutput, x: DenoiseInput) -> DenoiseOutput:
    """``out`` with the block also done after ``MAX_STEPS_PER_POSITION x`` its length in
    steps."""
    out.done = out.done | (x.step + 1 >= MAX_STEPS_PER_POSITION * x.schedule_len)
    return out


class Threshold(UnmaskingAlgorithm):
    """Every masked position with confidence at least ``threshold``, and at least the most
    confident one.

    Reference: Fast-dLLM ``llada/generate.py`` ``get_transfer_index`` (with ``threshold``)
    and Fast-dLLM's Dream block cache (``alg="confidence_threshold"``): the top-1 always, the
    others unless ``conf < threshold`` (so ``conf == threshold`` is kept; SGLang's
    ``LowConfidence`` compares strictly).

    Keys: ``threshold`` (float in [0, 1], default 0.9).

    Confidence: tempered, filtered softmax of the sampled token in float32 over the whole
    vocabulary (Fast-dLLM uses the un-tempered float64 softmax; identical at temperature 0 up
    to precision). A position whose proposal is the mask token stays masked; the block ends
    when none is left, or after ``4 x`` its length in steps (a bound the reference lacks:
    it loops for as long as the model proposes the mask token). Ties for the guaranteed
    token: lower position first.
    """

    name = "threshold"
    defaults = {"threshold": 0.9}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step)
        above = masked & (sample.confidence >= x.config["threshold"][:, None])
        best = select_top(log_confidence(sample), masked, torch.ones_like(x.step))
        return bounded(finish(x, sample.x0, above | best, masked,
                              confidence=sample.confidence), x)


class Factor(UnmaskingAlgorithm):
    """Fast-dLLM's factor-based parallel decoding: with masked confidences sorted
    descending ``c_1 >= c_2 >= ...``, take the longest prefix with
    ``c_n >= 1 - factor / (n + 1)`` for every ``n >= 2`` (``c_1`` always passes).

    Reference: Fast-dLLM ``llada/generate.py`` ``get_transfer_index_dynamic``. Its loop
    also transfers every masked position when all but the last pass (``top_i == len - 1``
    after the loop); that quirk is reproduced for parity.

    Keys: ``factor`` (float > 0, default 1.0).

    Confidence: tempered, filtered softmax in float32 over the whole vocabulary (Fast-dLLM:
    un-tempered float64; identical at temperature 0 up to precision), thresholds in float32.
    Ends as :class:`Threshold`. Ties: lower position first.
    """

    name = "factor"
    defaults = {"factor": 1.0}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        num_masked = masked.sum(dim=-1)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step)
        rank = rank_positions(log_confidence(sample), masked)
        order = torch.argsort(rank, dim=-1)
        conf_sorted = sample.confidence.gather(-1, order)
        masked_sorted = masked.gather(-1, order)
        n = torch.arange(1, rank.shape[-1] + 1, device=rank.device, dtype=torch.float32)
        bound = 1.0 - x.config["factor"][:, None] / (n + 1.0)
        passes = ((conf_sorted >= bound) | (n == 1)) & masked_sorted
        count = passes.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
        count = torch.where((count == num_masked - 1) & (num_masked >= 2), num_masked, count)
        return bounded(finish(x, sample.x0, (rank < count[:, None]) & masked, masked,
                              confidence=sample.confidence), x)
