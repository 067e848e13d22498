"""Shared pieces of the step rules: which positions are masked, ranked selection with a
fixed tie rule, LLaDA's per-step quota, and assembling the output."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dllm.algorithms.base import DenoiseInput, DenoiseOutput

_LOWEST = torch.finfo(torch.float32).min


def masked_positions(x: DenoiseInput) -> Tensor:
    """``[bs, B]`` bool: still-masked positions that the algorithm may fill."""
    return (x.tokens == x.mask_id) & x.editable


def rank_positions(score: Tensor, candidate: Tensor, descending: bool = True) -> Tensor:
    """``[bs, B]`` int64 rank of each position by ``score`` among ``candidate`` positions.

    Candidates come first (rank 0 is the best); equal scores rank the lower position first
    (stable sort); non-candidates rank after every candidate."""
    score = score.float()
    if descending:
        key = torch.where(
            candidate, torch.nan_to_num(score, nan=_LOWEST, neginf=_LOWEST), float("-inf")
        )
    else:
        key = torch.where(
            candidate, torch.nan_to_num(score, nan=-_LOWEST, posinf=-_LOWEST), float("inf")
        )
    order = torch.sort(key, dim=-1, descending=descending, stable=True).indices
    arange = torch.arange(score.shape[-1], device=score.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, arange)


def select_top(score: Tensor, candidate: Tensor, count: Tensor, descending: bool = True) -> Tensor:
    """``[bs, B]`` bool: the ``count[r]`` best candidates of each row (ties: lower position)."""
    return (rank_positions(score, candidate, descending) < count[:, None]) & candidate


def llada_quota(num_initial_masks: Tensor, steps: Tensor, step: Tensor) -> Tensor:
    """LLaDA's ``get_num_transfer_tokens``: ``n // steps`` per step, one more on the first
    ``n % steps`` steps, 0 past the last step. ``[bs]`` int64 for the current ``step``."""
    steps = steps.clamp(min=1)
    quota = num_initial_masks // steps + (step < num_initial_masks % steps).to(torch.int64)
    return torch.where(step < steps, quota, 0)


def finish(
    x: DenoiseInput,
    x0: Tensor,
    transfer: Tensor,
    masked: Tensor,
    done: Tensor | None = None,
    state: dict[str, Tensor] | None = None,
    confidence: Tensor | Callable[[], Tensor] | None = None,
) -> DenoiseOutput:
    """Write ``x0`` at ``transfer`` positions. ``done`` defaults to "no mask left".
    ``confidence``: the algorithm's score of each proposal (``DenoiseOutput.confidence``)."""
    tokens = torch.where(transfer, x0, x.tokens)
    filled = transfer & masked
    if done is None:
        done = ~(masked & ~filled).any(dim=-1)
    return DenoiseOutput(
        tokens=tokens,
        done=done,
        state={} if state is None else state,
        num_transferred=filled.sum(dim=-1),
        confidence=confidence,
    )
