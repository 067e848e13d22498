"""The per-layer math that a runner may swap for fused kernels: RMSNorm (plain, with the
residual add, per head), SwiGLU's ``silu(gate) * up`` and rotary embedding.

``LayerOps`` is the plain-PyTorch reference (the CPU path and the numerics tests compare
against). A runner installs a faster implementation of the same interface on every module of a
model with ``install_ops`` (``dllm.runner.kernels.FlashInferOps`` on CUDA): the models call
``self.ops.<op>`` and never branch on the hardware themselves. A fused implementation computes
the same function up to the rounding of the activation dtype (it keeps float32 inside a
kernel where the reference rounds between steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dllm.models.layers import RotaryEmbedding


class LayerOps:
    """The reference implementation, in plain PyTorch."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / rms(x)`` over the last axis, the statistics in float32 (as the HF
        reference models do). ``F.rms_norm`` is one fused kernel where torch has one."""
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
        return weight * y.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``. An implementation may reuse the
        storage of ``x`` and ``residual`` (the decoder passes tensors it owns)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Per-head RMSNorm of ``x`` ``[T, N, D]`` (a strided view is fine) → ``[T, N, D]``."""
        return self.rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` of ``[..., 2d]`` → ``[..., d]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor, memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at ``positions`` of q ``[T, H, D]`` and k ``[T, Hkv, D]`` (strided views are
        fine) → rotated ``[T, H*D]``, ``[T, Hkv*D]``."""
        t, h, d = q.shape
        return rotary(positions, q.reshape(t, h * d), k.reshape(t, k.shape[1] * d), memo)


TORCH_OPS = LayerOps()


class UsesOps:
    """Mixin of the modules that call ``self.ops`` (the reference until a runner installs
    another implementation)."""

    ops: LayerOps = TORCH_OPS


def install_ops(model: nn.Module, ops: LayerOps) -> int:
    """Point every module of ``model`` that uses layer ops at ``ops``; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, UsesOps):
            m.ops = ops
            n += 1
    return n
