"""Fast-dLLM v2's hierarchical decoding: threshold decoding inside the first sub-block of
the block that still has masks."""

from __future__ import annotations

import torch

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.sampling import log_confidence, sample_tokens
from dllm.algorithms.selection import finish, masked_positions, select_top
from dllm.algorithms.threshold import bounded


class Hierarchical(UnmaskingAlgorithm):
    """The block is cut into sub-blocks of ``sub_block_size`` positions (counted from the
    block start). Only the first sub-block that still has masks is decoded: its masked
    positions with confidence above ``threshold``, and at least its most confident one.
    The block is done when no position in it is masked.

    Reference: Fast-dLLM v2 ``Fast_dLLM_QwenForCausalLM.batch_sample`` (``small_block_size``
    loop: ``unmask_idx = x1_p > threshold`` plus the per-row argmax) and SGLang
    ``dllm/algorithm/hierarchy_block.py``. The first token of a block, read from the
    previous block's commit forward, is the engine's job; here it is simply not masked.

    Keys: ``threshold`` (float in [0, 1], default 0.9, strict ``>``), ``sub_block_size``
    (int in [1, block size], default 8; a last partial sub-block is allowed).

    Confidence: tempered, filtered softmax in float32. Ties: lower position first.
    """

    name = "hierarchical"
    defaults = {"threshold": 0.9, "sub_block_size": 8}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        block = x.tokens.shape[-1]
        index = torch.arange(block, device=x.tokens.device)
        sub_block = index[None, :] // x.config["sub_block_size"][:, None]
        first = torch.where(masked, sub_block, block).amin(dim=-1, keepdim=True)
        active = masked & (sub_block == first)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step)
        above = active & (sample.confidence > x.config["threshold"][:, None])
        best = select_top(log_confidence(sample), active, torch.ones_like(x.step))
        return bounded(finish(x, sample.x0, above | best, masked,
                              confidence=sample.confidence), x)
