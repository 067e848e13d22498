"""Attention visibility rules as boolean matrices (True = may attend)."""

from __future__ import annotations

import torch

from dllm.runner.forward_batch import AttentionMask


def visibility(
    kind: AttentionMask,
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    block_size: int = 1,
    block_offset: int = 0,
) -> torch.Tensor:
    """``[len(q_index), len(k_index)]`` bool: may query at cache index i see key at index j."""
    q = q_index[:, None]
    k = k_index[None, :]
    if kind is AttentionMask.CAUSAL:
        return k <= q
    if kind is AttentionMask.BLOCK_CAUSAL:
        # Indices before block_offset form block -1 (the un-blocked prefix of a
        # prompt-relative canvas); floor division keeps that ordering.
        return torch.div(k - block_offset, block_size, rounding_mode="floor") <= torch.div(
            q - block_offset, block_size, rounding_mode="floor"
        )
    if kind is AttentionMask.FULL:
        return torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q_index.device)
    raise ValueError(f"unknown attention mask {kind}")
