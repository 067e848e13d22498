"""EB-Sampler: unmask the lowest-entropy positions while their entropies stay bounded."""

from __future__ import annotations

import torch

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.reductions import fixed_order_cumsum
from dllm.algorithms.sampling import sample_tokens
from dllm.algorithms.selection import finish, masked_positions, rank_positions
from dllm.algorithms.threshold import bounded


class EntropyBounded(UnmaskingAlgorithm):
    """Sort masked positions by entropy ascending, ``H_1 <= H_2 <= ...``, and take the
    longest prefix ``U`` with ``sum(H_U) - max(H_U) <= eb_gamma``, i.e. position ``k`` joins
    when the entropies before it sum to at most ``eb_gamma``. The first always joins.

    Reference: Ben-Hamu et al., "Accelerated Sampling from Masked Diffusion Models via
    Entropy Bounded Unmasking" (EB-Sampler, arXiv:2505.24857) and SGLang
    ``dllm/algorithm/eb_sampling.py``. The ``- max`` term of the paper makes the bound
    exclusive of the newest member; a "cumulative including itself" reading would take one
    token fewer.

    Keys: ``eb_gamma`` (float >= 0, default 0.1).

    Entropy (nats, float32) of the tempered, filtered sampling distribution; the sampled
    token fills each chosen position. Ties: lower position first.
    """

    name = "entropy_bounded"
    defaults = {"eb_gamma": 0.1}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step)
        h = sample.entropy()
        rank = rank_positions(h, masked, descending=False)
        order = torch.argsort(rank, dim=-1)
        h_sorted = torch.where(masked.gather(-1, order), h.gather(-1, order), 0.0)
        cumulative = fixed_order_cumsum(h_sorted)
        before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
        take_sorted = before <= x.config["eb_gamma"][:, None]
        take = take_sorted.gather(-1, rank) & masked
        return bounded(finish(x, sample.x0, take, masked, confidence=sample.confidence), x)
